"""A sweep as runs and command lines: expansion, validation, quoting, targets.

`plan(config_arg, sweep, root)` loads `configs/X.py`, expands
`get_sweep(sweep)` and checks every override against `get_config(arg)`
(the field exists, the value has its type) before anything runs. Each run
gets a workdir below `root` named after its overrides and one argv of its
job's launcher (`ENTRIES`: `python -m launch.rl` for `config.task='rl'`,
else `python -m launch.train`). Targets turn the argv into what runs it:

- local: the argv itself (run by `launch.sweep` without a shell);
- tpu: `gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all
  --command CMD`, CMD running the argv on every worker with `--multihost`;
- xpk: `xpk workload create --cluster C --workload W --tpu-type T
  --num-slices N --command CMD`.

Quoting: every argv element goes through `shlex.quote` when it becomes
part of a shell string, at each level (the remote CMD, then the local
command line that carries it), so any value, `'; rm -rf ~'` included,
arrives on the remote side as one argument (tested by parsing both levels
back with `shlex.split`).
"""

import ast
import copy
import dataclasses
import hashlib
import importlib.util
import os
import re
import shlex
import sys
from typing import Any

import ml_collections

from train.errors import UsageError

TARGETS = ('local', 'tpu', 'xpk')
MANIFEST = 'sweep.json'
# config.task -> (launcher module, the file a finished run has written).
ENTRIES = {'rl': ('launch.rl', 'results.json')}
DEFAULT_ENTRY = ('launch.train', 'final_metrics.json')


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a sweep: its name, overrides, workdir, launcher argv and
  the file in its workdir that says it finished."""
  name: str
  overrides: dict[str, Any]
  workdir: str
  argv: tuple[str, ...]
  finished: str = DEFAULT_ENTRY[1]


def _split_config(config_arg: str) -> tuple[str, str | None]:
  path, sep, arg = config_arg.partition(':')
  return path, (arg if sep else None)


def load_config_module(config_arg: str):
  """The module of `--config=path.py[:arg]` (UsageError if it cannot load)."""
  path, _ = _split_config(config_arg)
  if not os.path.isfile(path):
    raise UsageError('--config', config_arg, 'no such config file')
  name = 'sweep_config_' + re.sub(r'\W', '_', os.path.abspath(path))
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise UsageError('--config', config_arg,
                     'defines no get_sweep(name); see configs/sweeps.py')
  return module


def flag_value(value: Any) -> str:
  """How absl's config flags read `value` back (`--config.a.b=...`)."""
  if isinstance(value, (list, tuple)):
    return str(tuple(value))
  return str(value)


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: dict[str, Any], where: str) -> None:
  """Sets each dotted field; UsageError naming a missing field or bad type."""
  for key, value in overrides.items():
    node, parts = config, key.split('.')
    for depth, part in enumerate(parts):
      parent = '.'.join(['config'] + parts[:depth])
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        choices = (sorted(node.keys())
                   if isinstance(node, ml_collections.ConfigDict) else [])
        raise UsageError(where, key, f'{parent} has no field {part!r}',
                         choices)
      if depth == len(parts) - 1:
        try:
          node[part] = value
        except (TypeError, ValueError) as e:
          raise UsageError(where, key, f'cannot take {value!r}: {e}') from None
      else:
        node = node[part]


def run_name(overrides: dict[str, Any]) -> str:
  """A readable workdir name: `key=value` pairs (last key parts unless ambiguous)."""
  if not overrides:
    return 'default'
  short = [k.split('.')[-1] for k in overrides]
  keys = short if len(set(short)) == len(short) else list(overrides)
  text = ','.join(f'{k}={flag_value(v)}' for k, v in zip(keys,
                                                          overrides.values()))
  return re.sub(r'[^A-Za-z0-9.,=_+-]', '_', text)


