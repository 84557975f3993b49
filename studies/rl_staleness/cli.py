"""The RL study's flags and main, for `studies.rl_staleness` and `studies.gas`.

Both rooms run the same study (`runs`, `report`) with their own defaults;
each `__main__` calls `define_flags` once, so no process defines a flag
twice. `main` refuses a bad flag in one line before anything is trained:
the flags themselves, then every RL run's config as the study builds it.
"""

import json
import os

from absl import flags
import ml_collections

from configs import rl
from studies.rl_staleness import report
from studies.rl_staleness import runs
from train.analysis import stats
from train.errors import UsageError
from train.jobs import entry
from train.rl import grpo


def define_flags(workdir: str, bounds: list[str], corrections: list[str],
                 gas: list[str] | None = None) -> dict[str, flags.FlagHolder]:
  """The study's flags with these defaults; the GAS flags only where `gas`
  is given (the GAS room's variants)."""
  holders = {
      'workdir': flags.DEFINE_string('workdir', workdir, 'Root dir.'),
      'seeds': flags.DEFINE_integer('seeds', 3, 'Seeds (warm start and RL).'),
      'bounds': flags.DEFINE_list(
          'bounds', bounds, 'Staleness bounds of the asynchronous runs.'),
      'corrections': flags.DEFINE_list(
          'corrections', corrections,
          'Off-policy corrections (asynchronous).'),
      'num_versions': flags.DEFINE_integer('num_versions', 1000,
                                           'config.num_versions'),
      'set': flags.DEFINE_list(
          'set', [], 'More config fields for every RL run, as field=value '
          '(values parsed as Python literals), e.g. '
          'optimizer.learning_rate=3e-4.'),
      'runlocal': flags.DEFINE_bool(
          'runlocal', False, "The configs' runlocal sizes (configs/rl_sft.py, "
          'configs/rl.py) for every run.'),
  }
  if gas is not None:
    holders.update(
        gas=flags.DEFINE_list('gas', gas, 'GAS variants (configs/rl.py '
                              'gas=): ' + ', '.join(runs.GAS_VARIANTS) + '.'),
        gas_bound=flags.DEFINE_integer(
            'gas_bound', 4, "GAS runs: s_base, the easiest difficulty's "
            'budget.'),
        gas_correction=flags.DEFINE_string(
            'gas_correction', 'decoupled',
            'GAS runs: the off-policy correction.'))
  return holders


def _study(holders: dict[str, flags.FlagHolder]) -> runs.Study:
  """The study the flags ask for; UsageError naming the first bad flag."""

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

  stats.check_seed_count('--seeds', holders['seeds'].value)
  integers(holders['bounds'], 1)  # The sync run (0) is always in the study.
  integers(holders['num_versions'], 1)
  among(holders['corrections'], grpo.CORRECTIONS)
  gas = {}
  if 'gas' in holders:
    integers(holders['gas_bound'], 1)
    among(holders['gas_correction'], grpo.CORRECTIONS)
    for variant in holders['gas'].value:
      try:
        rl.get_config(f'gas={variant}')
      except ValueError:
        raise UsageError('--gas', variant, 'unknown GAS variant',
                         list(runs.GAS_VARIANTS)) from None
    gas = dict(gas=tuple(holders['gas'].value),
               gas_bound=holders['gas_bound'].value,
               gas_correction=holders['gas_correction'].value)
  for item in holders['set'].value:
    field, sep, text = item.partition('=')
    if not sep:
      raise UsageError('--set', item, 'give field=value')
    try:
      runs.set_field(rl.get_config(), field, text)
    except (ValueError, SyntaxError):
      raise UsageError('--set', item, f'{text!r} is not a Python literal '
                       "(quote strings: field='text')") from None
    except (KeyError, AttributeError):
      raise UsageError('--set', item, f'the RL config has no field '
                       f'{field!r}') from None
  study = runs.Study(
      workdir=holders['workdir'].value, seeds=holders['seeds'].value,
      bounds=tuple(int(b) for b in holders['bounds'].value),
      corrections=tuple(holders['corrections'].value),
      num_versions=holders['num_versions'].value,
      overrides=tuple(holders['set'].value),
      runlocal=holders['runlocal'].value, **gas)
  runs.check(study)
  return study


def main(holders: dict[str, flags.FlagHolder]) -> None:
  """Runs the study; writes `study.md`, `study.json` (every run's results)
  and `study.png` in its workdir, and prints the table."""
  entry.quiet_libraries()

  def job():
    entry.configure_devices(ml_collections.ConfigDict({'cpu_devices': 8}))
    study = _study(holders)
    # pylint: disable=g-import-not-at-top
    from train.training import experiment
    from train.run.job import open_job
    # pylint: enable=g-import-not-at-top
    root = experiment.check_workdir(study.workdir)
    # One study per workdir (its runs below lock their own directories).
    with open_job(root):
      raw = runs.measure(study)
      text = report.table(study, raw)
      report.plot(study, raw, os.path.join(study.workdir, 'study.png'))
      with open(os.path.join(root, 'study.md'), 'w') as f:
        f.write(text + '\n')
      with open(os.path.join(root, 'study.json'), 'w') as f:
        json.dump(raw, f, indent=1, sort_keys=True)
    print(text)

  entry.run_job(job)
