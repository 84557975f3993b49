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
process (its lock, `train.workdir_lock`) waits for it instead of racing
it; logs go to `--workdir/logs/`, and
`--workdir/sweep.json` lists the runs for `launch.report`. The TPU and xpk
targets print their commands (a dry run) unless `--execute`; on TPU every
run goes to all workers with `--multihost`, one run after another.

Mistakes (unknown sweep, an override of a field that does not exist, a
missing --tpu) end with one line naming the flag and the valid choices
(exit status 2) before anything runs.
"""

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

from launch import entry
from launch import sweep_plan
from train import disk_space
from train import fileio
from train import workdir_lock
from train.errors import UsageError

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


def _check_target_flags() -> None:
  required = {'tpu': (('--tpu', _TPU), ('--zone', _ZONE)),
              'xpk': (('--xpk_cluster', _XPK_CLUSTER),
                      ('--xpk_tpu_type', _XPK_TPU_TYPE))}
  for name, flag in required.get(_TARGET.value, ()):
    if not flag.value:
      raise UsageError(name, flag.value,
                       f'required with --target={_TARGET.value}')
  if _TARGET.value == 'local' and _WORKDIR.value.startswith('gs://'):
    raise UsageError('--workdir', _WORKDIR.value,
                     'local runs need a local directory; gs:// is for '
                     '--target=tpu or xpk')
  if _PARALLEL.value < 1:
    raise UsageError('--parallel', _PARALLEL.value, 'must be >= 1')


def _die_with_parent() -> None:
  """In the child, before exec: SIGTERM when the sweep dies (Linux).

  The trainer saves a checkpoint on SIGTERM, so a sweep killed with -9
  leaves no orphaned trainer racing the next launch for its workdir.
  """
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
  except (OSError, AttributeError):
    pass  # Not Linux: the relaunch still waits on the workdir lock.


_PR_SET_PDEATHSIG = 1


def _latest_checkpoint(workdir: str) -> int | None:
  steps = disk_space.completed_steps(os.path.join(workdir, 'checkpoints'))
  return steps[-1] if steps else None


def run_local(runs: list[sweep_plan.Run], root: str, parallel: int) -> int:
  """Runs what is not finished, `parallel` at a time; returns the failures.

  A run whose workdir another process holds (e.g. the trainer of an
  earlier launch of this sweep) waits until it is free, then is skipped if
  that process finished it, else resumed.
  """
  logs = os.path.join(root, 'logs')
  os.makedirs(logs, exist_ok=True)
  # A FIFO or a device among the logs would block the sweep at its run's
  # start: refused in one line before any run starts.
  fileio.check_tree(logs)
  pending, waiting = list(runs), set()
  active, failed, done = {}, [], 0

  try:
    while pending or active:
      for run in list(pending):
        if len(active) >= parallel:
          break
        holder = workdir_lock.holder(run.workdir)
        if holder is not None:
          if run.name not in waiting:
            waiting.add(run.name)
            print(f'[wait] {run.name}: workdir in use by pid '
                  f'{holder.get("pid", "?")} on {holder.get("host", "?")}')
          continue
        pending.remove(run)
        if os.path.exists(os.path.join(run.workdir, run.finished)):
          print(f'[skip] {run.name}: finished')
          done += 1
          continue
        how = ('resume' if os.path.isdir(os.path.join(run.workdir,
                                                      'checkpoints'))
               else 'start')
        log = fileio.open_local(os.path.join(logs, f'{run.name}.log'), 'a',
                                root=logs)
        print(f'[{how}] {run.name}: {shlex.join(sweep_plan.local_argv(run))}')
        active[run.name] = (subprocess.Popen(
            sweep_plan.local_argv(run), stdout=log, stderr=subprocess.STDOUT,
            cwd=os.getcwd(), preexec_fn=_die_with_parent), log, run)
      time.sleep(0.2)
      for name, (proc, log, run) in list(active.items()):
        if proc.poll() is None:
          continue
        log.close()
        del active[name]
        if proc.returncode == entry.EXIT_BUSY:
          # Taken between our look at the lock and the child's: wait again.
          pending.append(run)
          continue
        if proc.returncode:
          failed.append(name)
          print(f'[failed] {name}: exit {proc.returncode}; log: {log.name}')
        else:
          done += 1
          print(f'[done] {name}')
  except KeyboardInterrupt:
    # Ctrl-C reached the children too; SIGTERM covers a `kill` of the sweep
    # alone. Each saves a checkpoint when it is inside its training loop.
    for proc, _, _ in active.values():
      proc.terminate()
    for proc, log, run in active.values():
      proc.wait()
      log.close()
      step = _latest_checkpoint(run.workdir)
      print(f'[stopped] {run.name}: '
            + ('no checkpoint yet; a relaunch starts it over'
               if step is None else
               f'latest checkpoint at step {step}; a relaunch resumes it'))
    print('interrupted; relaunch the same command to finish the sweep')
    return len(active) or 1
  print(f'{done}/{len(runs)} runs finished'
        + (f'; failed: {", ".join(failed)}' if failed else ''))
  return len(failed)


def main(argv):
  del argv
  local = _TARGET.value == 'local'
  root = os.path.abspath(_WORKDIR.value) if local else _WORKDIR.value
  try:
    _check_target_flags()
    runs = sweep_plan.plan(_CONFIG.value, _SWEEP.value, root,
                           sweep_plan.parse_settings(_SET.value))
  except UsageError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(entry.EXIT_USAGE)

  if local:
    os.makedirs(root, exist_ok=True)
    from train import metrics  # pylint: disable=g-import-not-at-top
    metrics.write_json_atomic(os.path.join(root, sweep_plan.MANIFEST), {
        'config': _CONFIG.value, 'sweep': _SWEEP.value,
        'runs': [{'name': r.name, 'overrides': r.overrides,
                  'workdir': r.workdir, 'results': r.finished}
                 for r in runs]})
    try:
      failures = run_local(runs, root, _PARALLEL.value)
    except UsageError as e:  # A special file among the logs.
      print(f'error: {e}', file=sys.stderr)
      sys.exit(entry.EXIT_USAGE)
    sys.exit(1 if failures else 0)

  if _TARGET.value == 'tpu':
    commands = [sweep_plan.tpu_argv(r, _TPU.value, _ZONE.value, _PROJECT.value,
                                    _REMOTE_DIR.value, _REMOTE_PYTHON.value)
                for r in runs]
  else:
    commands = [sweep_plan.xpk_argv(r, _XPK_CLUSTER.value, _XPK_TPU_TYPE.value,
                                    _XPK_SLICES.value, _XPK_PREFIX.value,
                                    _XPK_IMAGE.value, _REMOTE_PYTHON.value)
                for r in runs]
  if not _EXECUTE.value:
    print(f'# {len(commands)} runs (dry run; add --execute to run them)')
    for command in commands:
      print(shlex.join(command))
    return
  for run, command in zip(runs, commands):
    print(f'[start] {run.name}: {shlex.join(command)}', flush=True)
    code = subprocess.call(command)
    if code:
      print(f'[failed] {run.name}: exit {code}', file=sys.stderr)
      sys.exit(1)


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(argv, None))
