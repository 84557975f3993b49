"""Gemma 3 270M steered at settings chosen on validation items, and the report.

`run(config, workdir, targets, num_samples)` runs a config with a
`selection` block (configs/gemma.py:selection) through
`train.steering.selection` in `selected/` below `workdir`: per method its
layer, direction method and alpha grid chosen on validation item sets
(the gated methods with the selection's gate, calibrated by default),
selection.json written before any test item is made, then the test item
sets scored once at those settings (results.json, gate_<method>.png).
Then the report (`summarize`): per method the chosen setting and, for the
gated ones, the gate (kappa, beta, the center's norm) and its trigger
rate on the validation and test held-out tokens at the chosen layer
against the 5%-95% band (the gate acts and selects); accuracy at matched
KL with the in-project study's report (`studies.steering.report`:
hierarchical bootstrap over item sets and items, gains, paired
differences, gate x geometry with each of its four cells at its own
selected setting, generations); and the room's earlier evaluation at
`config.layer` with the reference's settings (`results/layer<L>_results.json`)
as the reference-settings rows, when it was made from the same model file.
Writes `study.md`, `study.json` and `pareto_bands.png` into `workdir`.

A finished evaluation is reused when its config is the same and it was
made from the same model file (`layers.finished`); another config's or
file's is refused before any compute.
"""

import json
import os
from typing import Any, Sequence

from absl import logging

from studies.gemma_steering import layers
from studies.steering import intervals
from studies.steering import report
from train.analysis import stats
from train.errors import UsageError
from train.run import metrics as metrics_lib
from train.run.job import open_job
from train.steering import selection
from train.steering import selection_gate
from train.training import experiment as experiment_lib

# The evaluation's directory below the workdir.
NAME = 'selected'
# The room's stored evaluations: the reference settings' rows.
REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         'results')
# Paths below it are reported relative to it (the report is machine-free).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(REFERENCE)))
# A gate that acts and selects fires on this share of held-out tokens.
TRIGGER_BAND = (0.05, 0.95)


def check(config, targets: Sequence[float], num_samples: int) -> None:
  """The config's selection and the report's settings: UsageError naming
  the setting before anything is loaded."""
  selection.check_config(config)
  if 'none' not in config.methods:
    raise UsageError('methods', tuple(config.methods), 'must hold \'none\' '
                     '(the unsteered model is KL 0 of every method)')
  if not targets or list(targets) != sorted(targets) or min(targets) <= 0:
    raise UsageError('targets', tuple(targets), 'give increasing KL values > 0')
  if num_samples < 100:
    raise UsageError('bootstrap_samples', num_samples, 'must be >= 100')


def run(config, workdir: str, targets: Sequence[float],
        num_samples: int = 2000, reference: str = REFERENCE
        ) -> dict[str, Any]:
  """The study at selected settings (see the module docstring); returns
  its summary. `reference`: the folder of the reference settings'
  evaluation (`layer<config.layer>_results.json`)."""
  check(config, targets, num_samples)
  sha = layers.checked_model_file(config)
  workdir = experiment_lib.check_workdir(workdir)
  with open_job(workdir):
    out = os.path.join(workdir, NAME)
    results = layers.finished(config, out, sha)
    if results is None:
      logging.info('selecting and evaluating in %s', out)
      selection.evaluate(config, out)
      results = layers.finished(config, out, sha)
    else:
      logging.info('%s: reusing the finished evaluation', NAME)
    with open(os.path.join(out, selection.FILENAME)) as f:
      record = json.load(f)
    ref = reference_run(reference, config.layer, sha)
    summary, text = summarize(results, record, targets, num_samples, ref)
    metrics_lib.write_json_atomic(os.path.join(workdir, 'study.json'), summary)
    metrics_lib.write_text_atomic(os.path.join(workdir, 'study.md'), text)
    report.plot([results], os.path.join(workdir, 'pareto_bands.png'))
  return summary


