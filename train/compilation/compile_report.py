"""What a program compiled for a target chip needs: per-chip memory, cost, roofline.

`compile_programs(programs, target)` compiles each `train.training.aot.Program`
for the target's compile-only devices (`train.compilation.targets`) and returns one
`Row` per program:

- per-chip bytes from the compiler's memory analysis: arguments, outputs,
  temporaries, aliased (outputs written over donated arguments) and their
  total, argument + output - aliased + temporaries + generated code, the
  program's peak footprint as XLA accounts it; against the chip's usable
  HBM (`targets.Chip.hbm_bytes`);
- FLOPs and HBM bytes per chip: the TPU compiler's cost analysis; the GPU
  compiler gives none, so for GPU programs XLA's cost model
  (HloCostAnalysis, the one the TPU numbers come from) is run on the
  compiled GPU module through the CPU client (private API: a row whose
  cost cannot be read this way shows none), with the custom calls it
  cannot see added: the cuDNN convolutions' FLOPs, and every custom
  call's operand and result bytes (`train.compilation.hlo_traffic`); Pallas kernels
  count their bytes but no FLOPs;
- a roofline step time, max(FLOPs / peak, bytes / HBM bandwidth), from
  the chip's datasheet figures: a lower bound that ignores collectives,
  latency and overlap, for comparing steps (a method's step against its
  base step), never a measured time.

A program whose arguments alone (parameters, optimizer state, batch: the
bytes of one chip's shards of its abstract arguments) exceed the chip's
usable memory is a row that does not fit, and is neither traced nor
compiled: a d_model of 10**9 kept the TPU compiler busy for 9 minutes
before it said so. A program the TPU compiler refuses for memory
(RESOURCE_EXHAUSTED), or whose total exceeds the chip's usable memory
(GPU: the compiler does not check), is a row that does not fit; one that fails to compile otherwise
is a row with the compiler's message. `check(rows)` turns the first such
row into the launcher's one-line error: `DoesNotFit` (exit 3) or
`CompileFailed` (exit 1).
"""

from collections.abc import Callable, Sequence
import dataclasses
import math
import re
import time
from typing import Any

import jax

from train.training import aot
from train.compilation import hlo_traffic
from train.training import sharding as sharding_lib
from train.analysis import stats
from train.compilation import targets
from train.errors import RunError

MEMORY_FIELDS = ('argument', 'output', 'temp', 'alias', 'generated_code')


class CompileFailed(RunError):
  """A program does not compile for the target (exit status 1)."""
  exit_code = 1


class DoesNotFit(RunError):
  """A program needs more memory per chip than the target has (exit 3)."""
  exit_code = 3


