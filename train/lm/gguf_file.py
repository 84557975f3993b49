"""A GGUF file's metadata and tensors, read in one pass.

GGUF (llama.cpp's format, version 2 and 3): a header, typed key/value
metadata, tensor descriptions (name, dims innermost first, GGML type,
offset), then the aligned tensor data. llama.cpp's Python reader
(`gguf.GGUFReader`) maps every metadata element to its own numpy view,
which took 15-35 s for the 262,144-entry vocabulary of Gemma 3 on this
machine; this parser reads the same structure with `struct` in well under a
second, and leaves the decoding of quantized blocks to `gguf.quants`
(llama.cpp's). tests/test_gemma_gguf.py checks it against GGUFReader.

The file is untrusted input: anything that does not parse (wrong magic or
version, a length past the end, tensor data beyond the file) or declares
more than the bounds below allow raises `GGUFFormatError` naming the place
and the limit, before anything of the declared size is allocated. Counts
are bounded by the bytes they would occupy (an element takes at least
its encoded size), so what the reader holds grows with the file's size,
never with a number the file states; sizes are Python ints, which do not
wrap.
"""

import dataclasses
import math
import mmap
import struct
from typing import Any

import numpy as np

_MAGIC = b'GGUF'
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Metadata value types, in GGUF's numbering.
_SCALARS = {0: '<B', 1: '<b', 2: '<H', 3: '<h', 4: '<I', 5: '<i', 6: '<f',
            7: '<?', 10: '<Q', 11: '<q', 12: '<d'}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32,
          5: np.int32, 6: np.float32, 7: np.bool_, 10: np.uint64,
          11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct('<Q')
_STRUCTS = {}  # format -> struct.Struct, for `_Cursor.take`.
_INTEGERS = (0, 1, 2, 3, 4, 5, 10, 11)

# Bounds on what a file may declare. llama.cpp writes arrays of numbers or
# strings (one level); deeper nesting only serves to exhaust the stack.
MAX_NESTING = 4
# Gemma 3's vocabulary is 262,144 pieces; the largest published ones are
# under a million.
MAX_ARRAY_LENGTH = 1 << 24
# An array of arrays holds a Python object (about 100 bytes) per 12-byte
# item: fewer of them keeps memory near the file's size.
MAX_ARRAYS_IN_ARRAY = 1 << 16
# Gemma 3 4B has 444 tensors and 40 metadata keys; llama.cpp's largest
# models (experts merged a layer) about 1,100 tensors.
MAX_TENSORS = 1 << 14
MAX_FIELDS = 1 << 14
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS.
MAX_TENSOR_NAME_BYTES = 63  # ggml's GGML_MAX_NAME, less its NUL.
# The fewest bytes one element occupies: a string's length, an array's
# item type and count, a field's key length, type and smallest value, a
# tensor's name length, dims count, type and offset.
_MIN_BYTES = {_STRING: 8, _ARRAY: 12}
_MIN_FIELD_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8


class GGUFFormatError(ValueError):
  """The bytes are not a (complete) GGUF file."""


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor's description; `data` is its bytes (a view of the map)."""
  name: str
  dims: tuple[int, ...]  # GGUF order: innermost (contiguous) first.
  ggml_type: int
  data: np.ndarray  # uint8

  @property
  def shape(self) -> tuple[int, ...]:
    """numpy order (outermost first)."""
    return tuple(reversed(self.dims))


@dataclasses.dataclass(frozen=True)
class GGUF:
  version: int
  fields: dict[str, Any]  # Arrays of numbers as numpy arrays.
  tensors: dict[str, Tensor]


