r"""Expand a config's sweep into runs (`launch.train`, or `launch.rl` for
RL configs): run them here, or on TPU pods.

  python -m launch.sweep --config=configs/digits.py:runlocal --sweep=smoke \
    --workdir=workdirs/smoke --parallel=2
  python -m launch.sweep --config=configs/digits.py --sweep=sam_rho \
    --workdir=gs://BUCKET/sam_rho --target=tpu --tpu=my-v5e --zone=us-west4-a
  python -m launch.sweep --config=configs/digits.py --sweep=sam_rho \
    --workdir=gs://BUCKET/sam_rho --target=xpk --xpk_cluster=c1 \
    --xpk_tpu_type=v5litepod-16
  python -m launch.sweep --config=configs/rl.py:size=1b --sweep=staleness \
    --set=sft_workdir=/gcs/BUCKET/rl_sft_1b --set=rollout_processes=3 \
    --workdir=/gcs/BUCKET/rl_staleness --target=xpk --xpk_cluster=c1 \
    --xpk_tpu_type=v5litepod-16

`--set=field=value` (repeatable) sets a field of every run (an RL run's
warm start, its process split; a multi-process RL run's learner writes
its checkpoints to a file system, hence the bucket's FUSE mount, /gcs).
Each run gets `--workdir/<its overrides>`. `--target=local` runs
`--parallel` at a time: a finished run (final_metrics.json present;
results.json for RL) is
skipped, an interrupted one resumes from its checkpoint, so relaunching the
same command finishes a sweep. Runs die with the sweep (they get SIGTERM
and save a checkpoint), and a run whose workdir is still held by another
process (its lock, `train.run.job.holder`) waits for it instead of racing
it; logs go to `--workdir/logs/`, and
`--workdir/sweep.json` lists the runs for `launch.report`. The TPU and xpk
targets print their commands (a dry run) unless `--execute`; on TPU every
run goes to all workers with `--multihost`, one run after another.

Mistakes (unknown sweep, an override of a field that does not exist, a
missing --tpu) end with one line naming the flag and the valid choices
(exit status 2) before anything runs.
"""

import os
import sys

from absl import app
from absl import flags

from train.errors import UsageError
from train.jobs import entry
from train.jobs import sweep_plan
from train.jobs import sweep_runs

_CONFIG = flags.DEFINE_string('config', None,
                              'Config file with get_sweep(), path[:arg].')
_SWEEP = flags.DEFINE_string('sweep', None, 'Name of the sweep.')
_WORKDIR = flags.DEFINE_string('workdir', None,
                               'Root of the runs\' workdirs (gs:// for pods).')
_TARGET = flags.DEFINE_enum('target', 'local', sweep_plan.TARGETS,
                            'Where the runs go.')
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'local: runs at a time.')
_SET = flags.DEFINE_multi_string(
    'set', [], 'field=value for every run (repeatable), e.g. '
    'sft_workdir=workdirs/rl_sft.')
_EXECUTE = flags.DEFINE_bool('execute', False,
                             'tpu/xpk: run the commands (default: print).')
_TPU = flags.DEFINE_string('tpu', None, 'tpu: the TPU VM (pod) name.')
_ZONE = flags.DEFINE_string('zone', None, 'tpu: its zone.')
_PROJECT = flags.DEFINE_string('project', None, 'tpu: the GCP project.')
_REMOTE_DIR = flags.DEFINE_string('remote_dir', '~/geom',
                                  'tpu: the checkout on every worker.')
_REMOTE_PYTHON = flags.DEFINE_string(
    'remote_python', 'python3', 'tpu/xpk: the interpreter on the workers.')
_XPK_CLUSTER = flags.DEFINE_string('xpk_cluster', None, 'xpk: the cluster.')
_XPK_TPU_TYPE = flags.DEFINE_string('xpk_tpu_type', None,
                                    'xpk: e.g. v5litepod-16.')
_XPK_SLICES = flags.DEFINE_integer('xpk_num_slices', 1, 'xpk: slices.')
_XPK_IMAGE = flags.DEFINE_string('xpk_docker_image', None,
                                 'xpk: image with the repo (default: xpk\'s).')
_XPK_PREFIX = flags.DEFINE_string('xpk_prefix', 'geom',
                                  'xpk: workload name prefix.')
flags.mark_flags_as_required(['config', 'sweep', 'workdir'])


def main(argv):
  # Progress lines ([wait], [start], [done]) as they happen, into a pipe too.
  sys.stdout.reconfigure(line_buffering=True)
  del argv
  local = _TARGET.value == 'local'
  root = os.path.abspath(_WORKDIR.value) if local else _WORKDIR.value
  try:
    sweep_runs.check_target(_TARGET.value, _WORKDIR.value, _PARALLEL.value, {
        'tpu': _TPU.value, 'zone': _ZONE.value,
        'xpk_cluster': _XPK_CLUSTER.value,
        'xpk_tpu_type': _XPK_TPU_TYPE.value})
    runs = sweep_plan.plan(_CONFIG.value, _SWEEP.value, root,
                           sweep_plan.parse_settings(_SET.value))
    if local:
      sweep_runs.write_manifest(root, _CONFIG.value, _SWEEP.value, runs)
      sys.exit(1 if sweep_runs.run_local(runs, root, _PARALLEL.value) else 0)
  except UsageError as e:  # A flag, or a special file among the logs.
    print(f'error: {e}', file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)
  if _TARGET.value == 'tpu':
    commands = [sweep_plan.tpu_argv(r, _TPU.value, _ZONE.value, _PROJECT.value,
                                    _REMOTE_DIR.value, _REMOTE_PYTHON.value)
                for r in runs]
  else:
    commands = [sweep_plan.xpk_argv(r, _XPK_CLUSTER.value, _XPK_TPU_TYPE.value,
                                    _XPK_SLICES.value, _XPK_PREFIX.value,
                                    _XPK_IMAGE.value, _REMOTE_PYTHON.value)
                for r in runs]
  sys.exit(sweep_runs.run_remote(runs, commands, _EXECUTE.value))


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, None))