@dataclasses.dataclass(frozen=True)
class Row:
  """One compiled program.

  Attributes:
    function: the program's name.
    bytes: per-chip bytes by `MEMORY_FIELDS` (empty when it did not
      compile).
    total_bytes: argument + output - alias + temp + generated code (for a
      program refused for memory: what the compiler said it needs, or at
      least its arguments).
    hbm_bytes: the chip's usable memory.
    flops, hbm_traffic: per chip, or None where the backend gives none.
    cost_source: where flops and hbm_traffic come from.
    roofline_seconds: max(flops / peak, hbm_traffic / bandwidth).
    compile_seconds: lowering and compiling, wall time here.
    error: the compiler's message, when it failed; `oom` says whether for
      memory.
    compiler_options: options the program needed to compile (see
      `GPU_RETRIES`), else empty.
    compiled: False for a program not compiled because its arguments
      alone exceed the chip (`total_bytes` is their size).
  """
  function: str
  bytes: dict[str, int]
  total_bytes: float
  hbm_bytes: float
  flops: float | None
  hbm_traffic: float | None
  cost_source: str
  roofline_seconds: float | None
  compile_seconds: float
  error: str | None = None
  oom: bool = False
  compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  compiled: bool = True

  @property
  def fits(self) -> bool:
    return self.error is None and self.total_bytes <= self.hbm_bytes

  def to_json(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out['fits'] = self.fits
    return out


def _memory(compiled: jax.stages.Compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  return {f: int(getattr(stats, f'{f}_size_in_bytes', 0) or 0)
          for f in MEMORY_FIELDS}


def total(memory: dict[str, int]) -> int:
  return (memory['argument'] + memory['output'] - memory['alias']
          + memory['temp'] + memory['generated_code'])


# One HLO instruction's name and the first array shape of its result:
# '%name = f32[16,8,8,32]{3,2,1,0} ...' or '%name = (f32[...]{...}, ...) ...'.
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?\s*'
                          r'[a-z0-9]+\[([\d,]*)\]')
# The first two operands (a fused bias-activation convolution has more).
_CUDNN_CONV = re.compile(
    r'custom-call\(%?([\w.\-]+),\s*%?([\w.\-]+)[,)].*dim_labels=(\w+)_'
    r'(\w+)->(\w+).*custom_call_target="__cudnn\$conv(Forward|'
    r'BiasActivationForward|BackwardInput|BackwardFilter)"')


def cudnn_conv_flops(hlo_text: str) -> float:
  """FLOPs of the cuDNN convolutions in a compiled GPU module.

  XLA's cost model counts a custom call as no FLOPs, and the GPU compiler
  turns every convolution into one (forward, and the input and filter
  gradients). Each does the forward convolution's multiply-adds,
  2 x |output| x |kernel| / output features, whichever of the three
  tensors it computes (`dim_labels` name the forward convolution's).
  """
  shapes = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match:
      dims = match.group(2)
      shapes[match.group(1)] = [int(d) for d in dims.split(',') if d]
  flops = 0.0
  for line in hlo_text.splitlines():
    match = _CUDNN_CONV.search(line)
    if not match:
      continue
    a, b, _, kernel_labels, _, kind = match.groups()
    result = shapes[_INSTRUCTION.match(line).group(1)]
    output, kernel = {'Forward': (result, shapes.get(b)),
                      'BiasActivationForward': (result, shapes.get(b)),
                      'BackwardInput': (shapes.get(a), shapes.get(b)),
                      'BackwardFilter': (shapes.get(b), result)}[kind]
    if output is None or kernel is None:
      continue
    features = kernel[kernel_labels.index('o')]
    flops += 2.0 * math.prod(output) * math.prod(kernel) / features
  return flops


def _gpu_cost(compiled: jax.stages.Compiled) -> dict[str, float] | None:
  """XLA's cost model on the compiled GPU module, through the CPU client,
  plus the cuDNN convolutions' FLOPs it does not count."""
  try:
    # pylint: disable=g-import-not-at-top
    from jax._src.lib import xla_client
    modules = compiled.runtime_executable().hlo_modules()
    cpu = jax.devices('cpu')[0].client
    costs = [xla_client._xla.hlo_module_cost_analysis(cpu, m)  # pylint: disable=protected-access
             for m in modules]
  except Exception:  # pylint: disable=broad-except
    return None
  text = compiled.as_text()
  # The cost model counts -1 FLOPs and -1 bytes for each custom call (an
  # unknown op: cuDNN convolutions, cuBLAS GEMMs, Pallas kernels). Their
  # FLOPs are added back where known (cuDNN), their HBM bytes for those
  # of the entry computation (`hlo_traffic`: operands read, result
  # written).
  calls = len(re.findall(r'\bcustom-call\(', text))
  call_bytes = sum(i.bytes for i in hlo_traffic.instructions(text)
                   if i.opcode == 'custom-call')
  return {'flops': sum(c.get('flops', 0.0) for c in costs) + calls
                   + cudnn_conv_flops(text),
          'bytes accessed': sum(c.get('bytes accessed', 0.0) for c in costs)
                            + calls + call_bytes}


def cost(compiled: jax.stages.Compiled, platform: str
         ) -> tuple[float | None, float | None, str]:
  """(FLOPs, HBM bytes, source) per chip of a compiled program."""
  if platform == 'tpu':
    analysis = compiled.cost_analysis()
    source = 'TPU compiler'
  else:
    analysis = _gpu_cost(compiled)
    source = 'XLA cost model on the compiled GPU module'
  if isinstance(analysis, (list, tuple)):  # Older jax: one per module.
    analysis = analysis[0] if analysis else None
  if not analysis:
    return None, None, 'none'
  return (analysis.get('flops'), analysis.get('bytes accessed'), source)


def roofline(flops: float | None, traffic: float | None,
             chip: targets.Chip) -> float | None:
  """max(FLOPs / peak, bytes / bandwidth), or None without a cost."""
  if flops is None or traffic is None:
    return None
  return max(flops / chip.peak_flops, traffic / chip.hbm_bandwidth)


# Out of HBM (the program does not fit), not of a kernel's on-chip memory
# (VMEM: the kernel does not compile).
_TPU_OOM = re.compile(r'RESOURCE_EXHAUSTED.*\b(HBM|hbm)\b')
# The TPU compiler's statements of what a program needs, e.g. "the total
# memory required for HLO temporaries (16.00G) exceeds available HBM
# (15.75G)" or "Used 40.23G of 15.75G hbm".
_NEEDS = (re.compile(r'\(([\d.]+)([KMGT])\) exceeds available HBM '
                     r'\(([\d.]+[KMGT])\)'),
          re.compile(r'Used ([\d.]+)([KMGT]) of ([\d.]+[KMGT]) hbm'))
_UNITS = {'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}


def _needed_bytes(message: str) -> float | None:
  for pattern in _NEEDS:
    match = pattern.search(message)
    if match:
      return float(match.group(1)) * _UNITS[match.group(2)]
  return None


# Compiling for a GPU without one, XLA cannot autotune, and its default
# Triton GEMM tiling fails on some small matrix products ("Couldn't find
# output tile sizes that satisfy hlo: %dot = f32[208,32] ...", seen with
# jax-cuda12-plugin 0.10.2 on the SFT policy's train step). On the GPU the
# autotuner chooses between Triton and cuBLAS; a failed compile is tried
# again with cuBLAS's GEMMs, and the row records it.
GPU_RETRIES = ((re.compile(r"Couldn't find output tile sizes"),
                {'xla_gpu_enable_triton_gemm': False}),)


def _compile(lowered: jax.stages.Lowered, platform: str
             ) -> tuple[jax.stages.Compiled, dict[str, Any]]:
  try:
    return lowered.compile(), {}
  except Exception as e:  # pylint: disable=broad-except
    if platform == 'cuda':
      for pattern, options in GPU_RETRIES:
        if pattern.search(str(e)):
          return lowered.compile(compiler_options=options), options
    raise


def compile_program(program: aot.Program, chip: targets.Chip,
                    step: Callable[[str], None] | None = None) -> Row:
  """Compiles `program` (its arguments are on the target's devices), unless
  its arguments alone exceed the chip's memory. `step(what)` is told of
  each stage as it begins: 'tracing <name>', 'compiling <name>'."""
  step = step or (lambda what: None)
  arguments = sharding_lib.device_bytes(program.args)
  if arguments > chip.hbm_bytes:
    return Row(program.name, {}, float(arguments), chip.hbm_bytes, None, None,
               'none', None, 0.0, 'not compiled: its arguments alone exceed '
               "the chip's usable memory", oom=True, compiled=False)
  start = time.perf_counter()
  try:
    step(f'tracing {program.name}')
    lowered = program.lower()
    step(f'compiling {program.name}')
    compiled, options = _compile(lowered, chip.platform)
  except Exception as e:  # pylint: disable=broad-except
    message = ' '.join(str(e).split())
    oom = bool(_TPU_OOM.search(message))
    needed = _needed_bytes(message) if oom else None
    return Row(program.name, {}, needed or float(arguments), chip.hbm_bytes,
               None, None, 'none', None, time.perf_counter() - start,
               message[:2000], oom)
  seconds = time.perf_counter() - start
  memory = _memory(compiled)
  flops, traffic, source = cost(compiled, chip.platform)
  return Row(program.name, memory, float(total(memory)), chip.hbm_bytes,
             flops, traffic, source, roofline(flops, traffic, chip),
             seconds, compiler_options=options)


def compile_programs(programs: Sequence[aot.Program], chip: targets.Chip,
                     step: Callable[[str], None] | None = None
                     ) -> list[Row]:
  """`compile_program` of each, in order."""
  return [compile_program(p, chip, step) for p in programs]


def gib(n: float) -> str:
  return f'{n / 2**30:.2f}'


def check(rows: Sequence[Row], chip: targets.Chip, target: str,
          lower: str = '') -> None:
  """Raises the one-line error of the first row that failed or does not fit;
  `lower` names the size fields to lower ('config.model.d_model=...').

  Raises:
    DoesNotFit: a program needs more than the chip's usable memory.
    CompileFailed: a program does not compile.
  """
  for row in rows:
    if row.error is not None and not row.oom:
      raise CompileFailed(f'{row.function} does not compile for {target}: '
                          f'{row.error[:600]}')
  for row in rows:
    if not row.fits:
      if not row.compiled:
        said = (' for its arguments alone (parameters, optimizer state, '
                'batch; not compiled)')
      elif row.error:
        said = f' (the TPU compiler: {_compiler_words(row.error)})'
      else:
        said = ''
      advice = f'; lower {lower}, or add chips' if lower else ''
      raise DoesNotFit(
          f'{row.function} does not fit on {target}: needs '
          f'{gib(row.total_bytes)} GiB per chip{said}; a {chip.device_kind}'
          f' has {gib(chip.hbm_bytes)} GiB usable{advice}')


def _compiler_words(message: str) -> str:
  """What the compiler said it needs and has, e.g. '191.02G of 15.75G'."""
  for pattern in _NEEDS:
    match = pattern.search(message)
    if match:
      return f'{match.group(1)}{match.group(2)} of {match.group(3)}'
  return message[:200]


def _ms(seconds: float | None) -> str:
  return '-' if seconds is None else f'{seconds * 1e3:.3g}'


def _number(value: float | None) -> str:
  return '-' if value is None else f'{value:.3g}'


def table(rows: Sequence[Row], chip: targets.Chip) -> str:
  """A markdown table, one row per program (GiB per chip)."""
  head = ['function', 'arguments', 'outputs', 'temporaries', 'aliased',
          'total', f'of {gib(chip.hbm_bytes)}', 'FLOPs', 'HBM bytes',
          'roofline ms', 'compile s']
  body = []
  for r in rows:
    b = r.bytes
    cells = ([gib(b[f]) for f in ('argument', 'output', 'temp', 'alias')]
             if b else ['-'] * 4)
    verdict = ('fits' if r.fits else 'DOES NOT FIT' if r.oom or not r.error
               else 'FAILED')
    name = r.function + (' [' + ', '.join(
        f'{k}={v}' for k, v in r.compiler_options.items()) + ']'
                         if r.compiler_options else '')
    body.append([
        name, *cells, gib(r.total_bytes),
        f'{verdict} {100 * r.total_bytes / r.hbm_bytes:.0f}%',
        _number(r.flops), _number(r.hbm_traffic), _ms(r.roofline_seconds),
        f'{r.compile_seconds:.1f}'])
  return stats.markdown_table(head, body, '-' * len(head))
