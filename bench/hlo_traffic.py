"""HBM traffic of a compiled XLA program, counted from its optimized HLO.

`cost_analysis()['bytes accessed']` exists on TPU only (GPU compilers
return None), so this counts traffic the same way for every backend from
`compiled.as_text()`: for each top-level instruction of the entry
computation that touches memory (fusions, custom calls such as Pallas
kernels, copies, collectives, unfused elementwise ops, ...), the bytes of
its distinct operands read plus the bytes of its result written, counting
only buffers in device memory (HBM; on TPU, layouts marked S(n) with n > 0
live in on-chip memory such as VMEM and SMEM and are not counted).

Conventions:
- Free (no traffic): parameter, constant, get-tuple-element, tuple,
  bitcast, the `-done` half of async pairs (the `-start` half counts the
  transfer), partition-id, replica-id, after-all, opt-barrier.
- `copy-start` writes the first element of its result tuple (the
  destination); other `-start` ops write the elements after their operands'
  aliases (XLA's (operands, outputs, context) tuples).
- Sizes are physical: a TPU tiled layout `T(8,128)` pads the minor
  dimensions to whole tiles (an f32[10] with T(128) is 512 bytes).
- Instructions that call other computations (while, conditional, call)
  count their operands and result once; their bodies are not entered.
  The programs measured here (the SAM perturbation) have none.

This is an estimate from the compiler's plan, not a measurement: it does
not see caches, or a fusion that reads an operand twice.
"""

import dataclasses
import math
import re

# Bytes per element; sub-byte types round up to a byte per element.
DTYPE_BYTES = {
    'pred': 1, 's4': 1, 'u4': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1,
    'f8e5m2': 1, 'f8e4m3b11fnuz': 1, 'f8e4m3fnuz': 1, 'f8e5m2fnuz': 1,
    's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4,
    's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16, 'token': 0,
}
FREE = frozenset({
    'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast',
    'partition-id', 'replica-id', 'after-all', 'opt-barrier',
})

_ARRAY = re.compile(r'([a-z0-9]+)\[([0-9,]*)\](\{[^}]*\})?')
_LINE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One entry-computation instruction and its traffic."""
  name: str
  opcode: str
  read: int
  written: int
  target: str | None = None  # A custom call's target.

  @property
  def bytes(self) -> int:
    return self.read + self.written


def _array_bytes(dtype: str, dims: str, layout: str | None) -> tuple[int, bool]:
  """(physical bytes, lives in device memory) of one array shape."""
  shape = [int(d) for d in dims.split(',') if d]
  in_hbm = True
  if layout:
    space = re.search(r'S\((\d+)\)', layout)
    in_hbm = space is None or space.group(1) == '0'
    tile = re.search(r'T\(([0-9,]+)\)', layout)
    order = re.match(r'\{([0-9,]*)', layout).group(1)
    if tile and shape:
      minor_to_major = [int(d) for d in order.split(',') if d]
      physical = [shape[d] for d in reversed(minor_to_major)]
      tiles = [int(t) for t in tile.group(1).split(',')]
      for i, t in enumerate(reversed(tiles)):
        if i < len(physical):
          physical[-1 - i] = -(-physical[-1 - i] // t) * t
      shape = physical
  return math.prod(shape) * DTYPE_BYTES.get(dtype, 4), in_hbm


def _split_shape(text: str) -> tuple[str, str]:
  """('shape', rest) from 'shape opcode(...)...'; tuple shapes nest parens."""
  if not text.startswith('('):
    cut = text.index(' ')
    return text[:cut], text[cut + 1:]
  depth = 0
  for i, ch in enumerate(text):
    depth += {'(': 1, ')': -1}.get(ch, 0)
    if depth == 0:
      return text[:i + 1], text[i + 1:].lstrip()
  raise ValueError(f'unbalanced shape: {text[:80]}')


def _elements(shape: str) -> list[tuple[int, bool]]:
  """(bytes, in device memory) per array of a shape (tuples flattened)."""
  return [_array_bytes(*m.groups()) for m in _ARRAY.finditer(shape)]


def _operands(rest: str) -> list[str]:
  """Operand names of 'opcode(%a, %b), attrs'."""
  start = rest.index('(')
  depth = 0
  for i in range(start, len(rest)):
    depth += {'(': 1, ')': -1}.get(rest[i], 0)
    if depth == 0:
      return re.findall(r'%([\w.\-]+)', rest[start:i + 1])
  raise ValueError(f'unbalanced operands: {rest[:80]}')


def entry_lines(hlo_text: str) -> list[str]:
  """The instruction lines of the ENTRY computation."""
  lines = hlo_text.splitlines()
  start = next(i for i, line in enumerate(lines)
               if line.startswith('ENTRY'))
  out = []
  for line in lines[start + 1:]:
    if line.startswith('}'):
      break
    if line.strip():
      out.append(line)
  return out


def instructions(hlo_text: str) -> list[Instruction]:
  """Every entry instruction with its HBM bytes read and written."""
  shapes = {}
  out = []
  for line in entry_lines(hlo_text):
    match = _LINE.match(line)
    if not match:
      continue
    name, text = match.groups()
    shape, rest = _split_shape(text)
    opcode = re.match(r'([\w\-]+)', rest).group(1)
    elements = _elements(shape)
    shapes[name] = elements
    if opcode in FREE or opcode.endswith('-done'):
      out.append(Instruction(name, opcode, 0, 0))
      continue
    operands = list(dict.fromkeys(_operands(rest)))
    read = sum(b for op in operands for b, hbm in shapes.get(op, []) if hbm)
    if opcode == 'copy-start':
      written_elements = elements[:1]
    elif opcode.endswith('-start') and len(elements) > 1:
      written_elements = elements[len(operands):]
      # The context (u32/s32 scalars) is no data.
      written_elements = [e for e in written_elements if e[0] > 4] or (
          elements[-1:])
    else:
      written_elements = elements
    written = sum(b for b, hbm in written_elements if hbm)
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    out.append(Instruction(name, opcode, read, written,
                           target.group(1) if target else None))
  return out


def traffic(hlo_text: str) -> int:
  """Total HBM bytes read and written by the entry computation."""
  return sum(i.bytes for i in instructions(hlo_text))


def collectives(hlo_text: str, kind: str) -> list[int]:
  """Result bytes of each instruction of `kind` ('all-gather', 'all-reduce',
  ...; its async '-start' form included) in any computation of the
  program (the largest array of a tuple result)."""
  out = []
  for line in hlo_text.splitlines():
    match = _LINE.match(line)
    if not match:
      continue
    shape, rest = _split_shape(match.group(2))
    opcode = re.match(r'([\w\-]+)', rest).group(1)
    if opcode in (kind, f'{kind}-start'):
      elements = _elements(shape)
      if opcode.endswith('-start') and len(elements) > 1:
        elements = elements[len(_operands(rest)):] or elements
      out.append(max(b for b, _ in elements))
  return out
