r"""Synchronous vs asynchronous GRPO over seeds: bounds, corrections, GAS.

  python -m launch.rl_study --workdir=workdirs/rl_study
  python -m launch.rl_study --workdir=workdirs/gas_study --bounds=1,4 \
    --corrections=decoupled \
    --gas=full,no_bandit,no_execution,no_coupling,fixed_lambda --gas_bound=4

Each seed trains its own warm start (`configs/rl_sft.py`, that seed) into
`<workdir>/sft_<seed>`, then runs GRPO (`configs/rl.py`, that seed) once
synchronously (staleness bound 0) and once for each bound of `--bounds`
with each correction of `--corrections`, every run in its own workdir
below `--workdir` (a finished run is read back, an interrupted one
resumes). Writes `study.md` (pass@1 per difficulty at the end, mean ±
std over seeds; samples/s; wall time), `study.json` (every run's
results) and `study.png` (mean pass@1 against wall time and against
trained samples, mean over seeds). `--gas` adds GAS runs (`geom.gas`,
configs/rl.py's `gas=` variants: the full scheduler and its ablations)
with `--gas_bound` as the easiest difficulty's budget; `study.md` then
also tabulates every run's trained difficulty mix, mean staleness per
difficulty, and GAS's final alpha, budgets and dropped / deferred
batches.
"""

import ast
import json
import os
import statistics

from absl import app
from absl import flags
from absl import logging
import ml_collections
import numpy as np

from configs import rl
from configs import rl_sft
from launch import entry
from train import plots
from train import stats
from train.errors import UsageError
from train.rl import grpo
from train.rl import run
from train.rl import sft

_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/rl_study', 'Root dir.')
_SEEDS = flags.DEFINE_integer('seeds', 3, 'Seeds (warm start and RL).')
_BOUNDS = flags.DEFINE_list('bounds', ['1', '2', '4'],
                            'Staleness bounds of the asynchronous runs.')
_CORRECTIONS = flags.DEFINE_list('corrections', ['none', 'tis', 'decoupled'],
                                 'Off-policy corrections (asynchronous).')
_GAS = flags.DEFINE_list('gas', [], 'GAS variants (configs/rl.py gas=): '
                        'full, no_bandit, no_execution, no_coupling, '
                        'fixed_lambda.')
_GAS_BOUND = flags.DEFINE_integer('gas_bound', 4, 'GAS runs: s_base, the '
                                  "easiest difficulty's budget.")
_GAS_CORRECTION = flags.DEFINE_string('gas_correction', 'decoupled',
                                      'GAS runs: the off-policy correction.')
_VERSIONS = flags.DEFINE_integer('num_versions', 1000, 'config.num_versions')
_OVERRIDES = flags.DEFINE_list(
    'set', [], 'More config fields for every RL run, as field=value '
    '(values parsed as Python literals), e.g. optimizer.learning_rate=3e-4.')


def _sft(seed: int) -> str:
  workdir = os.path.join(_WORKDIR.value, f'sft_{seed}')
  config = rl_sft.get_config()
  config.seed = seed
  final = sft.train_and_evaluate(config, workdir)
  logging.info('warm start %d: %s', seed, {k: v for k, v in final.items()
                                            if k.startswith('pass_at_1')})
  return workdir


def _set(config, field: str, text: str) -> None:
  *path, last = field.split('.')
  block = config
  for part in path:
    block = block[part]
  block[last] = ast.literal_eval(text)


def _rl_config(seed: int, bound: int, correction: str,
               gas: str | None = None):
  """(config, workdir) of one RL run of the study."""
  variant = f',gas={gas}' if gas else ''
  config = rl.get_config(f'staleness={bound},correction={correction}'
                         + variant)
  config.seed = seed
  config.sft_workdir = os.path.join(_WORKDIR.value, f'sft_{seed}')
  config.num_versions = _VERSIONS.value
  for item in _OVERRIDES.value:
    field, _, text = item.partition('=')
    _set(config, field, text)
  name = (f'gas_{gas}_s{bound}_seed{seed}' if gas
          else f's{bound}_{correction}_seed{seed}')
  return config, os.path.join(_WORKDIR.value, name)


def _rl(seed: int, bound: int, correction: str, gas: str | None = None
        ) -> dict:
  return run.train_and_evaluate(*_rl_config(seed, bound, correction, gas))


