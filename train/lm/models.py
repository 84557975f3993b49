"""The LM a config's `model` block names: the in-project decoder or Gemma 3.

`config.model.kind` (absent: 'decoder', as every config before Gemma):

  decoder  `train.lm.decoder.DecoderLM`, initialised from `config.seed`;
           the other fields are its attributes (vocab_size, d_model, ...).
  gemma    `train.lm.gemma.Gemma3` of `shape` ('270m', '1b', '4b', or
           'gguf': the shape the file's metadata gives), its pretrained
           weights read from the GGUF file `gguf` (empty: the registry
           package's Gemma 3 270M, `train.lm.gemma_gguf`), in
           `dtype` ('float32' or 'bfloat16', parameters and compute), with
           `max_len` cache slots and optional `remat`. 1B and 4B ship in no
           registry package: with an empty `gguf` they only compile
           (`launch.compile` builds on shapes, nothing is read).

Both are a `train.lm.interface.LanguageModel`: the same call, `(tokens,
valid, cache) -> (logits, cache)`, so the trainers, generation, steering
hooks and evaluation, SFT and GRPO run on either. A
pretrained model's file is an input of the run: its SHA-256 is recorded
with every checkpoint (`GGUF_FINGERPRINT`) and a resume from another file
is refused, as for any pinned input.
"""

import os
from typing import Any, NamedTuple

import flax.linen as nn
import ml_collections

from train.errors import ConfigError
from train.lm import decoder as decoder_lm
from train.lm import gemma
from train.lm import gemma_gguf

KINDS = ('decoder', 'gemma')
# The fingerprint name of a pretrained model's file in a run's checkpoints.
GGUF_FINGERPRINT = 'model.gguf'
GEMMA_FIELDS = ('kind', 'shape', 'gguf', 'dtype', 'max_len', 'remat')


def kind(config: ml_collections.ConfigDict) -> str:
  return config.model.get('kind', 'decoder')


# `model.shape` of a Gemma whose shape is its file's.
FILE_SHAPE = 'gguf'


def shape_named(name: str, gguf: str) -> gemma.Shape:
  """Gemma 3's shape `name`, or (FILE_SHAPE) the one file `gguf`'s
  metadata gives."""
  if name != FILE_SHAPE:
    return gemma.SHAPES[name]
  return gemma_gguf.read_shape(gguf)


def gemma_shape(config: ml_collections.ConfigDict) -> gemma.Shape:
  """A Gemma config's shape: a named one, or its file's metadata."""
  return shape_named(config.model.shape, config.model.gguf)


def vocab_size(config: ml_collections.ConfigDict) -> int:
  """The model's vocabulary (Gemma's from its shape)."""
  if kind(config) == 'gemma':
    return gemma_shape(config).vocab_size
  return config.model.vocab_size


