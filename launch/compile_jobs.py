"""The programs each job compiles, and compiling them for `launch.compile`.

Flagless, like `launch.trainers` (tests call `run` in-process). A group is the programs of one mesh
(training runs have one; GRPO has the learner's and the rollout's), with a
description of the mesh. Jobs that read a trained model from another
workdir get that model's config (`model_config`) here: the given one, else
the one saved in that workdir's checkpoint, else the job's documented
default (`DEFAULT_MODEL_CONFIGS`).
"""

from collections.abc import Sequence
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from typing import Any

import ml_collections

# The trained model each job reads by default: its config file and arg.
DEFAULT_MODEL_CONFIGS = {
    'tta': ('configs/digits.py', 'dataset=mnist5k'),
    'rl': ('configs/rl_sft.py', None),
    'steering': ('configs/lm.py', None),
}
# The config field naming that model's workdir.
MODEL_WORKDIR_FIELDS = {'tta': 'source_workdir', 'rl': 'sft_workdir',
                        'steering': 'lm_workdir'}
TASKS = ('classification', 'lm', 'rl_sft', 'tta', 'rl', 'steering',
         'gemma_steering')
RESULT = 'compile.json'


@dataclasses.dataclass(frozen=True)
class Group:
  """Programs compiled on one mesh.

  Attributes:
    name: 'train', 'learner', 'rollout', ...
    description: the mesh and what the programs take, for the report.
    programs: `train.aot.Program`s.
  """
  name: str
  description: str
  programs: list[Any]


def task_of(config: ml_collections.ConfigDict) -> str:
  """The job a config is for (steering configs name their LM's workdir)."""
  if 'lm_workdir' in config:
    return 'steering'
  if 'gguf' in config:
    return 'gemma_steering'
  return config.get('task', 'classification')


def mesh_description(mesh, rules=None) -> str:
  axes = ' x '.join(f'{a}={n}' for a, n in mesh.shape.items())
  text = f'mesh {axes} ({mesh.devices.size} devices)'
  if rules:
    text += '; rules ' + ', '.join(f'{l}->{m}' for l, m in rules
                                   if m is not None)
  return text


