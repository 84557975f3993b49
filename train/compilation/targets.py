"""Compile targets: TPU slices and GPU nodes described from a CPU host.

A target is a chip family and a topology, e.g. 'v5e:16x16' (a v5e pod of
256 chips), 'v5p:4x4x4', 'h100:1x1x8' (one node of 8 H100s) or
'h200:2x1x8' (two such nodes of H200s). `devices(target, num_slices)`
returns compile-only devices for it: XLA's real TPU compiler (libtpu,
Mosaic included) or GPU compiler (PTX and a cubin for sm_90a) runs on
them, and `jax.jit(f).lower(<abstract arrays sharded over a mesh of them>)
.compile()` gives the program a pod or node would run, with its memory
and cost analyses, without any accelerator.

The compilers come from the compile toolchain: libtpu and the CUDA
plugin, installed apart from the run's packages (`make compile-toolchain`,
which `make test` runs) because either one, importable, changes plain CPU
runs: the CUDA plugin prints three lines on every `import jax` on a host
without a GPU, and libtpu makes JAX's backend start print errors. On a TPU
VM or GPU node installed with `pip install .[tpu]` / `.[cuda12]` they are
importable already and nothing is added.

`CHIPS` holds what no API reports: each chip's usable HBM per chip (TPU:
what the TPU compiler itself allows, from its RESOURCE_EXHAUSTED messages;
GPU: the card's memory times JAX's preallocated fraction), its peak dense
bf16 FLOP/s and HBM bandwidth, keyed by the `device_kind` JAX reports.
"""

from collections.abc import Sequence
import dataclasses
import os
import re
import sys
from typing import Any

from train.errors import RunError

