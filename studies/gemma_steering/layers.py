"""Gemma 3 270M steered at its main layer and a sweep of layers, and the report.

`run(config, workdir, targets, num_samples)` evaluates
(`train.steering.evaluation`) the config's grid at `config.layer` in
`layer<L>/`, and `config.sweep_methods` (without generations) at each of
`config.sweep_layers` in `layer<L>/`;
then `studies.steering.report` (the in-project study's report) compares
methods at matched KL over the item sets and items (one model: the
intervals cover item sets and items, not other models), and a layer-sweep
table does the same per layer. Writes `study.md`, `study.json` and
`pareto_bands.png` into `workdir`.

A finished evaluation is reused when its config is the same and it was
made from the same model file (SHA-256); one with another config or
another file is refused before any compute: a workdir holds one study.
"""

import copy
import json
import os
from typing import Any, Sequence

from absl import logging
import ml_collections

from studies.steering import intervals
from studies.steering import report
from train.training import experiment as experiment_lib
from train.run import metrics as metrics_lib
from train.analysis import stats
from train.run.job import open_job
from train.errors import UsageError
from train.lm import gemma_gguf
from train.steering import evaluation


SWEEP_FIELDS = ('sweep_layers', 'sweep_methods', 'sweep_items')


def plan(config: ml_collections.ConfigDict
         ) -> list[tuple[str, ml_collections.ConfigDict]]:
  """(directory name, evaluation config) of the main layer, then the sweep."""
  out = [(f'layer{config.layer}', config)]
  for layer in config.sweep_layers:
    if layer == config.layer:
      continue
    sweep = copy.deepcopy(config)
    with sweep.unlocked():
      sweep.layer = layer
      sweep.methods = tuple(config.sweep_methods)
      sweep.generation.enabled = False
      sweep.tasks = ml_collections.ConfigDict(
          {t: min(n, config.sweep_items) for t, n in config.tasks.items()})
    out.append((f'layer{layer}', sweep))
  return out


def finished(config, path: str, sha: str) -> dict | None:
  """The evaluation in `path` (its results.json) if it is finished, None
  if not begun; UsageError naming the workdir if it was made with another
  config (the sweep's fields aside) or from another model file."""
  results_path = os.path.join(path, 'results.json')
  if not os.path.exists(results_path):
    return None
  with open(results_path) as f:
    results = json.load(f)
  # The sweep's fields shape other evaluations, not this one (a sweep
  # evaluation's own layer, methods and items are fields of its config).
  drop = lambda c: {k: v for k, v in c.items() if k not in SWEEP_FIELDS}
  have = drop(results['meta'].get('config') or {})
  wanted = drop(json.loads(config.to_json()))
  if have != wanted:
    diff = sorted(k for k in set(wanted) | set(have)
                  if have.get(k) != wanted.get(k))
    raise UsageError('workdir', os.path.dirname(path),
                     f'{os.path.basename(path)}/ holds an evaluation with '
                     f'another config ({", ".join(diff)}); give a new workdir')
  if results['meta'].get('gguf_sha256') != sha:
    raise UsageError('workdir', os.path.dirname(path),
                     f'{os.path.basename(path)}/ was evaluated on another '
                     f'model file (SHA-256 {results["meta"].get("gguf_sha256")}'
                     f', this one {sha}); give a new workdir')
  return results


def _check(config, targets: Sequence[float], num_samples: int) -> None:
  evaluation.check_config(config)
  for field in ('methods', 'sweep_methods'):
    if 'none' not in config[field]:
      raise UsageError(field, tuple(config[field]), 'must hold \'none\' (the '
                       'unsteered model is KL 0 of every sweep)')
  if not isinstance(config.sweep_items, int) or config.sweep_items < 1:
    raise UsageError('sweep_items', config.sweep_items,
                     'must be a positive integer (items per set and task)')
  if len(config.sweep_methods) < 2:
    raise UsageError('sweep_methods', tuple(config.sweep_methods),
                     'give \'none\' and at least one method')
  bad = [m for m in config.sweep_methods if m not in evaluation.METHODS]
  if bad:
    raise UsageError('sweep_methods', tuple(config.sweep_methods),
                     f'unknown method {bad[0]!r}',
                     evaluation.METHODS)
  if not targets or list(targets) != sorted(targets) or min(targets) <= 0:
    raise UsageError('targets', tuple(targets), 'give increasing KL values > 0')
  if num_samples < 100:
    raise UsageError('bootstrap_samples', num_samples, 'must be >= 100')