def _config_from_file(path: str, arg: str | None) -> ml_collections.ConfigDict:
  import importlib.util  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      'model_config', os.path.join(root, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _saved_config(workdir: str) -> ml_collections.ConfigDict | None:
  """The config saved with a workdir's newest checkpoint, if it has one."""
  # pylint: disable=g-import-not-at-top
  from train import checkpointing
  # pylint: enable=g-import-not-at-top
  if not os.path.isdir(os.path.join(workdir, checkpointing.CHECKPOINTS)):
    return None
  found = checkpointing.newest_meta(workdir)
  if found is None:
    return None
  return ml_collections.ConfigDict(json.loads(found[1]['config']))


def model_config(config: ml_collections.ConfigDict, task: str,
                 given: ml_collections.ConfigDict | None
                 ) -> ml_collections.ConfigDict | None:
  """The trained model's config for jobs that read one (see module doc)."""
  if task not in DEFAULT_MODEL_CONFIGS:
    return None
  if given is not None:
    return given
  workdir = config.get(MODEL_WORKDIR_FIELDS[task])
  if workdir:
    saved = _saved_config(workdir)
    if saved is not None:
      return saved
  return _config_from_file(*DEFAULT_MODEL_CONFIGS[task])


def programs(config: ml_collections.ConfigDict, devices: Sequence[Any],
             given_model_config: ml_collections.ConfigDict | None,
             workdir: str) -> list[Group]:
  """The program groups of `config`'s job on `devices`.

  Raises:
    UsageError: the config (or the model's) is invalid.
  """
  # pylint: disable=g-import-not-at-top
  from train import aot
  from train.errors import ConfigError
  # pylint: enable=g-import-not-at-top
  task = task_of(config)
  model = model_config(config, task, given_model_config)
  if task in ('classification', 'lm', 'rl_sft'):
    if task == 'classification':
      from train.vision import experiment as product  # pylint: disable=g-import-not-at-top
    elif task == 'lm':
      from train.lm import trainer as product  # pylint: disable=g-import-not-at-top
    else:
      from train.rl import sft as product  # pylint: disable=g-import-not-at-top
    exp = product.build(config, workdir, devices=devices, check_data=False)
    return [Group('train', mesh_description(
        exp.mesh, config.logical_axis_rules) + '; batches fed by the host',
                  aot.programs(exp))]
  if task == 'tta':
    from train.tta import adapt  # pylint: disable=g-import-not-at-top
    mesh, progs = adapt.programs(config, model, devices)
    return [Group('adapt', mesh_description(mesh), progs)]
  if task == 'rl':
    from train.rl import run as rl_run  # pylint: disable=g-import-not-at-top
    return [Group(name, mesh_description(mesh, rules), progs)
            for name, mesh, rules, progs in rl_run.programs(config, model,
                                                            devices)]
  if task == 'steering':
    from train.steering import evaluation  # pylint: disable=g-import-not-at-top
    mesh, rules, progs = evaluation.programs(config, model, devices)
    return [Group('generation', mesh_description(mesh, rules), progs)]
  if task == 'gemma_steering':
    from train.steering import gemma_eval  # pylint: disable=g-import-not-at-top
    mesh, rules, progs = gemma_eval.programs(config, devices)
    return [Group('evaluation', mesh_description(mesh, rules), progs)]
  raise ConfigError('task', task, 'unknown task', TASKS)


@contextlib.contextmanager
def quiet_stderr():
  """Silences file descriptor 2: the CUDA plugin's C++ start-up lines ("Could
  not find cuda drivers") are not about compiling. Shown if the block fails."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield
    except BaseException:
      os.dup2(saved, 2)
      sink.seek(0)
      sys.stderr.write(sink.read().decode(errors='replace'))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def run(config, target_text: str, num_slices: int, workdir: str | None,
        model_config) -> dict:
  """Compiles `config`'s programs for the target; returns compile.json's
  content after printing the table (raises the launcher's errors)."""
  # pylint: disable=g-import-not-at-top
  from train import compile_report
  from train import targets
  from train.errors import UsageError
  # pylint: enable=g-import-not-at-top
  try:
    target = targets.parse(target_text)
    if not isinstance(num_slices, int) or num_slices < 1:
      raise targets.TargetError(f'--num_slices={num_slices}: must be >= 1')
    with quiet_stderr():
      devices = targets.devices(target, num_slices)
  except targets.TargetError as e:
    raise UsageError('--target', target_text, str(e).split(': ', 1)[-1]
                     ) from None
  chip = targets.chip_for(target)
  label = str(target) + (f' x {num_slices} slices' if num_slices > 1 else '')
  with tempfile.TemporaryDirectory() as scratch:
    groups = programs(config, devices, model_config,
                                   workdir or scratch)
    rows = []
    for group in groups:
      rows += compile_report.compile_programs(group.programs, chip)
  print(f'{label}: {len(devices)} x {chip.device_kind}, '
        f'{compile_report.gib(chip.hbm_bytes)} GiB usable per chip '
        f'(peak {chip.peak_flops / 1e12:.0f} TFLOP/s bf16, '
        f'{chip.hbm_bandwidth / 1e9:.0f} GB/s; {chip.source})')
  for group in groups:
    print(f'  {group.name}: {group.description}')
  print(compile_report.table(rows, chip))
  result = {
      'target': str(target), 'num_slices': num_slices,
      'devices': len(devices), 'device_kind': chip.device_kind,
      'hbm_bytes': chip.hbm_bytes, 'peak_flops': chip.peak_flops,
      'hbm_bandwidth': chip.hbm_bandwidth, 'chip_source': chip.source,
      'meshes': {g.name: g.description for g in groups},
      'config': config.to_dict(),
      'rows': [r.to_json() for r in rows],
  }
  if workdir:
    from train import fileio  # pylint: disable=g-import-not-at-top
    fileio.makedirs(workdir)
    fileio.write_text_atomic(fileio.join(workdir, RESULT),
                             json.dumps(result, indent=1))
  compile_report.check(rows, chip, label)
  return result
