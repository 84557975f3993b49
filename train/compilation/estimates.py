"""Compiler estimates of whole jobs, one `launch.compile` process per job.

A job is what a user takes to a pod or a GPU node: a config (and a model
config where the job takes one), a target and config overrides. Each runs
as `python -m launch.compile` in a process of its own (a job's compile
must not see another's JAX state), writing compile.json into a workdir
named by its command, so a later run can reuse it. The tables read those
files: per-chip memory from the compiler's memory analysis, FLOPs and HBM
bytes from its cost model, roofline = max(FLOPs / peak, bytes /
bandwidth). Every figure is the compiler's estimate, never a measured time.
"""

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any, NamedTuple, Sequence

from train.analysis import stats

# `launch.compile` and the config paths resolve from the repository root.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

HEAD = ['job', 'target', 'overrides', 'function', 'args GiB', 'temp GiB',
        'total GiB/chip', 'of HBM', 'TFLOPs/chip', 'HBM GB/chip',
        'roofline ms']


class Job(NamedTuple):
  name: str
  config: str
  model_config: str | None
  target: str
  overrides: dict[str, Any]


class Estimate(NamedTuple):
  """A job's compile.json (None if it wrote none) and its error line."""
  job: Job
  result: dict | None
  error: str


def _flag(key: str, value) -> str:
  if isinstance(value, tuple):
    value = '(' + ','.join(map(str, value)) + ')'
  return f'--config.{key}={value}'


def arguments(job: Job) -> list[str]:
  """`launch.compile`'s flags for the job, but --workdir."""
  out = [f'--config={job.config}', f'--target={job.target}']
  out += [_flag(k, v) for k, v in job.overrides.items()]
  if job.model_config:
    out.append(f'--model_config={job.model_config}')
  return out


def command(job: Job) -> str:
  """The command line that compiles the job (to print beside its rows)."""
  return 'python -m launch.compile ' + ' '.join(arguments(job))


def job_workdir(root: str, job: Job) -> str:
  """The job's workdir under `root`, named by its command."""
  digest = hashlib.sha256(command(job).encode()).hexdigest()[:16]
  return os.path.join(root, digest)


def _reused(path: str) -> tuple[dict, str, float]:
  with open(path) as f:
    result = json.load(f)
  fits = all(r['fits'] for r in result['rows'])
  return result, '' if fits else 'error: (reused) see its rows', 0.0


def compile_job(job: Job, workdir: str,
                reuse: bool = False) -> tuple[dict | None, str, float]:
  """compile.json of the job (None if it wrote none), its error line and
  the wall time (0 when `reuse` found one in `workdir`)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, 'compile.json')
  if reuse and os.path.exists(path):
    return _reused(path)
  if os.path.exists(path):
    os.remove(path)
  start = time.perf_counter()
  done = subprocess.run(
      [sys.executable, '-m', 'launch.compile', *arguments(job),
       f'--workdir={workdir}'],
      capture_output=True, text=True, cwd=REPO_ROOT)
  seconds = time.perf_counter() - start
  error = next((l for l in done.stderr.splitlines()
                if l.startswith('error:')), '')
  # 3: it compiled, but does not fit (its rows say so).
  if done.returncode not in (0, 3):
    print(f'{job.name} on {job.target}: exit {done.returncode}: '
          f'{error or done.stderr[-2000:]}')
  if not os.path.exists(path):
    return None, error, seconds
  with open(path) as f:
    return json.load(f), error, seconds


def _gib(n: float) -> str:
  return f'{n / 2**30:.2f}'


def _per(value: float | None, unit: float) -> str:
  return '-' if value is None else f'{value / unit:.3g}'


def _ms(seconds: float | None) -> str:
  return '-' if seconds is None else f'{seconds * 1e3:.3g}'


def _program_row(row: dict) -> list[str]:
  """A compiled program's cells from its compile.json row, after `job,
  target, overrides`."""
  b = row['bytes']
  verdict = (f'{100 * row["total_bytes"] / row["hbm_bytes"]:.0f}%'
             + ('' if row['fits'] else ' DOES NOT FIT'))
  if row['error'] and not row['oom']:
    verdict = f'DOES NOT COMPILE: {row["error"][:120]}'
  return [row['function'], _gib(b['argument']) if b else '-',
          _gib(b['temp']) if b else '-', _gib(row['total_bytes']), verdict,
          _per(row['flops'], 1e12), _per(row['hbm_traffic'], 1e9),
          _ms(row['roofline_seconds'])]


def table(estimates: Sequence[Estimate],
          hidden: Sequence[str] = ()) -> list[str]:
  """A markdown table, a row per compiled program of each job; overrides
  in `hidden` are left out of its overrides column (its name says them)."""
  align = '-' * len(HEAD)
  lines = stats.markdown_table(HEAD, [], align).split('\n')
  for job, result, error in estimates:
    shown = ', '.join(f'{k}={v}' for k, v in job.overrides.items()
                      if k not in hidden) or '-'
    if result is None:
      # By hand: its empty cells read '| |', stats.markdown_table's '|  |'.
      lines.append(f'| {job.name} | {job.target} | {shown} | (no result: '
                   f'{error}) | | | | | | | |')
      continue
    programs = [[job.name, job.target, shown, *_program_row(r)]
                for r in result['rows']]
    # The rows alone: the header is the first two lines above.
    lines += stats.markdown_table(HEAD, programs, align).split('\n')[2:]
  return lines


def _train_steps(estimates: Sequence[Estimate]) -> dict[tuple[str, str], dict]:
  """{(job name, target): its train step's compile.json row}."""
  out = {}
  for job, result, _ in estimates:
    if result is None:
      continue
    step = next((r for r in result['rows']
                 if r['function'].startswith('train_step')), None)
    if step is not None:
      out[(job.name, job.target)] = step
  return out


def ratios(estimates: Sequence[Estimate], suffix: str,
           label: str) -> list[str]:
  """A markdown table: the train step of each job named `<base><suffix>`
  against the step of job `<base>` on the same target, where both fit."""
  steps = _train_steps(estimates)
  rows = []
  for (name, target), variant in steps.items():
    if not name.endswith(suffix):
      continue
    base = steps.get((name[:-len(suffix)], target))
    if base is None or not (variant['fits'] and base['fits']):
      continue
    roof = ('-' if not (variant['roofline_seconds']
                        and base['roofline_seconds'])
            else f'{variant["roofline_seconds"] / base["roofline_seconds"]:.2f}x')
    rows.append([name[:-len(suffix)], target,
                 f'{variant["total_bytes"] / base["total_bytes"]:.2f}x', roof])
  return stats.markdown_table(
      ['job', 'target', f'memory {label} / base', f'roofline {label} / base'],
      rows, '----').split('\n')


def commands(jobs: Sequence[Job]) -> list[str]:
  """A markdown list: each job's command."""
  return [f'- {job.name} on {job.target}: `{command(job)}`' for job in jobs]