def parse_settings(items: list[str]) -> dict[str, Any]:
  """`field=value` items (launch.sweep --set) as overrides; a value is a
  Python literal where it parses as one, else the string itself."""
  out = {}
  for item in items:
    field, sep, text = item.partition('=')
    if not sep or not field:
      raise UsageError('--set', item, 'must be field=value, e.g. '
                       'sft_workdir=gs://bucket/sft')
    try:
      out[field] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      out[field] = text
  return out


def plan(config_arg: str, sweep: str, root: str,
         settings: dict[str, Any] | None = None) -> list[Run]:
  """The sweep's runs, validated; raises UsageError before anything runs.

  `settings` (launch.sweep --set) apply to every run, before its overrides,
  and travel in its argv as `--config.field=value`; they do not name it.
  """
  settings = dict(settings or {})
  module = load_config_module(config_arg)
  _, arg = _split_config(config_arg)
  try:
    runs = module.get_sweep(sweep)
  except ValueError as e:
    raise UsageError('--sweep', sweep, str(e).split(': ', 1)[-1]) from None
  if not runs:
    raise UsageError('--sweep', sweep, 'is empty')
  base = module.get_config(arg)
  apply_overrides(base, settings, '--set')
  launcher, finished = ENTRIES.get(base.get('task'), DEFAULT_ENTRY)
  out, seen = [], {}
  for i, overrides in enumerate(runs):
    apply_overrides(copy.deepcopy(base), overrides,
                    f'--sweep={sweep} (run {i})')
    name = run_name(overrides)
    if name in seen:
      raise UsageError('--sweep', sweep, f'runs {seen[name]} and {i} have the '
                       f'same overrides ({name})')
    seen[name] = i
    workdir = root.rstrip('/') + '/' + name
    argv = ('python3', '-m', launcher, f'--config={config_arg}',
            f'--workdir={workdir}',
            *(f'--config.{k}={flag_value(v)}'
              for k, v in {**settings, **overrides}.items()))
    out.append(Run(name, dict(overrides), workdir, argv, finished))
  return out


def local_argv(run: Run) -> list[str]:
  """The run's argv with this interpreter (no shell involved)."""
  return [sys.executable, *run.argv[1:]]


def _cd(directory: str) -> str:
  # `~` must stay outside the quotes to expand on the remote side.
  if directory == '~' or directory.startswith('~/'):
    rest = directory[2:]
    return 'cd ~' + (f'/{shlex.quote(rest)}' if rest else '')
  return f'cd {shlex.quote(directory)}'


def remote_command(run: Run, remote_dir: str, python: str) -> str:
  """The shell command each TPU worker runs: cd, then the run with --multihost."""
  return f'{_cd(remote_dir)} && ' + shlex.join(
      (python, *run.argv[1:], '--multihost'))


def tpu_argv(run: Run, tpu: str, zone: str, project: str | None,
             remote_dir: str, python: str) -> list[str]:
  argv = ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', tpu, '--zone', zone,
          '--worker=all', '--command', remote_command(run, remote_dir, python)]
  if project:
    argv[6:6] = ['--project', project]
  return argv


def workload_name(prefix: str, run: Run) -> str:
  """An xpk/Kubernetes-safe name: lowercase, [a-z0-9-], <= 40 chars, unique."""
  digest = hashlib.sha1(run.name.encode()).hexdigest()[:6]
  body = re.sub(r'[^a-z0-9-]+', '-', f'{prefix}-{run.name}'.lower()).strip('-')
  return f'{body[:33].rstrip("-")}-{digest}'


def xpk_argv(run: Run, cluster: str, tpu_type: str, num_slices: int,
             prefix: str, docker_image: str | None, python: str) -> list[str]:
  argv = ['xpk', 'workload', 'create', '--cluster', cluster, '--workload',
          workload_name(prefix, run), '--tpu-type', tpu_type, '--num-slices',
          str(num_slices)]
  if docker_image:
    argv += ['--docker-image', docker_image]
  argv += ['--command', shlex.join((python, *run.argv[1:], '--multihost'))]
  return argv