def checked_model_file(config) -> str:
  """The SHA-256 of the config's model file, once it is checked to load
  and fit (a damaged file is refused before the study's workdir is
  made)."""
  path = config.gguf or gemma_gguf.registry_file()
  gemma_gguf.check_memory(gemma_gguf.check_file(path).shape, path)
  return gemma_gguf.file_sha256(path)


def run(config, workdir: str, targets: Sequence[float],
        num_samples: int = 2000) -> dict[str, Any]:
  """The study (see the module docstring); returns its summary."""
  _check(config, targets, num_samples)
  sha = checked_model_file(config)
  workdir = experiment_lib.check_workdir(workdir)
  with open_job(workdir):
    steps = plan(config)
    done = {name: finished(c, os.path.join(workdir, name), sha)
            for name, c in steps}
    runs = {}
    for name, c in steps:
      if done[name] is None:
        logging.info('evaluating %s', name)
        evaluation.evaluate(c, os.path.join(workdir, name))
        done[name] = finished(c, os.path.join(workdir, name), sha)
      else:
        logging.info('%s: reusing the finished evaluation', name)
      runs[name] = done[name]
    summary, text = summarize(runs, steps[0][0], targets, num_samples)
    metrics_lib.write_json_atomic(os.path.join(workdir, 'study.json'), summary)
    metrics_lib.write_text_atomic(os.path.join(workdir, 'study.md'), text)
    report.plot([runs[steps[0][0]]], os.path.join(workdir, 'pareto_bands.png'))
  return summary


def summarize(runs: dict[str, dict], main: str, targets: Sequence[float],
              num_samples: int) -> tuple[dict[str, Any], str]:
  """study.json's summary and study.md's text from the evaluations (`runs`
  by directory name, `main` the main layer's): what `run` writes, and what
  the stored evaluations rebuild."""
  meta = runs[main]['meta']
  summary = report.build([runs[main]], {}, list(targets), num_samples)
  summary['layers'] = layer_sweep(runs, list(targets), num_samples)
  summary['model'] = {'gguf_sha256': meta['gguf_sha256'],
                      'layer': meta['layer']}
  text = report.markdown(summary) + '\n' + layer_markdown(
      summary['layers'], list(targets))
  return summary, text


def layer_sweep(runs: dict[str, dict], targets: list[float],
                num_samples: int) -> list[dict[str, Any]]:
  """Per evaluated layer and method: accuracy at matched KL per task, the
  trigger rate on held-out text, and the largest KL reached."""
  out = []
  for name in sorted(runs, key=lambda n: runs[n]['meta']['layer']):
    run_ = runs[name]
    tasks = list(run_['meta']['tasks'])
    for method in intervals.methods_of(run_):
      if method == 'none':
        continue
      rows = [r for r in run_['rows'] if r['method'] == method]
      out.append({
          'layer': run_['meta']['layer'], 'method': method,
          'trigger_rate': float(sum(r['trigger_rate'] for r in rows)
                                / len(rows)),
          'kl_max': max(r['kl'] for r in rows),
          'accuracy': {t: [c._asdict() for c in intervals.matched(
              [run_], method, t, targets, num_samples=num_samples)]
                       for t in tasks},
          'unsteered': {
              t: intervals.matched([run_], 'none', t, targets[:1],
                                   num_samples=num_samples)[0]._asdict()
              for t in tasks}})
  return out


def layer_markdown(layers: list[dict[str, Any]], targets: list[float]) -> str:
  if not layers:
    return ''
  tasks = list(layers[0]['accuracy'])
  head = ['layer', 'method', 'trigger rate (%)', 'max KL',
          *(f'{t} KL {k:g}' for t in tasks for k in targets)]
  body = []
  for entry in layers:
    body.append([str(entry['layer']), entry['method'],
                 f'{100 * entry["trigger_rate"]:.1f}',
                 f'{entry["kl_max"]:.2f}',
                 *(intervals.Cell(**c).format() for t in tasks
                   for c in entry['accuracy'][t])])
  unsteered = '; '.join(
      f'layer {e["layer"]}: ' + ', '.join(
          f'{t} {intervals.Cell(**c).format()}'
          for t, c in e['unsteered'].items())
      for e in layers if e['method'] == layers[0]['method'])
  return ('**Layer sweep: accuracy (%) at matched KL** (mean [95% bootstrap '
          'interval over item sets and items]; unsteered: ' + unsteered
          + ')\n\n' + stats.markdown_table(head, body, '-' * len(head))
          + '\n')
