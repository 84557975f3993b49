"""Addition steering as llama.cpp control vectors (GGUF), the file repeng writes.

A control vector is a GGUF file that llama.cpp loads with
`--control-vector FILE` (or `--control-vector-scaled FILE S`) and adds to
the residual stream after chosen transformer blocks, at every token. The
format, as repeng's exporter writes it (vgel/repeng, repeng/extract.py,
`ControlVector.export_gguf`) and llama.cpp reads it:

- `general.architecture` = 'controlvector' (`gguf.GGUFWriter(path,
  'controlvector')`);
- `controlvector.model_hint`, a string: repeng writes the Hugging Face
  `model_type`; here the architecture of the GGUF model file the vector
  was made on ('gemma3', `GEMMA_MODEL_HINT`). llama.cpp reads neither key;
- `controlvector.layer_count`, uint32: the number of direction tensors in
  the file (repeng's `len(self.directions)`), not the model's depth;
- one tensor `direction.<N>` per steered layer: float32, one-dimensional,
  n_embd values. llama.cpp refuses any other type or rank, a name it
  cannot parse, and N = 0 (common/common.cpp,
  `common_control_vector_load_one`).

Layer numbers. `direction.N` is added to the output of llama.cpp's 0-based
block N, after the feed-forward residual add: the loader puts it at
offset n_embd * (N - 1) of a buffer that starts at layer 1
(`common_control_vector_load_one`: `dst = result.data.data() + n_embd *
(layer_idx - 1)`), `llama_adapter_cvec::apply` fills `tensors[il]` from
offset n_embd * (il - 1) for il = 1 .. n_layer - 1 (src/llama-adapter.cpp,
lines 124-131 at ggml-org/llama.cpp 0650ea8c), and the Gemma 3 graph calls
`build_cvec(cur, il)` on block il's output just before naming it `l_out`
(src/models/gemma3.cpp: `cur = ggml_add(ctx0, cur, sa_out); cur =
build_cvec(cur, il);`). The two -1s cancel: N = il. This repository's
`layer` is the index of `block_<i>`, whose output is the residual stream
that `train.lm.hooks.steered` edits (train/lm/gemma.py), the same boundary:
so N = the block index, unchanged (`llama_cpp_layer`). repeng numbers the
same way (it wraps `model.layers[i]` and adds to its output). Block 0
has no slot: `init` pushes a null tensor for layer 0 (llama-adapter.cpp
line 65) and the loader refuses `direction.0`, so it cannot be exported.
The defaults of `--control-vector-layer-range` (start 1, end n_layer:
`common_init_from_params`) skip no exportable block.

Strength. A file written here holds alpha * coefficient * mu, mu the unit
direction (`geom.steering.unit`), computed in float32 in the order
`geom.steering.Steering('addition', ...)` computes it: bit for bit the
increment geom's addition adds at (alpha, coefficient). llama.cpp applying
the file at strength 1 (`--control-vector FILE`) adds those values
(`ggml_add`) at every token, BOS and prompt included: the evaluation's
held-out setting, not its multiple-choice one, which steers from the last
context token on.
`--control-vector-scaled FILE S` multiplies the stored values by S (the
loader's `dst[j] += src[j] * load_info.strength`): addition at alpha * S.
Spherical rotation has no counterpart: llama.cpp's control vectors only add.

Files are written atomically: a temporary file in the target's directory,
then `os.replace`; a failure leaves no partial file and an existing file
as it was. `read_control_vector` reads one back with this repository's
GGUF reader (`train.lm.gguf_file`), not llama.cpp's, so a test of the
writer does not lean on the library that wrote it.

Example:

  from train.steering import gguf_export
  gguf_export.control_vector('/tmp/v.gguf', {6: direction},
                             model_hint='gemma3', hidden_size=640,
                             num_layers=18, alpha=0.1, coefficient=5200.0)
  # llama-cli -m gemma-3-270m.gguf --control-vector /tmp/v.gguf
"""

from collections.abc import Callable, Mapping
import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
from typing import Any

import gguf
import numpy as np

from geom import steering as steering_lib
from train import fileio
from train.errors import UsageError
from train.lm import gguf_file
from train.steering import vectors as steering_vectors

ARCHITECTURE = 'controlvector'
MODEL_HINT_KEY = f'{ARCHITECTURE}.model_hint'
LAYER_COUNT_KEY = f'{ARCHITECTURE}.layer_count'
TENSOR_PREFIX = 'direction.'
#: The model hint of vectors made on a Gemma 3 GGUF file: its
#: `general.architecture` (train.lm.gemma_gguf loads no other).
GEMMA_MODEL_HINT = 'gemma3'
_GGML_F32 = 0


