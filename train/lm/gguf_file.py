"""A GGUF file's metadata and tensors, read in one pass.

GGUF (llama.cpp's format, version 2 and 3): a header, typed key/value
metadata, tensor descriptions (name, dims innermost first, GGML type,
offset), then the aligned tensor data. llama.cpp's Python reader
(`gguf.GGUFReader`) maps every metadata element to its own numpy view,
which took 15-35 s for the 262,144-entry vocabulary of Gemma 3 on this
machine; this parser reads the same structure with `struct` in well under a
second, and leaves the decoding of quantized blocks to `gguf.quants`
(llama.cpp's). tests/test_gemma_gguf.py checks it against GGUFReader.

Anything that does not parse (wrong magic or version, a length past the
end, tensor data beyond the file) raises `GGUFFormatError` naming the
place.
"""

import dataclasses
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
    n = struct.calcsize(fmt)
    if self.at + n > self.size:
      raise GGUFFormatError(f'ends at byte {self.size} inside the header '
                            f'(needs {self.at + n})')
    value = struct.unpack_from(fmt, self.buf, self.at)[0]
    self.at += n
    return value

  def string(self) -> str:
    n = self.take('<Q')
    if self.at + n > self.size:
      raise GGUFFormatError(f'a string of {n} bytes at byte {self.at} runs '
                            f'past the end ({self.size})')
    raw = bytes(self.buf[self.at:self.at + n])
    self.at += n
    return raw.decode('utf-8', errors='replace')

  def value(self, kind: int):
    if kind in _SCALARS:
      return self.take(_SCALARS[kind])
    if kind == _STRING:
      return self.string()
    if kind == _ARRAY:
      item, count = self.take('<I'), self.take('<Q')
      if item in _NUMPY:
        width = np.dtype(_NUMPY[item]).itemsize
        if self.at + count * width > self.size:
          raise GGUFFormatError(f'an array of {count} values at byte '
                                f'{self.at} runs past the end')
        out = np.frombuffer(self.buf, _NUMPY[item], count, self.at).copy()
        self.at += count * width
        return out
      return [self.value(item) for _ in range(count)]
    raise GGUFFormatError(f'unknown metadata type {kind} at byte {self.at}')


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
  n_tensors, n_fields = c.take('<Q'), c.take('<Q')
  fields = {}
  for _ in range(n_fields):
    key = c.string()
    fields[key] = c.value(c.take('<I'))
  infos = []
  for _ in range(n_tensors):
    name = c.string()
    dims = tuple(c.take('<Q') for _ in range(c.take('<I')))
    infos.append((name, dims, c.take('<I'), c.take('<Q')))
  alignment = int(fields.get('general.alignment', _DEFAULT_ALIGNMENT))
  start = -(-c.at // alignment) * alignment
  data = np.frombuffer(buf, np.uint8)
  tensors = {}
  for name, dims, kind, offset in infos:
    try:
      block, width = constants.GGML_QUANT_SIZES[constants.GGMLQuantizationType(
          kind)]
    except (KeyError, ValueError):
      raise GGUFFormatError(f'tensor {name}: unknown GGML type {kind}'
                            ) from None
    count = int(np.prod(dims, dtype=np.int64))
    if dims and dims[0] % block:
      raise GGUFFormatError(f'tensor {name}: {dims[0]} values a row is not '
                            f'a whole number of {block}-value blocks')
    n_bytes = count // block * width
    begin = start + offset
    if begin + n_bytes > size:
      raise GGUFFormatError(
          f'truncated: tensor {name} needs bytes {begin}..{begin + n_bytes}, '
          f'the file has {size}')
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
