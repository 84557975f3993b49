"""Steering vectors on disk, with what they belong to.

A vector file (`.npz`) holds the direction and JSON metadata: the layer
index and module path it was extracted at, the hidden size, the
fingerprint of the model's parameters, and free-form extraction details
(method, prompts, coefficient). Loading checks the vector against the
model it is meant for: a different hidden size, layer count or
fingerprint fails with an error naming the field, instead of steering a
model with another model's direction. Files are written atomically
(temporary file, then rename), so a crash never leaves half a vector.
"""

import dataclasses
import hashlib
import json
import os
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from geom import steering as steering_lib
from train.steering import hooks as steering_hooks

FORMAT_VERSION = 1


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
  """
  direction: np.ndarray
  layer: int
  layer_path: str
  model_fingerprint: str
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def hidden_size(self) -> int:
    return int(self.direction.shape[-1])


def save(path: str, vector: SteeringVector) -> None:
  """Writes `vector` to `path` (.npz) atomically."""
  steering_lib.check_direction(vector.direction)
  meta = dict(format=FORMAT_VERSION, layer=vector.layer,
              layer_path=vector.layer_path, hidden_size=vector.hidden_size,
              model_fingerprint=vector.model_fingerprint, info=vector.info)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  tmp = os.path.join(directory, f'.{os.path.basename(path)}.tmp.{os.getpid()}')
  with open(tmp, 'wb') as f:
    np.savez(f, direction=np.asarray(vector.direction, np.float32),
             meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def load(path: str, params: Any | None = None) -> SteeringVector:
  """Reads a vector; with `params`, checks that it belongs to that model.

  Raises:
    FileNotFoundError: no file at `path`.
    ValueError: the file is not a steering vector, or (with `params`) its
      hidden size, layer or model fingerprint does not match the model's;
      the message names the field.
  """
  with np.load(path) as f:
    if 'direction' not in f or 'meta' not in f:
      raise ValueError(f'{path}: not a steering vector file (needs '
                       f'direction and meta, has {sorted(f.files)})')
    direction = f['direction']
    meta = json.loads(f['meta'].tobytes().decode())
  vector = SteeringVector(direction, int(meta['layer']), meta['layer_path'],
                          meta['model_fingerprint'], meta.get('info', {}))
  if params is not None:
    check_matches(vector, params, path)
  return vector


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
