"""Steering vectors on disk, with what they belong to.

A vector file (`.npz`) holds the direction and JSON metadata: the layer
index and module path it was extracted at, the hidden size, the
fingerprint of the model's parameters, the fingerprint of the tokenizer
its texts were encoded with (absent in files from before tokenizers: the
byte-level LM's), and free-form extraction details (method, prompts,
coefficient). Loading checks the vector against the
model it is meant for: a different hidden size, layer count or
fingerprint fails with an error naming the field, instead of steering a
model with another model's direction. Files are written atomically
(temporary file, then rename), so a crash never leaves half a vector.

Loading also checks the file itself: a damaged file (empty, truncated,
garbage, a missing array or metadata field) and a direction that is not a
finite unit vector of the stated hidden size fail with one ValueError line
naming the file and the problem. Directions are unit vectors: every writer
normalises them and `save` refuses one that is not, so a norm off by more
than `UNIT_TOLERANCE` means the file was scaled or damaged after writing.
"""

import dataclasses
import hashlib
import io
import json
import os
import zipfile
import zlib
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from train import fileio
from train.lm import hooks as steering_hooks

FORMAT_VERSION = 1
# |norm - 1| allowed for a saved direction: float32 normalisation is off by
# about 1e-7; anything past this was scaled or damaged after normalising.
UNIT_TOLERANCE = 1e-3
# An .npz file is a zip archive: it starts with a local file header.
_NPZ_MAGIC = b'PK\x03\x04'
# What numpy raises for a damaged .npz: truncated or a bad CRC (BadZipFile),
# a bad array header (ValueError), a short read (EOFError, OSError), a
# member listed but unreadable (KeyError), a damaged deflate stream
# (zlib.error).
_DAMAGED = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile,
            zlib.error)
# Elements an array of the file may hold, checked from its header before it
# is read: a 1 MB file of deflated zeros can state a direction of 1 GiB.
# Hidden sizes are far below 2**20.
MAX_ELEMENTS = {'direction': 1 << 20, 'meta': 1 << 20}


def _check_sizes(path: str) -> None:
  """ValueError unless each array's header states at most MAX_ELEMENTS
  (read from the headers alone, before any array is)."""
  try:
    archive = zipfile.ZipFile(path)
  except _DAMAGED as e:
    raise ValueError(f'{path}: damaged steering vector file (a truncated or '
                     f'corrupt .npz archive: {_first_line(e)})') from None
  with archive:
    for name, limit in MAX_ELEMENTS.items():
      if f'{name}.npy' not in archive.namelist():
        continue  # Reported as missing by the caller.
      try:
        with archive.open(f'{name}.npy') as member:
          version = np.lib.format.read_magic(member)
          read_header = (np.lib.format.read_array_header_1_0
                         if version == (1, 0) else
                         np.lib.format.read_array_header_2_0)
          shape, _, _ = read_header(member)
      except _DAMAGED as e:
        raise ValueError(f'{path}: damaged steering vector file (an array '
                         f'does not read back: {_first_line(e)})') from None
      if int(np.prod(shape, dtype=np.int64)) > limit:
        raise ValueError(f'{path}: not a steering vector file: {name} has '
                         f'shape {shape}, more than {limit} elements')


