"""The study's report from its stored measures: per variant mean +- std
over seeds, then per-seed paired differences against AdamW.

`records(measures_dir, variants, seeds, sharpness)` reads what `measure`
stored; `summarize(pretrained, runs)` is the markdown (forgetting.md);
`write` writes it and the JSON of the records (forgetting.json). The
stored study in results/ rebuilds byte for byte through these
(tests/test_gemma_training.py).
"""

import json
import os

from studies.gemma_forgetting.settings import REFERENCE
from train import fileio
from train.analysis import stats

REPORT = 'forgetting.md'
RECORDS = 'forgetting.json'


def records(measures_dir: str, variants: tuple[str, ...], seeds: int,
            sharpness: bool) -> tuple[dict, list[dict]]:
  """(the pretrained model's record, one record per (variant, seed)) as
  stored in `measures_dir`, each with its sharpness where `sharpness`."""

  def read(name):
    with open(os.path.join(measures_dir, f'{name}.json')) as f:
      record = json.load(f)
    if sharpness:
      with open(os.path.join(measures_dir, f'sharpness_{name}.json')) as f:
        sharp = json.load(f)
      record.update({k: sharp[k] for k in ('lambda_max',
                                           'power_iterations')})
    return record
  return read('pretrained'), [read(f'{v}_seed{s}') for v in variants
                              for s in range(seeds)]


def summarize(pretrained: dict, runs: list[dict]) -> str:
  """The report: per variant mean +- std over seeds, then per-seed paired
  differences against AdamW."""
  by = {}
  for r in runs:
    by.setdefault(r['variant'], {})[r['seed']] = r
  difficulties = sorted(pretrained['pass_at_1'])
  sharp = 'lambda_max' in pretrained
  head = (['variant', 'held-out text CE', 'forgetting (CE increase)',
           'answer CE'] + [f'pass@1 {d}' for d in difficulties]
          + (['lambda_max (fine-tuning loss)'] if sharp else []))
  rows = [['pretrained', f'{pretrained["heldout_ce"]:.4f}', '-', '-'] + [
      f'{100 * pretrained["pass_at_1"][d]:.1f}' for d in difficulties] + (
          [f'{pretrained["lambda_max"]:.1f}'] if sharp else [])]
  for variant in by:
    seeds = [by[variant][s] for s in sorted(by[variant])]
    rows.append([
        f'{variant} ({len(seeds)} seeds)',
        stats.mean_std([r['heldout_ce'] for r in seeds], digits=4),
        stats.mean_std([r['heldout_ce'] - pretrained['heldout_ce']
                        for r in seeds], digits=4),
        stats.mean_std([r['answer_ce'] for r in seeds], digits=4)] + [
            stats.mean_std([r['pass_at_1'][d] for r in seeds], 100)
            for d in difficulties] + (
                [stats.mean_std([r['lambda_max'] for r in seeds])]
                if sharp else []))
  lines = [stats.markdown_table(head, rows), '']
  for variant in [v for v in by if v != REFERENCE and REFERENCE in by]:
    lines += _paired(pretrained, by[REFERENCE], by[variant], variant)
  return '\n'.join(lines) + '\n'


def _paired(pretrained: dict, reference: dict, other: dict, name: str
            ) -> list[str]:
  """Per-seed differences of `other` against the reference (same seeds,
  same data order)."""
  seeds = sorted(set(reference) & set(other))
  rows, reductions = [], []
  for s in seeds:
    fa = reference[s]['heldout_ce'] - pretrained['heldout_ce']
    fs = other[s]['heldout_ce'] - pretrained['heldout_ce']
    red = 1 - fs / fa if fa > 0 else None
    if red is not None:
      reductions.append(red)
    fit = other[s]['answer_ce'] - reference[s]['answer_ce']
    rows.append([s, f'{fa:.4f}', f'{fs:.4f}', f'{fs - fa:+.4f}',
                 '-' if red is None else f'{100 * red:.0f}%', f'{fit:+.4f}'])
  head = ['seed', f'forgetting {REFERENCE}', f'forgetting {name}',
          'difference', 'reduction', 'answer CE difference']
  return [f'{name} against {REFERENCE}, paired by seed (same data order):',
          '', stats.markdown_table(head, rows), '',
          f'Reduction of forgetting by {name}: '
          f'{stats.mean_std(reductions, 100, 0)}% over the '
          f'{len(reductions)} of {len(seeds)} seeds where {REFERENCE} forgot '
          f'(1 - F_{name} / F_{REFERENCE} per seed).', '']


def write(root: str, pretrained: dict, runs: list[dict]) -> str:
  """forgetting.md and forgetting.json into `root`; returns the former."""
  text = summarize(pretrained, runs)
  fileio.write_text_atomic(os.path.join(root, REPORT), text)
  fileio.write_text_atomic(os.path.join(root, RECORDS), json.dumps(
      dict(pretrained=pretrained, runs=runs), indent=1, sort_keys=True)
                           + '\n')
  return text
