r"""Synchronous vs asynchronous GRPO over seeds: staleness bounds and corrections.

  python -m studies.rl_staleness --workdir=workdirs/rl_study
  python -m studies.rl_staleness --workdir=workdirs/rl_stress \
    --bounds=8,32 --corrections=none,decoupled \
    --set=optimizer.learning_rate=1e-4,runtime.deterministic=True

Each seed trains its own warm start (`configs/rl_sft.py`), then runs GRPO
(`configs/rl.py`) once synchronously and once for each bound of
`--bounds` with each correction of `--corrections` (`runs`). Writes
`study.md`, `study.json` and `study.png` in `--workdir` (`report`).
`--runlocal` shrinks every run to the configs' runlocal (the suite runs
the README's commands that way).
"""

from absl import app

from studies.rl_staleness import cli

_FLAGS = cli.define_flags('workdirs/rl_study', ['1', '2', '4'],
                          ['none', 'tis', 'decoupled'])


def main(argv):
  del argv
  cli.main(_FLAGS)


if __name__ == '__main__':
  app.run(main)