def check_flags() -> None:
  """UsageError naming the first bad flag, before anything is trained:
  the flags themselves, then every RL run's config as the study builds it
  (`run.check_config`, the SFT warm start aside: the study trains it)."""

  def integers(flag, low):
    for text in flag.value if isinstance(flag.value, list) else [flag.value]:
      try:
        valid = int(text) >= low
      except ValueError:
        valid = False
      if not valid:
        raise UsageError(f'--{flag.name}', text,
                         f'must be an integer >= {low}')

  def among(flag, choices):
    for value in flag.value if isinstance(flag.value, list) else [
        flag.value]:
      if value not in choices:
        raise UsageError(f'--{flag.name}', value, 'unknown', choices)

  stats.check_seed_count('--seeds', _SEEDS.value)
  integers(_BOUNDS, 1)  # The synchronous run (0) is always in the study.
  integers(_GAS_BOUND, 1)
  integers(_VERSIONS, 1)
  among(_CORRECTIONS, grpo.CORRECTIONS)
  among(_GAS_CORRECTION, grpo.CORRECTIONS)
  for variant in _GAS.value:
    try:
      rl.get_config(f'gas={variant}')
    except ValueError:
      raise UsageError('--gas', variant, 'unknown GAS variant',
                       ['full', 'no_bandit', 'no_execution', 'no_coupling',
                        'fixed_lambda']) from None
  for item in _OVERRIDES.value:
    field, sep, text = item.partition('=')
    if not sep:
      raise UsageError('--set', item, 'give field=value')
    try:
      _set(rl.get_config(), field, text)
    except (ValueError, SyntaxError):
      raise UsageError('--set', item, f'{text!r} is not a Python literal '
                       "(quote strings: field='text')") from None
    except (KeyError, AttributeError):
      raise UsageError('--set', item, f'the RL config has no field '
                       f'{field!r}') from None
  for _, bound, correction, gas in _runs():
    run.check_config(_rl_config(0, bound, correction, gas)[0],
                     require_sft=False)


def _percent(values: list[float]) -> str:
  return stats.mean_std(values, 100.0)


def _runs() -> list[tuple[str, int, str, str | None]]:
  """(label, bound, correction, GAS variant or None) of each run."""
  runs = [('sync', 0, 'decoupled', None)]
  for bound in _BOUNDS.value:
    for correction in _CORRECTIONS.value:
      runs.append((f'async s={bound}, {correction}', int(bound), correction,
                   None))
  for variant in _GAS.value:
    runs.append((f'GAS {variant}, s_base={_GAS_BOUND.value}',
                 _GAS_BOUND.value, _GAS_CORRECTION.value, variant))
  return runs


def study() -> tuple[str, dict]:
  raw = {}
  for seed in range(_SEEDS.value):
    _sft(seed)
    for label, bound, correction, gas in _runs():
      raw[f'{label}|{seed}'] = _rl(seed, bound, correction, gas)
  seeds = range(_SEEDS.value)
  first = raw['sync|0']
  difficulties = sorted(first['pass_at_1'], key=int)
  head = (['run'] + [f'{d} digits' for d in difficulties]
          + ['mean', 'samples/s', 'x sync', 'wall s'])
  start = [statistics.mean(raw[f'sync|{s}']['initial_pass_at_1'][d]
                           for s in seeds) for d in difficulties]
  rows = [['warm start'] + [
      _percent([raw[f'sync|{s}']['initial_pass_at_1'][d] for s in seeds])
      for d in difficulties] + [f'{100 * statistics.mean(start):.1f}', '-',
                                '-', '-']]
  for label, *_ in _runs():
    runs = [raw[f'{label}|{s}'] for s in seeds]
    ratio = [r['samples_per_second'] / raw[f'sync|{s}']['samples_per_second']
             for s, r in zip(seeds, runs)]
    rows.append([label] + [_percent([r['pass_at_1'][d] for r in runs])
                           for d in difficulties] + [
        _percent([r['mean_pass_at_1'] for r in runs]),
        stats.mean_std([r['samples_per_second'] for r in runs]),
        stats.mean_std(ratio),
        stats.mean_std([r['wall_seconds'] for r in runs])])
  lines = [stats.markdown_table(head, rows)]
  if _GAS.value:
    lines += ['', _schedule_table(raw, difficulties)]
  _plot(raw)
  return '\n'.join(lines), raw


