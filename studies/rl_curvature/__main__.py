r"""Does the policy's curvature grow with task difficulty (GAS's premise)?

  python -m studies.rl_curvature
  python -m studies.rl_curvature --sft_workdirs=workdirs/rl_sft --prompts=8

GAS (`geom.gas`) sets each difficulty's staleness budget from alpha, the
slope of log lambda_max on difficulty, lambda_max the top Hessian
eigenvalue of the policy's loss on that difficulty. This measures that
slope on the SFT warm starts, before any scheduler relies on it
(`measure`: how).

For each warm start of `--sft_workdirs` and each difficulty of
`--difficulties` (family `--family`): `--prompts` training problems, each
sampled `--samples` times; lambda_max by power iteration with
`--num_iters` products and by the one-product Rayleigh proxy, and a
signed check with `--check_iters` products.

Writes the markdown table (`report`) to `--out` with the suffix `.md` and
every number to `--out` (JSON), and prints the table.
"""

import os

from absl import app
from absl import flags

from studies.rl_curvature import measure
from studies.rl_curvature import report
from train.run import metrics
from train.jobs import entry

_SFT_WORKDIRS = flags.DEFINE_list(
    'sft_workdirs', ['workdirs/rl_sft', 'workdirs/rl_sft_seed1',
                     'workdirs/rl_sft_seed2'],
    'SFT warm starts (launch.train with configs/rl_sft.py), one per seed.')
_DIFFICULTIES = flags.DEFINE_list('difficulties', ['1', '2', '3', '4', '5'],
                                  'Task difficulties (digits).')
_FAMILY = flags.DEFINE_string('family', 'add', 'Task family.')
_PROMPTS = flags.DEFINE_integer('prompts', 16, 'Prompts per difficulty.')
_SAMPLES = flags.DEFINE_integer('samples', 4, 'Completions per prompt.')
_NUM_ITERS = flags.DEFINE_integer('num_iters', 20,
                                  'Hessian-vector products of the power '
                                  'estimate.')
_CHECK_ITERS = flags.DEFINE_integer(
    'check_iters', 100, 'Products of the untimed convergence check (0: none).')
_SEED = flags.DEFINE_integer('seed', 0, 'Problems, samples and start vectors.')
_OUT = flags.DEFINE_string(
    'out', 'studies/rl_curvature/results/rl_curvature.json',
    'The JSON; the table goes beside it as .md.')


def main(argv):
  del argv
  entry.quiet_libraries()
  results = measure.measure(
      _SFT_WORKDIRS.value, [int(d) for d in _DIFFICULTIES.value],
      family=_FAMILY.value, prompts=_PROMPTS.value, samples=_SAMPLES.value,
      num_iters=_NUM_ITERS.value, check_iters=_CHECK_ITERS.value,
      seed=_SEED.value)
  text = report.table(results)
  results['table'] = text
  os.makedirs(os.path.dirname(_OUT.value) or '.', exist_ok=True)
  metrics.write_json_atomic(_OUT.value, results)
  metrics.write_text_atomic(os.path.splitext(_OUT.value)[0] + '.md', text)
  print(text)


if __name__ == '__main__':
  app.run(main)
