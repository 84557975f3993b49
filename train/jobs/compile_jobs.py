"""The programs each job compiles, and compiling them for `launch.compile`.

Flagless, like `train.jobs.trainers` (tests call `run` in-process). A group is the programs of one mesh
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
# Layers a model may have (`model.num_layers`). Each is traced and compiled
# unrolled: measured on this 2-core host for the LM's train step, 64
# layers took 16 s to build and trace and 150 s to compile, 256 layers
# 164 s before the compile began. The deepest dense models published have
# 118 (PaLM 540B) and 126 (Llama 3.1 405B) layers; 128 holds them.
MAX_LAYERS = 128
# Any size in a model block: JAX (without x64) passes a Python int to a
# jitted function as int32, and d_model=2**62 was an OverflowError
# traceback while the model was built. The largest real dimension (a
# 256k vocabulary) is far below.
MAX_SIZE = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Group:
  """Programs compiled on one mesh.

  Attributes:
    name: 'train', 'learner', 'rollout', ...
    description: the mesh and what the programs take, for the report.
    programs: `train.training.aot.Program`s.
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


def check_layers(config: ml_collections.ConfigDict | None, name: str) -> None:
  """UsageError naming `name`.model.num_layers past `MAX_LAYERS` (before
  anything is traced: tracing alone took minutes at a few hundred), or
  another size of `name`.model past `MAX_SIZE`."""
  from train.errors import UsageError  # pylint: disable=g-import-not-at-top
  model = None if config is None else config.get('model')
  if not isinstance(model, ml_collections.ConfigDict):
    return
  sizes = {k: v for k, v in model.items()
           if isinstance(v, int) and not isinstance(v, bool)}
  if sizes.get('num_layers', 0) > MAX_LAYERS:
    raise UsageError(
        f'{name}.model.num_layers', sizes['num_layers'],
        f'at most {MAX_LAYERS} layers (deeper than any published model; '
        'each layer is traced and compiled unrolled)')
  for field, value in sorted(sizes.items()):
    if value > MAX_SIZE:
      raise UsageError(f'{name}.model.{field}', value,
                       f'at most {MAX_SIZE} (JAX passes sizes to its programs '
                       'as int32)')


def size_fields(config: ml_collections.ConfigDict,
                model: ml_collections.ConfigDict | None) -> str:
  """The size fields of the job's model (its own, else the trained model's
  config) and batches, for a refusal that says what to lower:
  'config.model.d_model=..., ..., config.batch_size=...'."""
  fields = []
  for name, source in (('config', config), ('model_config', model)):
    block = None if source is None else source.get('model')
    if isinstance(block, ml_collections.ConfigDict):
      fields += [(f'{name}.model.{k}', v) for k, v in block.items()]
      break
  fields += [(f'config.{k}', config.get(k))
             for k in ('batch_size', 'eval_batch_size')]
  return ', '.join(f'{k}={v}' for k, v in fields
                   if isinstance(v, int) and not isinstance(v, bool))