def reference_run(folder: str, layer: int, sha: str
                  ) -> tuple[dict[str, Any] | None, str]:
  """(the reference settings' evaluation or None, where it is from or why
  it is left out): `folder/layer<layer>_results.json`, if it was made from
  the model file of SHA-256 `sha`."""
  path = os.path.join(folder, f'layer{layer}_results.json')
  if os.path.abspath(path).startswith(_ROOT + os.sep):
    path = os.path.relpath(path, _ROOT)
  if not os.path.exists(os.path.join(_ROOT, path)):
    return None, f'no stored evaluation at {path}'
  with open(os.path.join(_ROOT, path)) as f:
    results = json.load(f)
  if results['meta'].get('gguf_sha256') != sha:
    return None, (f'{path} was evaluated on another model file (SHA-256 '
                  f'{results["meta"].get("gguf_sha256")}; this one {sha})')
  return results, path


def _in_band(rate: float) -> bool:
  return TRIGGER_BAND[0] <= rate <= TRIGGER_BAND[1]


def chosen(results: dict[str, Any], record: dict[str, Any]
           ) -> dict[str, dict[str, Any]]:
  """Per steered method its selected setting; a gated method's with its
  gate and trigger rates (validation: selection.json's, on the
  validation held-out tokens; test: the mean of its rows', all alphas > 0,
  on the test held-out tokens) and whether each is in `TRIGGER_BAND`."""
  out = {}
  for method, at in record['choice'].items():
    entry = dict(layer=at['layer'], direction_method=at['direction_method'],
                 alphas=at['alphas'], validation_score=at['score'],
                 reached=at['reached'])
    if method in selection_gate.GATED_METHODS:
      rows = [r for r in results['rows']
              if r['method'] == method and r['alpha'] > 0]
      test = sum(r['trigger_rate'] for r in rows) / len(rows)
      valid = at['gate_trigger_rate']
      entry['gate'] = {k: at['gate'].get(k) for k in
                       ('kind', 'kappa', 'beta', 'center_norm')}
      entry['trigger_rate'] = dict(
          validation=valid, test=test, validation_in_band=_in_band(valid),
          test_in_band=_in_band(test))
    out[method] = entry
  return out


def summarize(results: dict[str, Any], record: dict[str, Any],
              targets: Sequence[float], num_samples: int,
              reference: tuple[dict[str, Any] | None, str] = (None, 'none')
              ) -> tuple[dict[str, Any], str]:
  """study.json's summary and study.md's text from the evaluation
  (results.json), its selection.json and the reference settings'
  evaluation (`reference_run`'s pair): what `run` writes, and what stored
  files rebuild."""
  targets = list(targets)
  summary = report.build([results], {}, targets, num_samples)
  # report.build's gate table reads the config's beta; a selected gate
  # has its own per method: `chosen` holds it.
  summary['gate'] = []
  summary['selection'] = chosen(results, record)
  summary['validation'] = {k: record[k] for k in (
      'tasks', 'items_per_set', 'mc_seeds', 'targets', 'score', 'gate')}
  summary['model'] = {'gguf_sha256': results['meta']['gguf_sha256']}
  ref, source = reference
  summary['reference'] = {'source': source, 'accuracy': {}}
  if ref is not None:
    meta = ref['meta']
    summary['reference'].update(
        # A selection's evaluation has no one layer: the rows hold theirs.
        layer=meta.get('layer', sorted({r['layer'] for r in ref['rows']
                                        if 'layer' in r})),
        direction_method=meta['config']['direction']['method'],
        kappa=meta['kappa'], beta=meta['beta'], accuracy=reference_accuracy(
            ref, list(results['meta']['tasks']), targets, num_samples))
  text = '\n'.join([selection_markdown(summary), report.markdown(summary),
                    reference_markdown(summary)])
  return summary, text


def reference_accuracy(ref: dict[str, Any], tasks: list[str],
                       targets: list[float], num_samples: int
                       ) -> dict[str, dict[str, list[dict[str, Any]]]]:
  """Per task of both evaluations, each of the reference's steered
  methods' accuracy at matched KL (cells as dicts)."""
  return {t: {m: [c._asdict() for c in intervals.matched(
      [ref], m, t, targets, num_samples=num_samples)]
              for m in intervals.methods_of(ref) if m != 'none'}
          for t in tasks if t in ref['meta']['tasks']}


