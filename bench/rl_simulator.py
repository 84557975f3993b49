r"""A discrete-event simulator of the asynchronous GRPO runtime at pod scale.

  python -m bench.rl_simulator \
    --calibration_from='workdirs/rl_study/s0_decoupled_seed*' \
    --chips=8,64,256 --write_to=/tmp/rl_simulator.md
  python -m bench.rl_simulator \
    --calibration_from='workdirs/rl_study/s0_decoupled_seed*' \
    --check_against='workdirs/rl_study/s*_decoupled_seed*'

The simulator is `train.rl.simulator` (its docstring states the model
and its assumptions); this is its command line.
"""

import dataclasses
import glob as glob_lib
import os

from absl import app
from absl import flags

from train import metrics as metrics_lib
from train.rl import simulator as sim

_CAL_FROM = flags.DEFINE_string(
    'calibration_from', 'workdirs/rl_study/s0_decoupled_seed*',
    'Glob of synchronous RL workdirs to calibrate from.')
_CAL_JSON = flags.DEFINE_string(
    'calibration_json', None, 'A calibration JSON file (instead of '
    '--calibration_from).')
_SAVE_CAL = flags.DEFINE_string('write_calibration', None,
                                'Write the calibration as JSON here.')
_CHIPS = flags.DEFINE_list('chips', ['8', '64', '256'], 'Total chips.')
_ROLLOUT_FRACTION = flags.DEFINE_float(
    'rollout_fraction', 0.5, 'Share of the chips that generate.')
_CHIPS_PER_ACTOR = flags.DEFINE_integer('chips_per_actor', 4,
                                        'Chips per actor group (c).')
_T_COMM = flags.DEFINE_float(
    't_comm', 0.0, 'Seconds a learner step gains per doubling of the '
    'learner chips (all-reduce).')
_OVERHEAD = flags.DEFINE_bool(
    'learner_overhead', True, 'Keep the measured host overhead per '
    'version in the predictions.')
_BOUNDS = flags.DEFINE_list('bounds', ['1', '2', '4', '8'],
                            'Fixed bounds; the best is reported.')
_SLOTS = flags.DEFINE_integer('slots', 2000, 'Slots per simulated run.')
_SEED = flags.DEFINE_integer('seed', 0, 'The simulator\'s seed.')
_S_BASE = flags.DEFINE_integer('s_base', 4, 'GAS s_base.')
_ALPHA = flags.DEFINE_float('alpha', 0.5, 'GAS alpha (kept fixed).')
_EXEC_AWARE = flags.DEFINE_bool('execution_aware', True,
                                'GAS execution-aware dispatch.')
_MAX_DEFER = flags.DEFINE_integer('max_defer', 8, 'GAS max_defer.')
_CHECK = flags.DEFINE_string(
    'check_against', None, 'Glob of real RL workdirs to compare with.')
_CHECK_BOUND = flags.DEFINE_integer(
    'check_bound', 0, 's of the checked runs when their checkpoint meta '
    'does not say.')
_CHECK_ACTORS = flags.DEFINE_integer(
    'check_actors', 2, 'num_actors of the checked runs when their '
    'checkpoint meta does not say.')
_WRITE_TO = flags.DEFINE_string('write_to', None,
                                'Also write the markdown here.')


def _glob(pattern: str) -> list[str]:
  paths = sorted(p for p in glob_lib.glob(pattern)
                 if os.path.exists(os.path.join(p, 'results.json')))
  if not paths:
    raise app.UsageError(f'no RL workdir (with results.json) matches '
                         f'{pattern!r}')
  return paths


def main(argv):
  del argv
  if _CAL_JSON.value:
    cal = sim.Calibration.from_json(_CAL_JSON.value)
  else:
    cal = sim.calibrate(_glob(_CAL_FROM.value))
  if _SAVE_CAL.value:
    cal.to_json(_SAVE_CAL.value)
  parts = [sim.summary(cal)]
  if _CHECK.value:
    parts += ['', sim.check(cal, _glob(_CHECK.value), _CHECK_BOUND.value,
                        _CHECK_ACTORS.value, _SEED.value)]
  if _CHIPS.value:
    predicted = cal if _OVERHEAD.value else dataclasses.replace(
        cal, overhead_seconds=0.0)
    options = sim.gas_options(cal, _S_BASE.value, _ALPHA.value,
                          _EXEC_AWARE.value, _MAX_DEFER.value)
    parts += ['', sim.predict(
        predicted, [int(c) for c in _CHIPS.value], options,
        [int(b) for b in _BOUNDS.value], _ROLLOUT_FRACTION.value,
        _CHIPS_PER_ACTOR.value, _T_COMM.value, _SLOTS.value, _SEED.value)]
  text = '\n'.join(parts)
  print(text)
  if _WRITE_TO.value:
    metrics_lib.write_text_atomic(_WRITE_TO.value, text + '\n')


if __name__ == '__main__':
  app.run(main)