class _Cursor:

  def __init__(self, buf, size: int):
    self.buf, self.size, self.at = buf, size, 0

  def take(self, fmt: str):
    unpack = _STRUCTS.get(fmt) or _STRUCTS.setdefault(fmt, struct.Struct(fmt))
    n = unpack.size
    if self.at + n > self.size:
      raise GGUFFormatError(f'ends at byte {self.size} inside the header '
                            f'(needs {self.at + n})')
    value = unpack.unpack_from(self.buf, self.at)[0]
    self.at += n
    return value

  def count(self, n: int, min_bytes: int, limit: int, what: str) -> int:
    """`n` elements of at least `min_bytes` each, if the rest of the file
    can hold them and `n` <= `limit`."""
    if n > limit:
      raise GGUFFormatError(f'{what}: {n} at byte {self.at}, more than the '
                            f'limit {limit}')
    if self.at + n * min_bytes > self.size:
      raise GGUFFormatError(f'{what}: {n} at byte {self.at} need at least '
                            f'{n * min_bytes} bytes, past the end '
                            f'({self.size})')
    return n

  def string(self) -> str:
    n = self.take('<Q')
    if self.at + n > self.size:
      raise GGUFFormatError(f'a string of {n} bytes at byte {self.at} runs '
                            f'past the end ({self.size})')
    raw = bytes(self.buf[self.at:self.at + n])
    self.at += n
    return raw.decode('utf-8', errors='replace')

  def strings(self, count: int) -> list[str]:
    """`count` strings; `string` inlined, for a vocabulary's 262,144."""
    buf, size, at, out = self.buf, self.size, self.at, []
    for _ in range(count):
      if at + 8 > size:
        raise GGUFFormatError(f'ends at byte {size} inside the header '
                              f'(needs {at + 8})')
      n = _U64.unpack_from(buf, at)[0]
      at += 8
      if at + n > size:
        raise GGUFFormatError(f'a string of {n} bytes at byte {at} runs '
                              f'past the end ({size})')
      out.append(str(buf[at:at + n], 'utf-8', 'replace'))
      at += n
    self.at = at
    return out

  def value(self, kind: int, depth: int = 0):
    if kind in _SCALARS:
      return self.take(_SCALARS[kind])
    if kind == _STRING:
      return self.string()
    if kind == _ARRAY:
      if depth >= MAX_NESTING:
        raise GGUFFormatError(f'arrays nested deeper than {MAX_NESTING} '
                              f'at byte {self.at}')
      item = self.take('<I')
      if item not in _NUMPY and item not in _MIN_BYTES:
        raise GGUFFormatError(f'unknown array item type {item} at byte '
                              f'{self.at - 4}')
      width = (np.dtype(_NUMPY[item]).itemsize if item in _NUMPY
               else _MIN_BYTES[item])
      count = self.count(self.take('<Q'), width,
                         MAX_ARRAYS_IN_ARRAY if item == _ARRAY
                         else MAX_ARRAY_LENGTH, 'array length')
      if item in _NUMPY:
        out = np.frombuffer(self.buf, _NUMPY[item], count, self.at).copy()
        self.at += count * width
        return out
      if item == _STRING:
        return self.strings(count)
      return [self.value(item, depth + 1) for _ in range(count)]
    raise GGUFFormatError(f'unknown metadata type {kind} at byte {self.at}')


def _alignment(fields: dict[str, Any], kinds: dict[str, int]) -> int:
  """`general.alignment`: a power of two stored as an integer."""
  key = 'general.alignment'
  if key not in fields:
    return _DEFAULT_ALIGNMENT
  value = fields[key]
  if kinds[key] not in _INTEGERS:
    raise GGUFFormatError(f'{key} is not an integer '
                          f'({short_repr(value)}, GGUF type {kinds[key]})')
  if value <= 0 or value & (value - 1):
    raise GGUFFormatError(f'{key}={value} is not a power of two')
  return value


def short_repr(value: Any) -> str:
  """`value` for a one-line message: a file's strings and arrays may be
  long and hold newlines."""
  text = ' '.join(repr(value).split())
  return text if len(text) <= 60 else text[:57] + '...'