GiB = 2**30
# Where `make compile-toolchain` installs libtpu and the CUDA plugin
# (`pip install --target`); GEOM_COMPILE_TOOLCHAIN overrides it.
TOOLCHAIN_ENV = 'GEOM_COMPILE_TOOLCHAIN'
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
GPU_TARGET_CONFIGS = os.path.join(_REPO, 'third_party', 'xla_gpu_targets')
# JAX preallocates this fraction of a GPU's memory for XLA by default and
# reads XLA_PYTHON_CLIENT_MEM_FRACTION to change it (jax docs,
# "GPU memory allocation"); a run gets no more than that.
GPU_MEMORY_FRACTION_ENV = 'XLA_PYTHON_CLIENT_MEM_FRACTION'
GPU_DEFAULT_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip's figures.

  Attributes:
    name: the family name in target strings ('v5e', 'h100', ...).
    device_kind: what `jax.Device.device_kind` reports for it.
    platform: 'tpu' or 'cuda'.
    hbm_bytes: memory a program may use per chip (see module docstring).
    peak_flops: peak dense bf16 FLOP/s per chip.
    hbm_bandwidth: HBM bytes/s per chip.
    source: where `peak_flops` and `hbm_bandwidth` come from.
  """
  name: str
  device_kind: str
  platform: str
  hbm_bytes: float
  peak_flops: float
  hbm_bandwidth: float
  source: str


_TPU_DOCS = 'Cloud TPU docs, https://cloud.google.com/tpu/docs/{}'
# Usable HBM: the limit the TPU compiler (libtpu 0.0.42) reports when a
# program exceeds it ("exceeds available HBM (15.75G)"), measured here.
TPU_CHIPS = (
    Chip('v4', 'TPU v4', 'tpu', 30.75 * GiB, 275e12, 1200e9,
         _TPU_DOCS.format('v4')),
    Chip('v5e', 'TPU v5 lite', 'tpu', 15.75 * GiB, 197e12, 819e9,
         _TPU_DOCS.format('v5e')),
    Chip('v5p', 'TPU v5', 'tpu', 95.74 * GiB, 459e12, 2765e9,
         _TPU_DOCS.format('v5p')),
    Chip('v6e', 'TPU v6 lite', 'tpu', 31.25 * GiB, 918e12, 1640e9,
         _TPU_DOCS.format('v6e')),
)
# Megacore chips: the compiler treats both TensorCores of a chip as one
# device only in this configuration (the default would be one per core).
_MEGACORE = ('v4', 'v5p')

# GPU memory and bandwidth are read from the target config (the card's
# `device_memory_size` and `memory_bandwidth`); the peak is the datasheet's
# dense bf16 Tensor Core figure (half the "with sparsity" one).
_GPU_CONFIGS = {'h100': 'h100_sxm.txtpb', 'h200': 'h200.txtpb'}
_GPU_PEAK = {
    'h100': (989e12, 'NVIDIA H100 Tensor Core GPU datasheet (SXM, BF16 '
             'dense)'),
    'h200': (989e12, 'NVIDIA H200 Tensor Core GPU datasheet (SXM, BF16 '
             'dense)'),
}

FAMILIES = tuple(c.name for c in TPU_CHIPS) + tuple(_GPU_CONFIGS)
# Chips a target may have in all (topology x slices). The largest training
# job published ran on 50,944 v5e chips (199 slices of 256; Google Cloud,
# Nov 2023); 2**16 holds it. Compile-only devices cost host memory: 65,536
# of them bring the launcher to 0.70 GB resident (0.48 GB with 4), where
# 10**6 took 3.4 GB in 5 s.
MAX_CHIPS = 2**16
# Digits per dimension: a bound before int() (Python refuses strings of
# over 4,300 digits with a ValueError of its own).
_MAX_DIGITS = 6
# Examples for messages and docs: the targets of the compile report.
EXAMPLES = ('v5e:16x16', 'v5p:4x4x4', 'v6e:8x8', 'v4:2x2x2', 'h100:1x1x8',
            'h200:2x1x8')


class TargetError(ValueError):
  """An unknown or malformed target (the message lists valid ones)."""


class SlicesError(ValueError):
  """A `--num_slices` the target cannot have (the message says the limit)."""


@dataclasses.dataclass(frozen=True)
class Target:
  """A parsed target string: chip family and topology.

  Attributes:
    family: 'v4', 'v5e', 'v5p', 'v6e', 'h100' or 'h200'.
    topology: TPU chips per dimension ('16x16', '4x4x4'); GPU
      'nodes x 1 x gpus per node' as XLA spells it ('2x1x8').
  """
  family: str
  topology: str

  @property
  def platform(self) -> str:
    return 'cuda' if self.family in _GPU_CONFIGS else 'tpu'

  @property
  def num_chips(self) -> int:
    n = 1
    for d in self.topology.split('x'):
      n *= int(d)
    return n

  def __str__(self) -> str:
    return f'{self.family}:{self.topology}'


def valid_targets() -> str:
  return ('valid: ' + ', '.join(f'{f}:<topology>' for f in FAMILIES)
          + ' (e.g. ' + ', '.join(EXAMPLES) + ')')


def parse(text: str) -> Target:
  """'v5e:16x16' -> Target; TargetError naming the valid forms otherwise."""
  digits = rf'\d{{1,{_MAX_DIGITS}}}'
  match = re.fullmatch(rf'([a-z0-9]+):({digits}(?:x{digits}){{1,2}})',
                       str(text).strip())
  if not match or match.group(1) not in FAMILIES:
    raise TargetError(f'--target={text!r}: unknown target; {valid_targets()}')
  family, topology = match.groups()
  dims = topology.split('x')
  want = 3 if family in _GPU_CONFIGS or family in _MEGACORE else 2
  if len(dims) != want or any(int(d) < 1 for d in dims):
    raise TargetError(
        f'--target={text!r}: {family} topologies have {want} positive '
        f'dimensions ({"x".join("N" * want)}); {valid_targets()}')
  target = Target(family, topology)
  if target.num_chips > MAX_CHIPS:
    raise TargetError(f'--target={text!r}: {target.num_chips} chips; at most '
                      f'{MAX_CHIPS} (the largest training job published ran '
                      'on 50,944)')
  return target


def max_slices(target: Target) -> int:
  """The most slices of `target` (`MAX_CHIPS` in all; GPU targets: 1)."""
  if target.platform == 'cuda':
    return 1
  return MAX_CHIPS // target.num_chips


def check_slices(target: Target, num_slices: Any) -> None:
  """SlicesError unless `num_slices` is an integer in [1, max_slices]."""
  if (isinstance(num_slices, bool) or not isinstance(num_slices, int)
      or num_slices < 1):
    raise SlicesError(f'--num_slices={num_slices!r}: must be an integer >= 1')
  if target.platform == 'cuda' and num_slices != 1:
    raise SlicesError(f'--num_slices={num_slices}: GPU targets have no '
                      'slices; give the nodes in the topology (e.g. '
                      'h100:2x1x8)')
  limit = max_slices(target)
  if num_slices > limit:
    raise SlicesError(
        f'--num_slices={num_slices}: at most {limit} slices of {target} '
        f'({target.num_chips} chips each; {MAX_CHIPS} chips in all, above '
        'the largest training job published, 50,944 chips)')


def gpu_target_config(family: str) -> str:
  """The GpuTargetConfigProto text of a GPU family."""
  with open(os.path.join(GPU_TARGET_CONFIGS, _GPU_CONFIGS[family])) as f:
    return f.read()


def _proto_number(text: str, field: str) -> float:
  match = re.search(rf'\b{field}:\s*([0-9.e+]+)', text)
  if not match:
    raise ValueError(f'GPU target config: no {field}')
  return float(match.group(1))


def _proto_string(text: str, field: str) -> str:
  return re.search(rf'\b{field}:\s*"([^"]*)"', text).group(1)


def gpu_memory_fraction() -> float:
  value = os.environ.get(GPU_MEMORY_FRACTION_ENV)
  return GPU_DEFAULT_MEMORY_FRACTION if value is None else float(value)


def chip_for(target: Target) -> Chip:
  """The figures of the target's chip."""
  for chip in TPU_CHIPS:
    if chip.name == target.family:
      return chip
  text = gpu_target_config(target.family)
  peak, source = _GPU_PEAK[target.family]
  return Chip(target.family, _proto_string(text, 'device_description_str'),
              'cuda', _proto_number(text, 'device_memory_size')
              * gpu_memory_fraction(), peak,
              _proto_number(text, 'memory_bandwidth'),
              source + '; memory and bandwidth: XLA target config')