def _check_decoder(kwargs: dict[str, Any]) -> None:
  fields = set(decoder_lm.DecoderLM.__dataclass_fields__) - {'parent', 'name'}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ConfigError(f'model.{unknown[0]}', kwargs[unknown[0]],
                      'not a field of the decoder LM', sorted(fields))
  for field, value in kwargs.items():
    if field == 'dtype':
      if value not in decoder_lm.DTYPES:
        raise ConfigError('model.dtype', value, 'unknown compute dtype',
                          decoder_lm.DTYPES)
    elif field == 'remat':
      if not isinstance(value, bool):
        raise ConfigError('model.remat', value, 'must be True or False')
    elif field == 'num_kv_heads' and value is None:
      pass
    elif not isinstance(value, int) or value <= 0:
      raise ConfigError(f'model.{field}', value, 'must be a positive integer')
  if kwargs['d_model'] % kwargs['num_heads'] or (
      kwargs['d_model'] // kwargs['num_heads']) % 2:
    raise ConfigError('model.num_heads', kwargs['num_heads'],
                      f'must divide d_model={kwargs["d_model"]} into heads '
                      'of even size (rotary embeddings)')
  kv_heads = kwargs.get('num_kv_heads')
  if kv_heads is not None and kwargs['num_heads'] % kv_heads:
    raise ConfigError('model.num_kv_heads', kv_heads,
                      f'must divide num_heads={kwargs["num_heads"]} (each '
                      'key/value head serves a group of query heads)')


def _check_gemma(model: ml_collections.ConfigDict) -> None:
  unknown = sorted(set(model) - set(GEMMA_FIELDS))
  if unknown:
    raise ConfigError(f'model.{unknown[0]}', model[unknown[0]],
                      'not a field of a Gemma model', GEMMA_FIELDS)
  if model.get('shape') not in (*gemma.SHAPES, FILE_SHAPE):
    raise ConfigError('model.shape', model.get('shape'),
                      'not a Gemma 3 shape', (*gemma.SHAPES, FILE_SHAPE))
  if model.shape == FILE_SHAPE and not model.get('gguf'):
    raise ConfigError('model.shape', model.shape,
                      "the file's own shape needs model.gguf")
  if model.shape == FILE_SHAPE and not os.path.isfile(model.gguf):
    raise ConfigError('model.gguf', model.gguf, 'no such file')
  if model.get('dtype', 'float32') not in gemma.DTYPES:
    raise ConfigError('model.dtype', model.dtype, 'not a parameter dtype',
                      gemma.DTYPES)
  max_len = model.get('max_len')
  if not isinstance(max_len, int) or isinstance(max_len, bool) or not (
      0 < max_len <= gemma.MAX_CONTEXT):
    raise ConfigError('model.max_len', max_len,
                      f'must be an integer in [1, {gemma.MAX_CONTEXT}] '
                      "(Gemma 3's context)")
  if not isinstance(model.get('remat', False), bool):
    raise ConfigError('model.remat', model.remat, 'must be True or False')
  if not isinstance(model.get('gguf', ''), str):
    raise ConfigError('model.gguf', model.gguf,
                      'must be a path (empty: the registry package\'s)')


def check_config(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the field for a bad `config.model` (nothing read)."""
  if kind(config) not in KINDS:
    raise ConfigError('model.kind', kind(config), 'unknown model kind',
                      KINDS)
  if kind(config) == 'gemma':
    _check_gemma(config.model)
  else:
    _check_decoder({k: v for k, v in config.model.items() if k != 'kind'})


def create(config: ml_collections.ConfigDict) -> nn.Module:
  """The model of `config.model`, checked (`check_config`)."""
  check_config(config)
  if kind(config) == 'gemma':
    m = config.model
    return gemma.Gemma3(gemma_shape(config), max_len=m.max_len,
                        dtype=m.get('dtype', 'float32'),
                        remat=m.get('remat', False))
  return decoder_lm.DecoderLM(
      **{k: v for k, v in config.model.items() if k != 'kind'})


class Pretrained(NamedTuple):
  """A pretrained model's parameters, tokenizer and file fingerprint."""
  params: dict[str, Any]
  tokenizer: Any
  fingerprints: dict[str, str]


def check_inputs(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the field when a pretrained model's file is not
  there, holds another shape, or none ships for the shape;
  DamagedModelFile when the file is not a Gemma 3 GGUF. The file is
  checked whole (`gemma_gguf.check_file`: under a second, nothing
  decoded), so that a run refuses it before it opens its workdir."""
  if kind(config) != 'gemma':
    return
  m = config.model
  if m.get('gguf'):
    if not os.path.isfile(m.gguf):
      raise ConfigError('model.gguf', m.gguf, 'no such file (empty: the '
                        'registry package\'s Gemma 3 270M)')
    held = gemma_gguf.check_file(m.gguf).shape
    if not gemma.same_dims(held, shape_named(m.shape, m.gguf)):
      raise ConfigError('model.shape', m.shape,
                        f'{m.gguf} holds another shape')
    gemma_gguf.check_memory(held, m.gguf)
  elif m.shape != '270m':
    raise ConfigError('model.shape', m.shape, 'only Gemma 3 270M ships in '
                      'the registry: give model.gguf for another shape (or '
                      'compile it: python -m launch.compile)')


def gguf_path(config: ml_collections.ConfigDict) -> str:
  """The Gemma file a config names (the registry's, assembled once into
  the user's cache, when `model.gguf` is empty)."""
  check_inputs(config)
  return config.model.gguf or gemma_gguf.registry_file()


def pretrained(config: ml_collections.ConfigDict) -> Pretrained | None:
  """The pretrained weights a config starts from (None for the decoder):
  the GGUF file read (`gemma_gguf.load`), its shape checked against
  `model.shape`.

  Raises:
    ConfigError: the file holds another shape.
    DamagedModelFile: the file is not a readable Gemma 3 GGUF.
  """
  if kind(config) != 'gemma':
    return None
  path = gguf_path(config)
  loaded = gemma_gguf.load(path, config.model.get('dtype', 'float32'))
  if not gemma.same_dims(loaded.shape, gemma_shape(config)):
    raise ConfigError('model.shape', config.model.shape,
                      f'{path} holds another shape')
  return Pretrained(loaded.params, loaded.tokenizer,
                    {GGUF_FINGERPRINT: 'gguf-sha256:' + loaded.sha256})


def tokenizer(config: ml_collections.ConfigDict):
  """A pretrained model's tokenizer, from its file's metadata (no weights
  decoded)."""
  return gemma_gguf.read_tokenizer(gguf_path(config))


def fingerprints(config: ml_collections.ConfigDict) -> dict[str, str]:
  """{name: fingerprint} of the pretrained file a config reads (hashed, not
  parsed: a resume pins it without loading it); {} for the decoder."""
  if kind(config) != 'gemma':
    return {}
  return {GGUF_FINGERPRINT:
          'gguf-sha256:' + gemma_gguf.file_sha256(gguf_path(config))}
