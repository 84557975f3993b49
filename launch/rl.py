r"""Asynchronous GRPO: `python -m launch.rl --config=configs/rl.py --workdir=DIR`.

  python -m launch.train --config=configs/rl_sft.py --workdir=workdirs/rl_sft
  python -m launch.rl --config=configs/rl.py \
    --config.sft_workdir=workdirs/rl_sft --workdir=workdirs/rl

Writes metrics.jsonl, TensorBoard events, results.json (pass@1 per
difficulty, staleness histogram, difficulty mix, throughput) and
pass_at_1.png. A mistake in the config (an unknown family or correction,
a bad staleness bound, a missing or foreign SFT checkpoint): one line and
exit status 2 before any compute. The workdir in use by another run: 75;
no checkpoint in it that loads and verifies: 4; actors failing beyond
`runtime.max_actor_restarts`: 1; with --multihost, a process that did not
join within --multihost_start_timeout: 1. SIGTERM saves a checkpoint and
exits 0, SIGINT saves one and exits 130; the same command resumes the run.

Several processes (`--multihost`, flags in `train.jobs.multihost`) with
`--config.rollout_processes=R`: processes 0..R-1 generate, the others
learn; the first of those (process R) leads: it holds the workdir and
writes the checkpoints, and with more than one learner process each
update spans all of them (`train.rl.processes`, `train.rl.learner_group`),
e.g. on one machine:

  for i in 0 1 2; do python -m launch.rl --config=configs/rl.py \
    --config.sft_workdir=workdirs/rl_sft --workdir=workdirs/rl \
    --config.cpu_devices=4 --config.rollout_processes=2 --multihost \
    --coordinator_address=127.0.0.1:8476 --num_processes=3 \
    --process_id=$i & done

A refusal is the job's: when one process refuses or fails (a busy
workdir, a wrong workdir kind, a full disk, bad input), it tells the
others, and every process exits with its code and one line naming the
cause and the process that found it. Flags and every config check that
needs no device are checked before the processes meet.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import entry
from train.jobs import multihost

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'RL config file (get_config(arg)).', lock_config=True)
_WORKDIR = flags.DEFINE_string(
    'workdir', None, 'Directory for checkpoints, metrics and results.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()

  def job():
    entry.configure_devices(config)
    # pylint: disable=g-import-not-at-top
    from train.rl import processes
    from train.rl import run
    # pylint: enable=g-import-not-at-top
    multihost.check_flags()
    if multihost.MULTIHOST.value and multihost.NUM_PROCESSES.value:
      # Whatever needs no peer is refused here, by every process alike,
      # not after waiting for the others to join.
      run.check_config(config, processes=multihost.NUM_PROCESSES.value)
    # Each process's programs run on its own devices, but for the update
    # of a learner over several processes (learner_group).
    multihost.initialize(collectives=processes.learner_group_size(
        config.get('rollout_processes'), multihost.NUM_PROCESSES.value
        or 1) > 1)
    return run.train_and_evaluate(config, _WORKDIR.value)

  # A job of several processes ends through jax.distributed's shutdown,
  # without the interpreter's teardown (multihost.exit_job says why).
  end = multihost.exit_job if multihost.MULTIHOST.value else sys.exit
  results = entry.run_job(job, end=end)
  if results.get('role') == 'rollout':
    print(f'rollout process {results["process"]}: sent '
          f'{results["batches_sent"]} batches; workdir {_WORKDIR.value} '
          '(the learner\'s)')
  elif results.get('role') == 'follower':
    print(f'learner process {results["process"]}: joined '
          f'{results["updates"]} updates; workdir {_WORKDIR.value} (the '
          'lead learner\'s)')
  else:
    scores = ', '.join(f'{d} digits {100 * v:.1f}%'
                       for d, v in results['pass_at_1'].items())
    print(f'pass@1: {scores} (staleness <= '
          f'{config.runtime.max_staleness}, {config.grpo.correction}; '
          f'{results["samples_per_second"]:.1f} samples/s; workdir '
          f'{_WORKDIR.value})')
  end(0)


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, _CONFIG))
