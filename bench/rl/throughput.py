r"""Asynchronous GRPO's throughput against synchronous, as ratios in one process.

  python -m bench.rl.throughput          # writes the BENCHMARKS.md section
  python -m bench.rl.throughput --repeats=1 --nowrite

`launch.rl`'s loop (configs/rl.py: 8 prompts x 8 samples per batch, 1-5
digit sums, 4 rollout + 4 learner devices, 2 actor threads) from the SFT
warm start in `--sft_workdir` (trained there with configs/rl_sft.py if
absent), for `--versions` updates with staleness bounds 0 (synchronous)
and each of `--bounds`, alternating over `--repeats` repeats in this
process. Throughput is trained samples per second of the run's wall time
(compilation and the two small evaluations, 20 problems per difficulty,
included: all modes pay them alike); the ratio is each bound's over the
synchronous run of the same repeat, median over repeats.
"""

import os
import platform
import statistics
import tempfile

from absl import app
from absl import flags
import jax

from bench import report
from bench.rl import warm_start
from configs import rl
from train.analysis import stats
from train.rl import run

_SFT = flags.DEFINE_string('sft_workdir', 'workdirs/rl_sft',
                           'The warm start (trained if absent).')
_VERSIONS = flags.DEFINE_integer('versions', 200, 'Updates per run.')
_BOUNDS = flags.DEFINE_list('bounds', ['1', '2', '4'], 'Async bounds.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Alternating repeats.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'rl_throughput'


def _run(bound: int, root: str, repeat: int) -> dict:
  config = rl.get_config(f'staleness={bound}')
  config.sft_workdir = _SFT.value
  config.num_versions = _VERSIONS.value
  config.eval_every = _VERSIONS.value
  config.checkpoint_every = _VERSIONS.value
  config.eval_examples = 20
  return run.train_and_evaluate(config, os.path.join(root,
                                                     f's{bound}_{repeat}'))


def main(argv):
  del argv
  warm_start.prepare(_SFT.value)
  bounds = [int(b) for b in _BOUNDS.value]
  rates = {b: [] for b in [0] + bounds}
  busy = {b: [] for b in [0] + bounds}
  with tempfile.TemporaryDirectory() as root:
    for repeat in range(_REPEATS.value):
      for bound in [0] + bounds:
        results = _run(bound, root, repeat)
        rates[bound].append(results['samples_per_second'])
        busy[bound].append(results['learner_busy_fraction'])
  lines = [
      '## Asynchronous GRPO: throughput against synchronous',
      '',
      f'One process, CPU ({platform.machine()}, {os.cpu_count()} cores; the '
      f'8 devices are simulated on them), jax {jax.__version__}; '
      f'{_VERSIONS.value} updates of 64 samples per run, median over '
      f'{_REPEATS.value} alternating repeats.',
      '',
  ]
  rows = []
  for bound in [0] + bounds:
    ratios = [r / s for r, s in zip(rates[bound], rates[0])]
    rows.append([f'{bound}{" (sync)" if bound == 0 else ""}',
                 f'{statistics.median(rates[bound]):.0f}',
                 f'**{statistics.median(ratios):.3f}x**',
                 f'{statistics.median(busy[bound]):.2f}'])
  lines += [
      stats.markdown_table(['staleness bound', 'samples/s', '/ synchronous',
                            'learner busy'], rows, '----'),
      '',
      'Per repeat (samples/s): ' + '; '.join(
          f's={b}: ' + ', '.join(f'{r:.0f}' for r in rates[b])
          for b in [0] + bounds),
      '',
      f'Reproduce: `python -m bench.rl.throughput --versions={_VERSIONS.value}'
      f' --repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
