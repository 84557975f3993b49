r"""GAS on asynchronous GRPO: the scheduler and its ablations against fixed bounds.

  python -m studies.gas --workdir=workdirs/gas_study --bounds=1,4 \
    --corrections=decoupled \
    --gas=full,no_bandit,no_execution,no_coupling,fixed_lambda --gas_bound=4

The study of `studies.rl_staleness` (its `runs` and `report`: warm starts,
a synchronous run and the fixed bounds) plus one GAS run per variant of
`--gas` (`geom.gas`, configs/rl.py's `gas=` variants: the full scheduler
and its ablations) with `--gas_bound` as the easiest difficulty's budget
and `--gas_correction`. `study.md` then also tabulates every run's
trained difficulty mix, mean staleness per difficulty, and GAS's final
alpha, budgets and dropped / deferred batches. `--runlocal` shrinks every
run to the configs' runlocal (the suite runs the README's command so).
"""

from absl import app

from studies.rl_staleness import cli
from studies.rl_staleness import runs

_FLAGS = cli.define_flags('workdirs/gas_study', ['1', '4'], ['decoupled'],
                          gas=list(runs.GAS_VARIANTS))


def main(argv):
  del argv
  cli.main(_FLAGS)


if __name__ == '__main__':
  app.run(main)
