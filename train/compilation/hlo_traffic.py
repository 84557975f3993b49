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
- A slice reads only what it keeps: a slice, dynamic-slice or gather
  (and their async `-start` forms) reads its result's bytes of operand 0,
  and so does a fusion for each operand that its fused computation only
  slices (as XLA unpacks a packed buffer into leaves).
- Instructions that call other computations (while, conditional, call)
  count their operands and result once; their bodies are not entered
  (a program with loops is undercounted).

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
SLICING = frozenset({'slice', 'dynamic-slice', 'gather', 'slice-start',
                     'dynamic-slice-start'})

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


def _computations(hlo_text: str) -> dict[str, list[str]]:
  """Instruction lines of every computation, by name ('ENTRY' too)."""
  out, name = {}, None
  for line in hlo_text.splitlines():
    head = re.match(r'^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$', line)
    if head and not line.startswith(' '):
      name = 'ENTRY' if head.group(1) else head.group(2)
      out[name] = []
    elif line.startswith('}'):
      name = None
    elif name is not None and line.strip():
      out[name].append(line)
  return out


def entry_lines(hlo_text: str) -> list[str]:
  """The instruction lines of the ENTRY computation."""
  return _computations(hlo_text)['ENTRY']


def _parse(line: str):
  """(name, result shape, opcode, rest) of an instruction line, or None."""
  match = _LINE.match(line)
  if not match:
    return None
  name, text = match.groups()
  shape, rest = _split_shape(text)
  return name, shape, re.match(r'([\w\-]+)', rest).group(1), rest


def _sliced_parameters(lines: list[str]) -> dict[int, int]:
  """{parameter index: bytes its users keep} for each parameter of a fused
  computation that is only sliced."""
  parsed = [p for p in map(_parse, lines) if p]
  index = {name: int(re.search(r'parameter\((\d+)\)', rest).group(1))
           for name, _, opcode, rest in parsed if opcode == 'parameter'}
  kept, other = {}, set()
  for _, shape, opcode, rest in parsed:
    if opcode == 'parameter':
      continue
    for position, operand in enumerate(_operands(rest)):
      if operand not in index:
        continue
      if opcode in SLICING and position == 0:
        kept[index[operand]] = kept.get(index[operand], 0) + sum(
            b for b, _ in _elements(shape))
      else:
        other.add(index[operand])
  return {i: b for i, b in kept.items() if i not in other}


def instructions(hlo_text: str) -> list[Instruction]:
  """Every entry instruction with its HBM bytes read and written."""
  computations = _computations(hlo_text)
  shapes = {}
  out = []
  for line in computations['ENTRY']:
    parsed = _parse(line)
    if not parsed:
      continue
    name, shape, opcode, rest = parsed
    elements = _elements(shape)
    shapes[name] = elements
    if opcode in FREE or opcode.endswith('-done'):
      out.append(Instruction(name, opcode, 0, 0))
      continue
    operands = _operands(rest)
    if opcode.endswith('-start') and len(elements) > 1:
      # (operands..., outputs..., context): the outputs follow.
      outputs = [e for e in elements[len(operands):] if e[0] > 4] or (
          elements[-1:])
      if opcode == 'copy-start':  # (destination, source, context).
        outputs = elements[:1]
    else:
      outputs = elements
    # What each operand position reads: all of it, or what a slice keeps.
    partial = {}
    if opcode in SLICING:
      partial[0] = sum(b for b, _ in outputs)
    called = re.search(r'calls=%?([\w.\-]+)', rest)
    if opcode == 'fusion' and called and called.group(1) in computations:
      partial = _sliced_parameters(computations[called.group(1)])
    read, seen = 0, set()
    for position, operand in enumerate(operands):
      if operand in seen:
        continue
      seen.add(operand)
      hbm = sum(b for b, in_hbm in shapes.get(operand, []) if in_hbm)
      read += min(hbm, partial.get(position, hbm))
    written = sum(b for b, hbm in outputs if hbm)
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
  for lines in _computations(hlo_text).values():
    for line in lines:
      parsed = _parse(line)
      if not parsed:
        continue
      _, shape, opcode, rest = parsed
      if opcode in (kind, f'{kind}-start'):
        elements = _elements(shape)
        if opcode.endswith('-start') and len(elements) > 1:
          elements = elements[len(_operands(rest)):] or elements
        out.append(max(b for b, _ in elements))
  return out