def _schedule_table(raw, difficulties) -> str:
  """Per run, mean over seeds: the trained difficulty mix (%), the mean
  staleness per difficulty, batches dropped by admission, and GAS's final
  alpha, budgets and deferred dispatches."""
  seeds = range(_SEEDS.value)
  head = (['run'] + [f'mix d{d} %' for d in difficulties]
          + [f'staleness d{d}' for d in difficulties]
          + ['dropped', 'deferred', 'alpha', 'budgets'])
  table = []
  for label, *_ in _runs():
    rows = [raw[f'{label}|{s}'] for s in seeds]
    cells = [label]
    for d in difficulties:
      share = [r['difficulty_mix'][d] / r['versions'] for r in rows]
      cells.append(f'{100 * statistics.mean(share):.0f}')
    for d in difficulties:
      means = []
      for r in rows:
        hist = r['staleness_by_difficulty'][d]
        n = sum(hist.values())
        if n:
          means.append(sum(int(i) * c for i, c in hist.items()) / n)
      cells.append(f'{statistics.mean(means):.2f}' if means else '-')
    cells.append(f'{statistics.mean(sum(r["dropped"].values()) for r in rows):.1f}')
    if 'gas' in rows[0]:
      gas = [r['gas'] for r in rows]
      cells.append(f'{statistics.mean(sum(g[f"deferred/d{d}"] for d in difficulties) for g in gas):.0f}')
      cells.append(stats.mean_std([g['alpha'] for g in gas]))
      cells.append('/'.join(
          f'{statistics.mean(g[f"budget/d{d}"] for g in gas):.1f}'
          for d in difficulties))
    else:
      cells += ['-', '-', '-']
    table.append(cells)
  return stats.markdown_table(head, table)


def _plot(raw) -> None:
  """pass@1 (mean over difficulties, then each difficulty) against wall
  time and trained samples, mean over seeds."""
  plt = plots.pyplot()
  difficulties = sorted(raw['sync|0']['pass_at_1'], key=int)
  keys = ['eval/pass_at_1'] + [f'eval/pass_at_1_d{d}' for d in difficulties]
  titles = ['mean over difficulties'] + [f'{d} digits' for d in difficulties]
  fig, axes = plt.subplots(len(keys), 2, figsize=(11, 3.2 * len(keys)),
                           sharey='row')
  for label, *_ in _runs():
    curves = [raw[f'{label}|{s}']['curve'] for s in range(_SEEDS.value)]
    n = min(len(c) for c in curves)
    wall = np.mean([[p['wall'] for p in c[:n]] for c in curves], 0)
    versions = np.array([p['version'] for p in curves[0][:n]])
    samples = versions * (raw[f'{label}|0']['samples']
                          / raw[f'{label}|0']['versions'])
    style = 'k-' if label == 'sync' else '-'
    for row, key in enumerate(keys):
      mean = np.mean([[p[key] for p in c[:n]] for c in curves], 0)
      axes[row, 0].plot(wall, 100 * mean, style, label=label, marker='.')
      axes[row, 1].plot(samples, 100 * mean, style, label=label, marker='.')
  for row, title in enumerate(titles):
    axes[row, 0].set_ylabel(f'pass@1 %, {title}')
    for ax in axes[row]:
      ax.grid(alpha=0.3)
  axes[-1, 0].set_xlabel('wall time (s, mean over seeds)')
  axes[-1, 1].set_xlabel('trained samples')
  axes[0, 1].legend(fontsize=7)
  fig.suptitle(f'greedy pass@1 on held-out problems, mean of '
               f'{_SEEDS.value} seeds')
  plots.save_png(fig, os.path.join(_WORKDIR.value, 'study.png'))


def main(argv):
  del argv
  entry.quiet_libraries()

  def job():
    entry.configure_devices(ml_collections.ConfigDict({'cpu_devices': 8}))
    check_flags()
    # pylint: disable=g-import-not-at-top
    from train import experiment
    from train import workdir_lock
    # pylint: enable=g-import-not-at-top
    root = experiment.check_workdir(_WORKDIR.value)
    # One study per workdir (its runs below lock their own directories).
    with workdir_lock.hold(root):
      text, raw = study()
      with open(os.path.join(root, 'study.md'), 'w') as f:
        f.write(text + '\n')
      with open(os.path.join(root, 'study.json'), 'w') as f:
        json.dump(raw, f, indent=1, sort_keys=True)
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
