"""Running a sweep's runs: locally, `parallel` at a time, or on TPU / xpk.

`launch.sweep` (its command line) plans the runs (`train.jobs.sweep_plan`)
and calls these. A local run is `launch.train` (or `launch.rl`) in its own
process; a finished run is skipped, an interrupted one resumes, and a run
whose workdir another process holds waits for it.
"""

import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time

from train.run import disk_space
from train import fileio
from train.run import metrics
from train.run import job
from train.errors import UsageError
from train.jobs import entry
from train.jobs import sweep_plan

REQUIRED = {'tpu': ('tpu', 'zone'), 'xpk': ('xpk_cluster', 'xpk_tpu_type')}


def check_target(target: str, workdir: str, parallel: int,
                 given: dict[str, str | None]) -> None:
  """The flags `target` needs (`given`: flag name -> value), before any run."""
  for name in REQUIRED.get(target, ()):
    if not given.get(name):
      raise UsageError(f'--{name}', given.get(name),
                       f'required with --target={target}')
  if target == 'local' and workdir.startswith('gs://'):
    raise UsageError('--workdir', workdir,
                     'local runs need a local directory; gs:// is for '
                     '--target=tpu or xpk')
  if parallel < 1:
    raise UsageError('--parallel', parallel, 'must be >= 1')


def write_manifest(root: str, config: str, sweep: str,
                   runs: list[sweep_plan.Run]) -> None:
  """`root/sweep.json`: what `launch.report` reads."""
  os.makedirs(root, exist_ok=True)
  metrics.write_json_atomic(os.path.join(root, sweep_plan.MANIFEST), {
      'config': config, 'sweep': sweep,
      'runs': [{'name': r.name, 'overrides': r.overrides,
                'workdir': r.workdir, 'results': r.finished}
               for r in runs]})


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
        holder = job.holder(run.workdir)
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


def run_remote(runs: list[sweep_plan.Run], commands: list[list[str]],
               execute: bool) -> int:
  """Prints the commands (a dry run), or runs them one after another."""
  if not execute:
    print(f'# {len(commands)} runs (dry run; add --execute to run them)')
    for command in commands:
      print(shlex.join(command))
    return 0
  for run, command in zip(runs, commands):
    print(f'[start] {run.name}: {shlex.join(command)}', flush=True)
    code = subprocess.call(command)
    if code:
      print(f'[failed] {run.name}: exit {code}', file=sys.stderr)
      return 1
  return 0