def _pct(rate: float) -> str:
  return f'{100 * rate:.1f}'


def selection_markdown(summary: dict[str, Any]) -> str:
  """The chosen settings and the gates' table."""
  val = summary['validation']
  head = ['method', 'block', 'direction', 'alphas (test)',
          'validation score (%)', 'targets reached']
  body = [[m, str(e['layer']), e['direction_method'],
           ', '.join(f'{a:g}' for a in e['alphas']),
           _pct(e['validation_score']),
           f'{e["reached"]}/{len(val["targets"])}']
          for m, e in summary['selection'].items()]
  lines = ['**Selected settings** (per method, on validation items only: '
           f'{len(val["mc_seeds"])} set(s) (seeds '
           f'{", ".join(map(str, val["mc_seeds"]))}) x '
           f'{val["items_per_set"]} items of {", ".join(val["tasks"])}; '
           f'score: accuracy ({val["score"]} log-prob) at matched KL over '
           f'{", ".join(f"{t:g}" for t in val["targets"])}; selection.json)',
           '', stats.markdown_table(head, body, '-' * len(head)), '']
  gated = {m: e for m, e in summary['selection'].items() if 'gate' in e}
  if gated:
    head = ['method', 'gate', 'kappa', 'beta', 'center norm',
            'trigger rate, validation (%)', 'trigger rate, test (%)',
            'in 5-95% (validation, test)']
    yes = lambda b: 'yes' if b else 'no'
    body = [[m, e['gate']['kind'], f'{e["gate"]["kappa"]:.3g}',
             f'{e["gate"]["beta"]:.3f}',
             '-' if e['gate']['center_norm'] is None
             else f'{e["gate"]["center_norm"]:.1f}',
             _pct(e['trigger_rate']['validation']),
             _pct(e['trigger_rate']['test']),
             f'{yes(e["trigger_rate"]["validation_in_band"])}, '
             f'{yes(e["trigger_rate"]["test_in_band"])}']
            for m, e in gated.items()]
    lines += ['**The gate at the selected setting** (trigger rate: share of '
              'held-out tokens with delta > beta at the chosen block; '
              'distributions in selected/gate_<method>.png)', '',
              stats.markdown_table(head, body, '-' * len(head)), '']
  if summary['ablation']:
    lines += ['Gate x geometry below: each of its four methods at its own '
              'selected setting (blocks ' + ', '.join(
                  f'{m} {e["layer"]}' for m, e in summary['selection'].items()
                  if m in intervals.ABLATION.values()) + ').', '']
  return '\n'.join(lines)


def reference_markdown(summary: dict[str, Any]) -> str:
  """The reference settings' rows beside the selected ones, per task."""
  ref = summary['reference']
  if not ref['accuracy']:
    return f'**Reference settings**: not shown ({ref["source"]}).\n'
  lines = [f'**Reference settings** (block {ref["layer"]}, '
           f'{ref["direction_method"]}, the gate\'s kappa {ref["kappa"]:g} and '
           f'beta {ref["beta"]:g} uncentred; '
           f'{ref["source"]}, a separate evaluation) '
           'against the selected settings: accuracy (%) at matched KL', '']
  head = ['method', *(f'KL {t:g}' for t in summary['targets'])]
  for task in summary['accuracy']:
    if task not in ref['accuracy']:
      lines += [f'{task}: not in the reference evaluation.', '']
      continue
    body = []
    for m, cells in summary['accuracy'][task].items():
      body.append([f'{m}, selected',
                   *(intervals.Cell(**c).format() for c in cells)])
      if m in ref['accuracy'][task]:
        body.append([f'{m}, reference', *(intervals.Cell(**c).format()
                                          for c in ref['accuracy'][task][m])])
    lines += [f'**{task}**', '', stats.markdown_table(
        head, body, '-' * len(head)), '']
  return '\n'.join(lines)