def _config_from_file(path: str, arg: str | None) -> ml_collections.ConfigDict:
  import importlib.util  # pylint: disable=g-import-not-at-top
  # train/jobs/ -> the repository root, where configs/ is.
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  spec = importlib.util.spec_from_file_location(
      'model_config', os.path.join(root, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _saved_config(workdir: str) -> ml_collections.ConfigDict | None:
  """The config saved with a workdir's newest checkpoint, if it has one."""
  # pylint: disable=g-import-not-at-top
  from train.run import checkpointing
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
  from train.training import aot
  from train.errors import ConfigError
  # pylint: enable=g-import-not-at-top
  task = task_of(config)
  model = model_config(config, task, given_model_config)
  # The configs given are checked before JAX starts (`check_flags`); the
  # trained model's may come from a checkpoint, read only here.
  check_layers(model, 'model_config')
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
    from train.steering import evaluation  # pylint: disable=g-import-not-at-top
    mesh, rules, progs = evaluation.programs(config, None, devices)
    return [Group('evaluation', mesh_description(mesh, rules), progs)]
  raise ConfigError('task', task, 'unknown task', TASKS)


def import_jax() -> None:
  """JAX on the CPU only, with the target compilers importable and no
  persistent compilation cache; imported (quietly), its backend not yet
  started."""
  os.environ['JAX_PLATFORMS'] = 'cpu'
  # A deviceless executable cannot be loaded back: with a persistent
  # compilation cache set up, every later compile of the same program read
  # its entry, warned "PjRtCompiler must be constructed with a Client to
  # call DeserializeLoadedExecutable" and compiled again.
  os.environ['JAX_ENABLE_COMPILATION_CACHE'] = 'false'
  from train.compilation import targets  # pylint: disable=g-import-not-at-top
  targets.enable_toolchain()
  with quiet_stderr():
    import jax  # pylint: disable=g-import-not-at-top,unused-import


@contextlib.contextmanager
def quiet_stderr():
  """Silences file descriptor 2: the CUDA plugin's C++ start-up lines ("Could
  not find cuda drivers") are not about compiling. Shown if the block fails
  unexpectedly (not for the launcher's one-line errors and signals)."""
  # pylint: disable=g-import-not-at-top
  from train import errors
  from train.compilation import targets
  # pylint: enable=g-import-not-at-top
  said = (errors.UsageError, errors.RunError, errors.Interrupted,
          targets.TargetError, targets.SlicesError)
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as sink:
    os.dup2(sink.fileno(), 2)
    try:
      yield
    except BaseException as e:
      os.dup2(saved, 2)
      if not isinstance(e, said):
        sink.seek(0)
        sys.stderr.write(sink.read().decode(errors='replace'))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)


def check_flags(config: ml_collections.ConfigDict, target_text: str,
                num_slices: Any, timeout_s: float | None = None,
                given_model_config: ml_collections.ConfigDict | None = None
                ) -> Any:
  """The parsed target, once the flags are usable (pure Python: call before
  JAX starts, and before anything is written).

  Raises:
    UsageError: naming --target, --num_slices, --compile_timeout or
      (--model_)config.model.num_layers, with the valid values.
    ToolchainMissing: the target's compiler is not installed.
  """
  # pylint: disable=g-import-not-at-top
  from train.jobs import compile_watch
  from train.compilation import targets
  from train.errors import UsageError
  # pylint: enable=g-import-not-at-top
  try:
    target = targets.parse(target_text)
  except targets.TargetError as e:
    raise UsageError('--target', target_text, str(e).split(': ', 1)[-1]
                     ) from None
  try:
    targets.check_slices(target, num_slices)
  except targets.SlicesError as e:
    raise UsageError('--num_slices', num_slices, str(e).split(': ', 1)[-1]
                     ) from None
  if timeout_s is not None:
    try:
      compile_watch.check_timeout(timeout_s)
    except ValueError as e:
      raise UsageError('--compile_timeout', timeout_s, str(e)) from None
  check_layers(config, 'config')
  check_layers(given_model_config, 'model_config')
  targets.check_toolchain(target)
  return target


def start_compilers() -> None:
  """Starts JAX's backend, the target compilers' plugins loaded (quietly)."""
  with quiet_stderr():
    import jax  # pylint: disable=g-import-not-at-top
    jax.devices()


def run(config, target_text: str, num_slices: int, workdir: str | None,
        model_config, timeout_s: float | None = None) -> dict:
  """Compiles `config`'s programs for the target; returns compile.json's
  content after printing the table (raises the launcher's errors).

  The flags and sizes are checked first (`check_flags`); building and
  compiling the programs runs off the main thread, each step within
  `timeout_s` (`train.jobs.compile_watch`; default its DEFAULT_TIMEOUT_S), and
  SIGTERM/SIGINT end it. Nothing is written in `workdir` but compile.json,
  at the end.
  """
  # pylint: disable=g-import-not-at-top
  from train.jobs import compile_watch
  from train.compilation import compile_report
  from train.compilation import targets
  from train.errors import Interrupted, UsageError
  # pylint: enable=g-import-not-at-top
  if timeout_s is None:
    timeout_s = compile_watch.DEFAULT_TIMEOUT_S
  target = check_flags(config, target_text, num_slices, timeout_s,
                       model_config)
  label = str(target) + (f' x {num_slices} slices' if num_slices > 1 else '')
  try:
    start_compilers()
    with quiet_stderr():
      devices = targets.devices(target, num_slices)
  except targets.TargetError as e:
    raise UsageError('--target', target_text, str(e).split(': ', 1)[-1]
                     ) from None
  except Interrupted as e:
    raise compile_watch.CompileInterrupted(
        e.signum, e.signal_name, 'starting the compiler', label, 0
    ) from None
  chip = targets.chip_for(target)

  def work(progress: compile_watch.Progress):
    groups = programs(config, devices, model_config, scratch)
    rows = []
    for group in groups:
      rows += compile_report.compile_programs(group.programs, chip,
                                              progress.step)
    return groups, rows

  # The programs are built in a scratch directory: the workdir gets
  # compile.json only, once every program is compiled.
  with tempfile.TemporaryDirectory() as scratch:
    groups, rows = compile_watch.run(
        work, label, timeout_s,
        f"building the {task_of(config)} job's programs")
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
  compile_report.check(rows, chip, label,
                       lower=size_fields(config, model_config))
  return result
