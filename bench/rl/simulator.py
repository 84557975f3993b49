r"""A discrete-event simulator of the asynchronous GRPO runtime at pod scale.

  python -m bench.rl.simulator \
    --calibration_from='workdirs/rl_study/s0_decoupled_seed*' \
    --chips=8,64,256 --write_to=/tmp/rl_simulator.md
  python -m bench.rl.simulator \
    --calibration_from='workdirs/rl_study/s0_decoupled_seed*' \
    --check_against='workdirs/rl_study/s*_decoupled_seed*'

Across processes (`launch.rl --multihost`), with the transfer cost
`bench.rl.transfer` measured and the calibration kept in the GAS study's
room (`--write_calibration=studies/gas/results/rl_calibration.json` wrote
it), into the BENCHMARKS.md section `rl_across_processes`:

  python -m bench.rl.simulator \
    --calibration_json=studies/gas/results/rl_calibration.json \
    --transfer_json=studies/gas/results/rl_transfer.json --chips= --publish

The simulator is `bench.rl.pod_simulation` (its docstring states the model
and its assumptions); this is its command line.
"""

import dataclasses
import glob as glob_lib
import os
import sys

from absl import app
from absl import flags

from bench import report
from train.run import metrics as metrics_lib
from bench.rl import pod_simulation as sim

SECTION = 'rl_across_processes'

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
_TRANSFER = flags.DEFINE_string(
    'transfer_json', None, 'A `Transfer` (bench.rl.transfer --fit_to): '
    'adds the predictions with every actor group a process of its own.')
_ACROSS_CHIPS = flags.DEFINE_list('across_chips', ['8', '64', '256'],
                                  'Total chips of those predictions.')
_FRACTIONS = flags.DEFINE_list(
    'rollout_fractions', ['0.25', '0.5', '0.75'],
    'Rollout shares of the chips tried there (the best is reported).')
_VERSION_MB = flags.DEFINE_float(
    'version_mb', None, 'MB per weight version (default: the float32 '
    'parameters of configs/rl_sft.py\'s policy, the calibration\'s).')
_BATCH_MB = flags.DEFINE_float(
    'batch_mb', None, 'MB per batch (default: the Rollout arrays of '
    'rows_per_slot rows at the policy\'s max_len, an upper bound).')
_PUBLISH = flags.DEFINE_bool(
    'publish', False, 'Write the across-processes predictions to '
    f'BENCHMARKS.md ({SECTION}).')


def _policy_sizes(rows: int) -> tuple[float, float]:
  """(MB of the policy's float32 parameters, MB of a batch of `rows`)."""
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np
  from configs import rl_sft
  from train.lm import trainer
  # pylint: enable=g-import-not-at-top
  config = rl_sft.get_config()
  model = trainer.create_model(config)
  shapes = jax.eval_shape(lambda key: trainer.init_variables(model, key),
                          jax.random.key(0))['params']
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  # Prompt int32 + valid bool, completion int32 + mask bool + logps
  # float32 over at most max_len tokens, and a float32 reward.
  batch = rows * (9 * config.model.max_len + 4)
  return 4 * params / 2**20, batch / 2**20


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
  if _TRANSFER.value:
    transfer = sim.Transfer.from_json(_TRANSFER.value)
    version_mb, batch_mb = _policy_sizes(cal.rows_per_slot)
    version_mb = _VERSION_MB.value or version_mb
    batch_mb = _BATCH_MB.value or batch_mb
    options = sim.gas_options(cal, _S_BASE.value, _ALPHA.value,
                              _EXEC_AWARE.value, _MAX_DEFER.value)
    table = sim.across_processes(
        cal, [int(c) for c in _ACROSS_CHIPS.value], options, transfer,
        version_mb, batch_mb, [int(b) for b in _BOUNDS.value],
        [float(f) for f in _FRACTIONS.value], _CHIPS_PER_ACTOR.value,
        _T_COMM.value, _SLOTS.value, _SEED.value)
    across = [
        '## Rollout and learner processes at pod scale: predictions '
        '(`python -m bench.rl.simulator`)', '',
        '**Predicted by `bench.rl.pod_simulation`, not measured.** Its model '
        'and assumptions are in its docstring; the costs it scales are '
        'measured here: ' + sim.summary(cal), '',
        f'Transfers: {1e3 * transfer.latency_seconds:.1f} ms + MB x '
        f'{1e3 * transfer.seconds_per_mb:.2f} ms ({transfer.source}; '
        f'`{_TRANSFER.value}`), a version {version_mb:.2f} MB, a batch '
        f'{batch_mb:.3f} MB. Every actor group of {_CHIPS_PER_ACTOR.value} '
        'chips is a process of its own and pays the weight transfer each '
        'time it starts from a version it does not hold; the learner '
        'never waits for one. For each chip count and policy the rollout '
        f'share of {", ".join(_FRACTIONS.value)} with the most samples/s '
        'across processes is shown, against the same deployment in one '
        f'process; fixed bounds {", ".join(_BOUNDS.value)}, GAS s_base='
        f'{_S_BASE.value}, alpha={_ALPHA.value:g}; {_SLOTS.value} slots, '
        f'seed {_SEED.value}.', '',
        table, '',
        'Commands: `python -m studies.rl_staleness '
        '--workdir=workdirs/rl_study --bounds= --corrections=decoupled` '
        '(the 3 synchronous runs, '
        'nothing else running), `python -m bench.rl.simulator '
        "--calibration_from='workdirs/rl_study/s0_decoupled_seed*' "
        '--write_calibration=studies/gas/results/rl_calibration.json '
        '--chips=`, '
        '`python -m bench.rl.transfer`, then `python -m bench.rl.simulator '
        + ' '.join(a for a in sys.argv[1:]) + '`.', '',
        'Transfer budget: the weight transfer at which the actor groups '
        'stop producing a slot per learner step, n (o + T) - L (uniform '
        'mix; "none": generation bounds the run even without transfers, '
        'so every transfer adds to each slot). "GB/s to fit it": what the '
        'network between learner and rollout hosts must carry for a '
        'version to arrive within that budget at the measured latency.']
    parts += [''] + across
    if _PUBLISH.value:
      report.write_section(SECTION, '\n'.join(across))
  text = '\n'.join(parts)
  print(text)
  if _WRITE_TO.value:
    metrics_lib.write_text_atomic(_WRITE_TO.value, text + '\n')


if __name__ == '__main__':
  app.run(main)