def chip_of_device(device: Any) -> Chip | None:
  """The chip a (compile-only) device is, by its `device_kind`."""
  kind = device.device_kind
  for chip in TPU_CHIPS:
    if chip.device_kind == kind:
      return chip
  for family in _GPU_CONFIGS:
    chip = chip_for(Target(family, '1x1x1'))
    if chip.device_kind == kind:
      return chip
  return None


def toolchain_dir() -> str:
  return os.environ.get(TOOLCHAIN_ENV) or os.path.join(sys.prefix,
                                                       'compile_toolchain')


def enable_toolchain() -> None:
  """Makes libtpu and the CUDA plugin importable for compile-only use.

  Call before `import jax` where possible (`launch.compile` does); after
  it, TPU targets still work and the CUDA plugin is registered on first
  use of a GPU target. Sets what libtpu needs to start without a TPU
  (no GCE metadata query, no worker hosts to find; several processes may
  load it).
  """
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  # Without it libtpu logs an error line looking for its workers.
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  path = toolchain_dir()
  if os.path.isdir(path) and path not in sys.path:
    sys.path.append(path)


class ToolchainMissing(RunError):
  """The compiler for a target is not installed (exit status 2, as for a
  flag the job cannot use: the command cannot run on this host as it is)."""
  exit_code = 2


def _missing(platform: str) -> ToolchainMissing:
  if platform == 'tpu':
    return ToolchainMissing(
        'TPU targets need libtpu: run `make compile-toolchain` (installs '
        f'into {toolchain_dir()}) or `pip install .[tpu]`')
  return ToolchainMissing(
      'GPU targets need jax-cuda12-plugin and jax-cuda12-pjrt: run `make '
      f'compile-toolchain` (installs into {toolchain_dir()}) or `pip '
      'install .[cuda12]`')


def check_toolchain(target: Target) -> None:
  """ToolchainMissing unless the target's compiler is importable; looked
  up, not imported, so a launcher says so before JAX starts."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  enable_toolchain()
  module = 'libtpu' if target.platform == 'tpu' else 'jax_plugins.xla_cuda12'
  try:
    found = importlib.util.find_spec(module) is not None
  except ImportError:  # No jax_plugins package at all.
    found = False
  if not found:
    raise _missing(target.platform)


def _register_cuda_plugin() -> None:
  """Registers the CUDA plugin with a JAX whose backends started before
  the plugin was importable (the test suite's), as JAX does for a plugin
  it finds at start-up: the plugin's own entry point (which declines to
  start a client without JAX_PLATFORMS naming cuda), then the callbacks
  JAX runs on each plugin's C API, among them the one that gives the GPU
  compiler `custom_partitioning`'s partitioner (without it a sharded
  program fails: "No registered implementation for custom call to
  CustomSPMDPartitioning for platform CUDA"). The callbacks are private
  API, used here only."""
  import importlib  # pylint: disable=g-import-not-at-top
  try:
    plugin = importlib.import_module('jax_plugins.xla_cuda12')
  except ImportError:
    raise _missing('cuda') from None
  plugin.initialize()
  # pylint: disable=g-import-not-at-top,protected-access
  from jax._src import xla_bridge
  factory = xla_bridge._backend_factories.get('cuda')
  if factory is not None and factory.c_api is not None:
    for callback in xla_bridge._plugin_callbacks:
      callback(c_api=factory.c_api)


def devices(target: Target, num_slices: int = 1) -> list[Any]:
  """Compile-only devices of `target` (`num_slices` slices of it, TPU).

  Raises:
    TargetError: a topology the compiler does not accept.
    SlicesError: `num_slices` out of [1, max_slices(target)].
    ToolchainMissing: its compiler is not installed.
  """
  check_slices(target, num_slices)
  enable_toolchain()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  if target.platform == 'cuda':
    kwargs = dict(platform='cuda', topology=target.topology,
                  target_config=gpu_target_config(target.family))
    try:
      topo = topologies.get_topology_desc(**kwargs)
    except NotImplementedError:
      _register_cuda_plugin()
      topo = topologies.get_topology_desc(**kwargs)
    return list(topo.devices)
  kwargs = {'chip_config_name': 'megacore'} if target.family in _MEGACORE else {}
  if num_slices > 1:
    kwargs['num_slices'] = num_slices
  if target.num_chips < 4:
    # Smaller than a host's default 2x2 chips (v5litepod-1, v6e-1, ...).
    dims = [int(d) for d in target.topology.split('x')]
    kwargs['chips_per_host_bounds'] = dims + [1] * (3 - len(dims))
  try:
    topo = topologies.get_topology_desc(
        topology_name=str(target), platform='tpu', **kwargs)
  except jax.errors.JaxRuntimeError as e:
    raise TargetError(f'--target={target}: the TPU compiler refuses this '
                      f'topology ({str(e).splitlines()[0]}); '
                      f'{valid_targets()}') from None
  except RuntimeError as e:
    if 'not installed' in str(e):
      raise _missing('tpu') from None
    raise
  return list(topo.devices)