def read(path: str) -> GGUF:
  """The metadata and tensor descriptions of the GGUF file at `path`
  (tensor data memory-mapped, read only)."""
  from gguf import constants  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    size = f.seek(0, 2)
    if size == 0:
      raise GGUFFormatError('the file is empty')
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  c = _Cursor(buf, size)
  if size < 4 or bytes(buf[:4]) != _MAGIC:
    raise GGUFFormatError(f'no GGUF magic (starts {bytes(buf[:4])!r})')
  c.at = 4
  version = c.take('<I')
  if version not in _VERSIONS:
    raise GGUFFormatError(f'version {version}; readable: {_VERSIONS}')
  n_tensors = c.take('<Q')
  n_fields = c.count(c.take('<Q'), _MIN_FIELD_BYTES, MAX_FIELDS,
                     'metadata count')
  fields, kinds = {}, {}
  for _ in range(n_fields):
    key = c.string()
    if key in fields:
      raise GGUFFormatError(f'metadata {short_repr(key)} appears twice')
    kinds[key] = c.take('<I')
    fields[key] = c.value(kinds[key])
  n_tensors = c.count(n_tensors, _MIN_TENSOR_BYTES, MAX_TENSORS,
                      'tensor count')
  infos = []
  for _ in range(n_tensors):
    name = c.string()
    if len(name.encode()) > MAX_TENSOR_NAME_BYTES:
      raise GGUFFormatError(f'tensor name {short_repr(name)} is longer than '
                            f'{MAX_TENSOR_NAME_BYTES} bytes')
    n_dims = c.take('<I')
    if n_dims > MAX_DIMS:
      raise GGUFFormatError(f'tensor {short_repr(name)}: {n_dims} dims, more '
                            f'than {MAX_DIMS}')
    dims = tuple(c.take('<Q') for _ in range(n_dims))
    infos.append((name, dims, c.take('<I'), c.take('<Q')))
  alignment = _alignment(fields, kinds)
  start = -(-c.at // alignment) * alignment
  data = np.frombuffer(buf, np.uint8)
  tensors = {}
  for name, dims, kind, offset in infos:
    shown = short_repr(name)
    if name in tensors:
      raise GGUFFormatError(f'tensor {shown} appears twice')
    if offset % alignment:
      raise GGUFFormatError(f'tensor {shown}: offset {offset} is not '
                            f'a multiple of the alignment {alignment}')
    try:
      block, width = constants.GGML_QUANT_SIZES[constants.GGMLQuantizationType(
          kind)]
    except (KeyError, ValueError):
      raise GGUFFormatError(f'tensor {shown}: unknown GGML type '
                            f'{kind}') from None
    count = math.prod(dims)  # A Python int: numpy's int64 would wrap.
    if dims and dims[0] % block:
      raise GGUFFormatError(f'tensor {shown}: {dims[0]} values a row '
                            f'is not a whole number of {block}-value blocks')
    n_bytes = count // block * width
    begin = start + offset
    if begin + n_bytes > size:
      raise GGUFFormatError(
          f'truncated: tensor {shown} needs bytes '
          f'{begin}..{begin + n_bytes}, the file has {size}')
    tensors[name] = Tensor(name, dims, kind, data[begin:begin + n_bytes])
  return GGUF(version, fields, tensors)


def dequantize(tensor: Tensor) -> np.ndarray:
  """float32 values in numpy order (llama.cpp's decoding, `gguf.quants`)."""
  from gguf import constants, quants  # pylint: disable=g-import-not-at-top
  kind = constants.GGMLQuantizationType(tensor.ggml_type)
  block, width = constants.GGML_QUANT_SIZES[kind]
  row_bytes = tensor.dims[0] // block * width if tensor.dims else width
  rows = tensor.data.reshape(-1, row_bytes)
  if kind == constants.GGMLQuantizationType.F32:
    values = rows.view(np.float32)
  elif kind == constants.GGMLQuantizationType.F16:
    values = rows.view(np.float16).astype(np.float32)
  else:
    values = quants.dequantize(rows, kind)
  return np.asarray(values, np.float32).reshape(tensor.shape)