def llama_cpp_layer(block: int) -> int:
  """llama.cpp's N of `direction.N` for this repository's block index.

  Both name the output of 0-based block `block` (the module docstring
  gives the llama.cpp lines), so N is the block index; block 0 has no
  llama.cpp slot (`control_vector` refuses it).

  Args:
    block: the index of `block_<i>` (a steering config's `layer`).

  Returns:
    N, the layer number of the tensor `direction.N`.
  """
  return block


@dataclasses.dataclass(frozen=True)
class ControlVector:
  """A control vector file's contents.

  Attributes:
    model_hint: `controlvector.model_hint`.
    layer_count: `controlvector.layer_count` as stored (the number of
      direction tensors, as repeng writes it).
    vectors: llama.cpp layer N -> the (n_embd,) float32 values of
      `direction.N`, by increasing N.
  """
  model_hint: str
  layer_count: int
  vectors: dict[int, np.ndarray]


def _check_int(name: str, value: Any, low: int) -> int:
  """`value` as an int >= `low`; UsageError naming `name` otherwise."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise UsageError(name, value, 'must be an integer')
  if value < low:
    raise UsageError(name, value, f'must be >= {low}')
  return int(value)


def _check_scale(name: str, value: Any, top: float | None) -> float:
  """A finite positive float (at most `top` when given)."""
  try:
    v = float(value)
  except (TypeError, ValueError):
    raise UsageError(name, value, 'must be a number') from None
  if not math.isfinite(v) or v <= 0 or (top is not None and v > top):
    raise UsageError(name, value, 'must be finite and > 0' + (
        f' and <= {top:g}' if top is not None else ''))
  return v


def _check_vector(block: int, value: Any, hidden_size: int) -> np.ndarray:
  """The direction of `block` as float32, after checking it is a finite
  non-zero vector of `hidden_size` values."""
  name = f'directions[{block}]'
  try:
    d = np.asarray(value, np.float64)
  except (TypeError, ValueError):
    raise UsageError(name, type(value).__name__, 'not an array of numbers'
                     ) from None
  shown = f'array of shape {d.shape}'
  if d.shape != (hidden_size,):
    raise UsageError(name, shown, f'must be a vector of hidden_size='
                     f'{hidden_size} values')
  if not np.all(np.isfinite(d)):
    raise UsageError(name, shown, f'has {int(np.sum(~np.isfinite(d)))} '
                     'non-finite values')
  if not np.any(d):
    raise UsageError(name, shown, 'is zero: a direction needs a non-zero '
                     'vector')
  return d.astype(np.float32)


def stored_vectors(directions: Mapping[int, Any], *, hidden_size: int,
                   num_layers: int, alpha: float = 1.0,
                   coefficient: float | Mapping[int, float] = 1.0
                   ) -> dict[int, np.ndarray]:
  """What `control_vector` stores: llama.cpp layer -> float32 vector.

  Args:
    directions: this repository's block index -> direction (any norm; it
      is normalised as `geom.steering.Steering` normalises it).
    hidden_size: the model's residual width (llama.cpp's n_embd).
    num_layers: the model's number of blocks.
    alpha: geom's addition strength, in (0, 1].
    coefficient: geom's addition coefficient (e.g. the mean activation
      norm at the layer), > 0: one for all blocks, or one per block.

  Returns:
    {llama_cpp_layer(block): alpha * coefficient * unit(direction)}.

  Raises:
    UsageError: naming the argument (`directions[<block>]` for one
      direction) whose value cannot be written.
  """
  hidden_size = _check_int('hidden_size', hidden_size, 1)
  num_layers = _check_int('num_layers', num_layers, 2)
  alpha = _check_scale('alpha', alpha, 1.0)
  if not isinstance(directions, Mapping) or not directions:
    raise UsageError('directions', type(directions).__name__,
                     'must be a non-empty mapping of block index to vector')
  if isinstance(coefficient, Mapping):
    if set(coefficient) != set(directions):
      raise UsageError('coefficient', sorted(coefficient), 'a per-block '
                       f'coefficient needs the blocks {sorted(directions)}')
    coefficients = {b: _check_scale(f'coefficient[{b}]', c, None)
                    for b, c in coefficient.items()}
  else:
    c = _check_scale('coefficient', coefficient, None)
    coefficients = {b: c for b in directions}
  blocks = {}
  for key in directions:
    block = _check_int('directions', key, 0)
    if not 1 <= block < num_layers:
      raise UsageError('directions', block, (
          'block 0 has no llama.cpp control-vector slot (llama.cpp refuses '
          'direction.0 and never adds after block 0)') if block == 0 else (
              f'the model has blocks 0..{num_layers - 1}'))
    blocks[block] = key
  out = {}
  for block in sorted(blocks):
    key = blocks[block]
    mu = np.asarray(steering_lib.unit(
        _check_vector(block, directions[key], hidden_size)))
    # Steering computes (t * coefficient) * mu in float32: the same order
    # and rounding, so the stored values are what it adds, bit for bit.
    scale = np.float32(alpha) * np.float32(coefficients[key])
    out[llama_cpp_layer(block)] = (scale * mu).astype(np.float32)
  return out


def _write_atomic(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp)` to a temporary file beside `path`, then renames it over
  `path`; on any failure the temporary file is removed and `path` is as
  it was."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  # Named, not made, here: the writer creates it with the usual mode
  # (mkstemp's would be 0600, and the rename would keep it).
  tmp = os.path.join(directory, f'.{os.path.basename(path)}.'
                     f'{os.getpid()}.{secrets.token_hex(4)}.tmp')
  try:
    write(tmp)
    with open(tmp, 'rb+') as f:
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.remove(tmp)
    raise


def check_path(name: str, path: Any) -> str:
  """Checks that a control vector can be written at `path`.

  Args:
    name: the argument or flag that gave `path`, for the message.
    path: the file to write.

  Returns:
    `path`.

  Raises:
    UsageError: naming `name`: `path` is empty, in a bucket, or a
      directory.
  """
  if not isinstance(path, str) or not path:
    raise UsageError(name, path, 'must be a file path')
  if fileio.is_remote(path):
    raise UsageError(name, path, 'must be a local path (llama.cpp reads '
                     'local files)')
  if os.path.isdir(path):
    raise UsageError(name, path, 'is a directory; give a file path')
  return path


def control_vector(path: str, directions: Mapping[int, Any], *,
                   model_hint: str, hidden_size: int, num_layers: int,
                   alpha: float = 1.0,
                   coefficient: float | Mapping[int, float] = 1.0
                   ) -> ControlVector:
  """Writes `directions` as a llama.cpp control vector at `path`, atomically.

  Every input is checked before anything is written (`stored_vectors`
  says what is stored and the Raises).

  Args:
    path: the .gguf file to write (replaced if it exists).
    directions: this repository's block index -> direction.
    model_hint: `controlvector.model_hint` (e.g. `GEMMA_MODEL_HINT`).
    hidden_size: the model's residual width.
    num_layers: the model's number of blocks.
    alpha: geom's addition strength, in (0, 1].
    coefficient: geom's addition coefficient, one or one per block.

  Returns:
    What was written (as `read_control_vector` reads it back).
  """
  check_path('path', path)
  if not isinstance(model_hint, str) or not model_hint:
    raise UsageError('model_hint', model_hint, 'must be a non-empty string')
  vectors = stored_vectors(directions, hidden_size=hidden_size,
                           num_layers=num_layers, alpha=alpha,
                           coefficient=coefficient)

  def write(tmp: str) -> None:
    writer = gguf.GGUFWriter(tmp, ARCHITECTURE)
    writer.add_string(MODEL_HINT_KEY, model_hint)
    writer.add_uint32(LAYER_COUNT_KEY, len(vectors))
    for layer, vector in vectors.items():
      writer.add_tensor(f'{TENSOR_PREFIX}{layer}', vector)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

  # The writer's INFO lines name the temporary file, which never survives.
  log = logging.getLogger('gguf.gguf_writer')
  level = log.level
  log.setLevel(logging.WARNING)
  try:
    _write_atomic(path, write)
  finally:
    log.setLevel(level)
  return ControlVector(model_hint, len(vectors), vectors)


def read_control_vector(path: str) -> ControlVector:
  """A control vector file, read with `train.lm.gguf_file` (not llama.cpp's
  reader), checked as llama.cpp's loader checks it.

  Args:
    path: the .gguf file.

  Returns:
    Its metadata and its vectors by llama.cpp layer number.

  Raises:
    ValueError: one line naming `path` and the problem: not a GGUF file,
      another architecture, the metadata missing, a tensor that is not
      `direction.<N>` with N >= 1, not float32, not one-dimensional, or
      of another length than the others.
  """
  try:
    parsed = gguf_file.read(path)
  except gguf_file.GGUFFormatError as e:
    raise ValueError(f'{path}: not a GGUF file ({e})') from None
  arch = parsed.fields.get('general.architecture')
  if arch != ARCHITECTURE:
    raise ValueError(f'{path}: general.architecture={arch!r}; a control '
                     f'vector has {ARCHITECTURE!r}')
  hint, count = (parsed.fields.get(k) for k in (MODEL_HINT_KEY,
                                                 LAYER_COUNT_KEY))
  if not isinstance(hint, str) or not isinstance(count, int):
    raise ValueError(f'{path}: {MODEL_HINT_KEY} (a string) and '
                     f'{LAYER_COUNT_KEY} (an integer) are required')
  vectors = {}
  for name, tensor in parsed.tensors.items():
    index = name.removeprefix(TENSOR_PREFIX)
    if not name.startswith(TENSOR_PREFIX) or not (
        index.isascii() and index.isdigit()) or int(index) < 1:
      raise ValueError(f'{path}: tensor {name!r}: llama.cpp reads only '
                       'direction.<N>, N >= 1')
    if tensor.ggml_type != _GGML_F32 or len(tensor.dims) != 1:
      raise ValueError(f'{path}: tensor {name!r}: must be one-dimensional '
                       f'float32 (GGML type {tensor.ggml_type}, dims '
                       f'{tensor.dims})')
    vectors[int(index)] = gguf_file.dequantize(tensor).copy()
  if not vectors or len({v.shape for v in vectors.values()}) != 1:
    raise ValueError(f'{path}: needs direction tensors, all of one length '
                     f'(has {[(k, v.shape) for k, v in vectors.items()]})')
  return ControlVector(hint, count, dict(sorted(vectors.items())))


def check_export_flags(config: Any, path: str | None, alpha: float | None,
                       flag: str = '--export_gguf',
                       alpha_flag: str = '--export_alpha') -> float | None:
  """The strength at which `launch.steer_eval` exports the evaluation's
  addition direction, checked before anything is loaded; None when no
  export was asked for.

  Args:
    config: the evaluation's config.
    path: `--export_gguf`'s value (None: no export).
    alpha: `--export_alpha`'s value; None: the largest of `config.alphas`.
    flag: the path flag's name, for the messages.
    alpha_flag: the strength flag's name, likewise.

  Raises:
    UsageError: naming the flag: a strength without a path, a path that
      cannot be written, a config that is not Gemma's, the steered block
      is 0, or a strength outside (0, 1].
  """
  if path is None:
    if alpha is not None:
      raise UsageError(alpha_flag, alpha, f'needs {flag}=PATH')
    return None
  check_path(flag, path)
  # evaluation.lm_kind's test: only a Gemma config names a GGUF file.
  if 'gguf' not in config:
    raise UsageError(flag, path, 'llama.cpp runs Gemma (configs/gemma.py); '
                     'the in-project decoder has no llama.cpp counterpart')
  if config.layer == 0:
    raise UsageError(flag, path, 'config.layer=0: block 0 has no llama.cpp '
                     'control-vector slot; steer block 1 or later')
  if alpha is None:
    if not config.alphas:
      raise UsageError(alpha_flag, alpha, 'config.alphas is empty: give '
                       'the strength')
    alpha = max(config.alphas)
  return _check_scale(alpha_flag, alpha, 1.0)


def export_evaluation(workdir: str, path: str, alpha: float,
                      model_hint: str = GEMMA_MODEL_HINT) -> ControlVector:
  """Writes the addition of the evaluation in `workdir` as a control vector.

  Args:
    workdir: a finished evaluation's workdir: its direction, layer and
      coefficient come from steering_vector.npz, its model's depth from
      results.json.
    path: the .gguf file to write.
    alpha: the addition strength, in (0, 1].
    model_hint: `controlvector.model_hint`.

  Returns:
    What was written (`control_vector`'s result).
  """
  vec = steering_vectors.load(os.path.join(workdir, 'steering_vector.npz'))
  with open(os.path.join(workdir, 'results.json')) as f:
    num_layers = int(json.load(f)['meta']['num_layers'])
  return control_vector(path, {vec.layer: vec.direction},
                        model_hint=model_hint, hidden_size=vec.hidden_size,
                        num_layers=num_layers, alpha=alpha,
                        coefficient=float(vec.info['coefficient']))