def fingerprint(params: Any) -> str:
  """A short hash of the parameters' paths, shapes, dtypes and values."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params)):
    arr = np.asarray(jax.device_get(leaf))
    h.update(f'{jax.tree_util.keystr(path)}:{arr.shape}:{arr.dtype};'.encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class SteeringVector:
  """A direction and its provenance.

  Attributes:
    direction: (hidden_size,) float32 unit vector.
    layer: layer index (see `steering_hooks.layer_paths`).
    layer_path: the module path of that layer.
    model_fingerprint: `fingerprint(params)` of the model it came from.
    info: extraction details (JSON-serialisable).
    tokenizer_fingerprint: the tokenizer's (`train.lm.tokenizer`); '' when
      unknown (a file from before tokenizers were recorded).
  """
  direction: np.ndarray
  layer: int
  layer_path: str
  model_fingerprint: str
  info: dict[str, Any] = dataclasses.field(default_factory=dict)
  tokenizer_fingerprint: str = ''

  @property
  def hidden_size(self) -> int:
    return int(self.direction.shape[-1])


def save(path: str, vector: SteeringVector) -> None:
  """Writes `vector` to `path` (.npz) atomically."""
  _check_direction(vector.direction, vector.hidden_size, path)
  meta = dict(format=FORMAT_VERSION, layer=vector.layer,
              layer_path=vector.layer_path, hidden_size=vector.hidden_size,
              model_fingerprint=vector.model_fingerprint, info=vector.info)
  if vector.tokenizer_fingerprint:
    meta['tokenizer_fingerprint'] = vector.tokenizer_fingerprint
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  buffer = io.BytesIO()
  np.savez(buffer, direction=np.asarray(vector.direction, np.float32),
           meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
  fileio.write_bytes_atomic(path, buffer.getvalue())


def load(path: str, params: Any | None = None) -> SteeringVector:
  """Reads a vector; with `params`, checks that it belongs to that model.

  Args:
    path: the .npz file written by `save`.
    params: the model's parameters; when given, the vector's layer, hidden
      size and model fingerprint must match them.

  Returns:
    The vector, its direction a float32 unit vector of the hidden size the
    file states (and, with `params`, the model's).

  Raises:
    FileNotFoundError: no file at `path` (and OSError where it cannot be
      opened, e.g. a directory or no permission).
    ValueError: one line naming `path` and the problem: the file is damaged
      or not a steering vector (empty, truncated, garbage, an array or a
      metadata field missing), its direction is not a finite unit vector of
      its hidden size, or (with `params`) its hidden size, layer or model
      fingerprint does not match the model's.
  """
  direction, meta = _read(path)
  direction = _check_direction(direction, meta['hidden_size'], path)
  vector = SteeringVector(direction, meta['layer'], meta['layer_path'],
                          meta['model_fingerprint'], meta['info'],
                          meta.get('tokenizer_fingerprint', ''))
  if params is not None:
    check_matches(vector, params, path)
  return vector


def _read(path: str) -> tuple[np.ndarray, dict[str, Any]]:
  """The raw direction and the checked metadata of the file at `path`."""
  with open(path, 'rb') as f:
    head = f.read(len(_NPZ_MAGIC))
  # Named here because numpy's own errors for these read as advice to
  # unpickle (garbage) or as an unrelated EOFError (empty file).
  if not head:
    raise ValueError(f'{path}: empty file (0 bytes), not a steering vector')
  if head != _NPZ_MAGIC:
    raise ValueError(f'{path}: not a steering vector file (not an .npz '
                     f'archive; it starts with {head!r})')
  _check_sizes(path)
  try:
    archive = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise
  except _DAMAGED as e:
    raise ValueError(f'{path}: damaged steering vector file (a truncated or '
                     f'corrupt .npz archive: {_first_line(e)})') from None
  with archive as f:
    missing = [k for k in ('direction', 'meta') if k not in f.files]
    if missing:
      raise ValueError(f'{path}: not a steering vector file: missing '
                       f'{", ".join(missing)} (it has {sorted(f.files)})')
    try:
      direction, raw_meta = f['direction'], f['meta']
    except _DAMAGED as e:
      raise ValueError(f'{path}: damaged steering vector file (an array does '
                       f'not read back: {_first_line(e)})') from None
  try:
    meta = json.loads(raw_meta.tobytes().decode())
  except (ValueError, TypeError) as e:
    raise ValueError(f'{path}: damaged steering vector file (meta is not '
                     f'JSON: {_first_line(e)})') from None
  return direction, _check_meta(meta, path)


def _check_meta(meta: Any, path: str) -> dict[str, Any]:
  """`meta` with its fields checked; ValueError naming the field otherwise."""
  if not isinstance(meta, dict):
    raise ValueError(f'{path}: meta: a JSON object expected, got '
                     f'{type(meta).__name__}')
  kinds = dict(format=int, layer=int, layer_path=str, hidden_size=int,
               model_fingerprint=str)
  for field, kind in kinds.items():
    if field not in meta:
      raise ValueError(f'{path}: meta: missing {field} (a damaged file or '
                       'not one written by train.steering.vectors.save)')
    if not isinstance(meta[field], kind) or isinstance(meta[field], bool):
      raise ValueError(f'{path}: meta.{field}={meta[field]!r}: must be '
                       f'{"an integer" if kind is int else "a string"}')
  if meta['format'] != FORMAT_VERSION:
    raise ValueError(f'{path}: meta.format={meta["format"]}: this version '
                     f'reads format {FORMAT_VERSION}')
  if meta['hidden_size'] <= 0:
    raise ValueError(f'{path}: meta.hidden_size={meta["hidden_size"]}: must '
                     'be positive')
  if meta['layer'] < 0:
    raise ValueError(f'{path}: meta.layer={meta["layer"]}: must be >= 0')
  if not isinstance(meta.get('tokenizer_fingerprint', ''), str):
    raise ValueError(f'{path}: meta.tokenizer_fingerprint='
                     f'{meta["tokenizer_fingerprint"]!r}: must be a string')
  info = meta.get('info', {})
  if not isinstance(info, dict):
    raise ValueError(f'{path}: meta.info: a JSON object expected, got '
                     f'{type(info).__name__}')
  return dict(meta, info=info)


def _check_direction(direction: Any, hidden_size: int,
                     where: str) -> np.ndarray:
  """The direction as float32 after checking it is a finite unit vector of
  `hidden_size` entries; ValueError naming `where` and the problem otherwise."""
  d = np.asarray(direction)
  problem = None
  if d.dtype.kind != 'f':
    problem = f'dtype {d.dtype}: must be floating point'
  elif d.shape != (hidden_size,):
    problem = (f'shape {d.shape}: must be ({hidden_size},), a vector of the '
               'hidden size')
  elif not np.all(np.isfinite(d)):
    problem = f'has {np.sum(~np.isfinite(d))} non-finite entries'
  else:
    norm = float(np.linalg.norm(d.astype(np.float64)))
    if norm == 0:
      problem = 'is zero; a steering direction needs a non-zero vector'
    elif abs(norm - 1) > UNIT_TOLERANCE:
      problem = (f'norm {norm:.6g}: must be a unit vector (|norm - 1| <= '
                 f'{UNIT_TOLERANCE}); normalise it, e.g. with '
                 'geom.steering.unit')
  if problem:
    raise ValueError(f'{where}: direction: {problem}')
  return d.astype(np.float32)


def _first_line(error: BaseException) -> str:
  """`Type: message` of an exception, cut to its first line."""
  text = str(error).strip().splitlines()
  return type(error).__name__ + (f': {text[0]}' if text else '')


def check_matches(vector: SteeringVector, params: Any,
                  where: str = 'steering vector') -> None:
  """ValueError naming the field where `vector` does not fit `params`."""
  paths = steering_hooks.layer_paths(params)
  if vector.layer_path not in paths:
    raise ValueError(f'{where}: layer_path={vector.layer_path!r} '
                     f'(layer {vector.layer}) is not a layer of this model '
                     f'(it has {len(paths)}: {paths})')
  hidden = _hidden_size(params)
  if hidden is not None and hidden != vector.hidden_size:
    raise ValueError(f'{where}: hidden_size={vector.hidden_size} does not '
                     f'match the model\'s {hidden}')
  fp = fingerprint(params)
  if fp != vector.model_fingerprint:
    raise ValueError(f'{where}: model_fingerprint='
                     f'{vector.model_fingerprint!r} does not match this '
                     f'model\'s {fp!r} (the vector was extracted from other '
                     'weights; extract it again for this model)')


def _hidden_size(params: Any) -> int | None:
  """The residual width: the size of the first RMSNorm/LayerNorm scale."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params)):
    if jax.tree_util.keystr(path).endswith("['scale']"):
      return int(np.shape(leaf)[-1])
  return None
