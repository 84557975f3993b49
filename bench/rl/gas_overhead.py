r"""GAS's scheduler overhead per learner step, as a ratio to the step itself.

  python -m bench.rl.gas_overhead             # writes the BENCHMARKS.md section
  python -m bench.rl.gas_overhead --nowrite --steps=50

In one process: the learner's GRPO update (configs/rl.py: 8 prompts x 8
samples, 1-5 digits, the SFT warm start in `--sft_workdir`, trained there
if absent) timed over `--steps` calls on one real batch (the baseline),
and the GAS scheduler (`train.rl.scheduler.Gas`, configs/rl.py
`gas=full`) doing what the runtime asks of it per learner step: one plan
(the actors' dispatch: budgets, the bandit's probabilities, the
execution-aware rule), one admission and one observation (bandit,
latencies, diagnostics for the metrics), over `--steps` steps with
synthetic feedback. Both are medians of per-step times after a warm-up,
interleaved in blocks so that both see the same machine load. The
curvature estimate (power iteration on the learner, every
`gas.curvature_every` versions) is timed on its own and reported
amortised per step: it is GAS's optional part, and its cost depends on
that period.
"""

import os
import platform
import statistics
import time

from absl import app
from absl import flags
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from bench import report
from bench.rl import warm_start
from configs import rl
from train.analysis import stats
from train.rl import learner
from train.rl import rollout
from train.rl import run
from train.rl import runtime
from train.rl import scheduler
from train.rl import sft
from train.rl import tasks

_SFT = flags.DEFINE_string('sft_workdir', 'workdirs/rl_sft',
                           'The warm start (trained if absent).')
_STEPS = flags.DEFINE_integer('steps', 200, 'Timed steps of each.')
_BLOCKS = flags.DEFINE_integer('blocks', 5, 'Interleaved blocks.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'gas_overhead'


def _learner(config):
  """A jitted learner step on one real batch: () -> seconds."""
  _, model, params, _ = sft.load_policy(config.sft_workdir)
  rollout_mesh, learner_mesh = runtime.split_devices(config.rollout_devices)
  repl = NamedSharding(learner_mesh, P())
  rows = NamedSharding(learner_mesh, P('data'))
  tx = run.optimizer(config)
  update = learner.make_update(model, tx, run.loss_settings(config))
  params = jax.device_put(params, repl)
  opt_state = jax.device_put(tx.init(params), repl)
  difficulty, problems = run.batch_problems(config, 0, 2)
  out = rollout.sample(
      model, jax.device_put(params, NamedSharding(rollout_mesh, P())),
      problems, jax.random.key(0), temperature=config.temperature,
      num_steps=tasks.max_answer_tokens(config.family, difficulty),
      sharding=NamedSharding(rollout_mesh, P('data')))
  batch = jax.device_put(learner.assemble(out, config.grpo.group_size,
                                          run.sequence_length(config)), rows)

  def step() -> float:
    start = time.perf_counter()
    jax.block_until_ready(update(params, opt_state, batch, params))
    return time.perf_counter() - start

  return step, model, params, batch


def _scheduler_steps(config, count: int, start: int, sched) -> list[float]:
  """Per-step seconds of plan + admit + observe for versions start..."""
  rng = np.random.default_rng(start)
  rows = config.prompts_per_batch * config.grpo.group_size
  times = []
  for v in range(start, start + count):
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    begin = time.perf_counter()
    # Slot v planned with the learner s versions behind it (lead s).
    plan = sched.plan(v, latest=max(0, v - config.runtime.max_staleness))
    sched.admit(v, plan.difficulty, 1)
    sched.observe(v + 1, difficulty=plan.difficulty, rewards=rewards,
                  rows=rows, generation_seconds=float(rng.uniform(0.01, 0.03)),
                  step_seconds=0.03, regenerated=False)
    times.append(time.perf_counter() - begin)
  return times


def main(argv):
  del argv
  warm_start.prepare(_SFT.value)
  config = rl.get_config('gas=full,staleness=4')
  config.sft_workdir = _SFT.value
  step, model, params, batch = _learner(config)
  sched = scheduler.Gas(scheduler.settings(config), deterministic=False)
  for _ in range(3):
    step()
  _scheduler_steps(config, 20, 0, sched)  # Warm-up (the bandit fills).
  learner_times, scheduler_times = [], []
  per_block = max(1, _STEPS.value // _BLOCKS.value)
  version = 20
  for _ in range(_BLOCKS.value):
    learner_times += [step() for _ in range(per_block)]
    scheduler_times += _scheduler_steps(config, per_block, version, sched)
    version += per_block
  # The curvature estimate: every difficulty's last batch, as the run does.
  for d in config.difficulties:
    sched.remember(d, batch)
  sched.curvatures(model, params, 0)  # Compiles.
  curvature = []
  for i in range(3):
    begin = time.perf_counter()
    sched.curvatures(model, params, i + 1)
    curvature.append(time.perf_counter() - begin)
  learner_s = statistics.median(learner_times)
  scheduler_s = statistics.median(scheduler_times)
  curvature_s = statistics.median(curvature)
  every = config.gas.curvature_every
  lines = [
      '## GAS: the scheduler\'s overhead per learner step',
      '',
      f'One process, CPU ({platform.machine()}, {os.cpu_count()} cores; 8 '
      f'simulated devices), jax {jax.__version__}; medians of '
      f'{len(learner_times)} steps each, interleaved in {_BLOCKS.value} '
      'blocks.',
      '',
      stats.markdown_table(['per learner step', 'seconds', '/ learner step'], [
          ['learner update (64 samples, the baseline)',
           f'{learner_s * 1e3:.2f} ms', '1'],
          ['GAS plan + admit + observe', f'{scheduler_s * 1e3:.3f} ms',
           f'**{100 * scheduler_s / learner_s:.2f}%**'],
          [f'curvature estimate ({len(config.difficulties)} difficulties x '
           f'{config.gas.curvature_iters} products, '
           f'{config.gas.curvature_rows} rows), once', f'{curvature_s:.2f} s',
           f'{curvature_s / learner_s:.0f}'],
          [f'the same amortised over curvature_every={every} versions',
           f'{curvature_s / every * 1e3:.2f} ms',
           f'{100 * curvature_s / every / learner_s:.1f}%']], '---'),
      '',
      'The scheduler (budgets, bandit, execution-aware dispatch, admission, '
      'diagnostics) is host numpy; the curvature estimate is jitted on the '
      'learner mesh and is what `gas.curvature_every` (or `fixed_lambda`) '
      'trades.',
      '',
      f'Reproduce: `python -m bench.rl.gas_overhead --steps={_STEPS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
