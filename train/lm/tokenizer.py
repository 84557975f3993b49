"""The LM's tokenizers: bytes, or subwords trained offline with SentencePiece.

`config.tokenizer` (absent: bytes, as every run before subwords):

  kind: 'byte' (ASCII bytes, `train.lm.corpus.encode`), 'sentencepiece',
    or 'gemma' (a pretrained Gemma's own, `train.lm.gemma_tokenizer`, read
    from its GGUF file: `config.model.kind = 'gemma'` and nothing else);
  vocab_size: the subword vocabulary (equal to `config.model.vocab_size`);
  model_type: SentencePiece's 'bpe' or 'unigram'.

A SentencePiece tokenizer is trained on the run's own training text (the
configured mixture, `train_bytes` of it, the run's seed) the first time the
run starts, and written beside its checkpoints as `tokenizer.model`
(atomically). Training is deterministic (one thread, no sampling of the
input), so the file is a function of the config. Every checkpoint records
the tokenizer's fingerprint (the SHA-256 of the model file), and a
checkpoint or a steering vector met with another tokenizer is refused in
one line (`check_fingerprint`).

The in-project tokenizers share the LM's conventions: id 0 pads, id 1
starts every document (BOS), and decoding skips both (Gemma's vocabulary
fixes its own: BOS 2, `bos_id`). A Gemma run keeps a copy of its
tokenizer as `tokenizer.model` too, so that the run is read back without
its GGUF file. SentencePiece runs with byte
fallback and no normalisation or whitespace folding, so that decoding
returns the encoded text exactly (any Unicode, not only ASCII).
"""

import dataclasses
import hashlib
import io
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from train import fileio
from train.run import resume_check
from train.errors import ConfigError, UsageError
from train.lm import corpus as text_corpus
from train.lm import gemma_tokenizer
from train.lm import models

KINDS = ('byte', 'sentencepiece', 'gemma')
MODEL_TYPES = ('bpe', 'unigram')
FILENAME = 'tokenizer.model'
PAD = text_corpus.PAD
BOS = text_corpus.BOS
# Fingerprint of the byte tokenizer: its definition, versioned by hand.
BYTE_FINGERPRINT = 'byte:ascii-v1'
# Below this a SentencePiece model cannot hold its byte-fallback pieces
# (256), the special ids and a few merges.
MIN_SUBWORD_VOCAB = 320


class Tokenizer(Protocol):
  kind: str
  vocab_size: int
  fingerprint: str

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text`, without BOS."""

  def decode(self, ids) -> str:
    """The text of `ids`, skipping PAD and BOS."""


def encode_document(tokenizer: Tokenizer, text: str) -> np.ndarray:
  """BOS, then the text's ids: how every document starts in training."""
  return np.concatenate([[bos_id(tokenizer)],
                         tokenizer.encode(text)]).astype(np.int32)


def bos_id(tokenizer: Tokenizer) -> int:
  """The tokenizer's BOS id: the in-project tokenizers' `BOS`, or the one a
  pretrained vocabulary fixes (`bos_id`: Gemma's is 2)."""
  return int(getattr(tokenizer, 'bos_id', BOS))


def split(tokenizer: Tokenizer, prefix: str, continuation: str
          ) -> tuple[np.ndarray, np.ndarray]:
  """(BOS + context ids, continuation ids) of `prefix + continuation`
  tokenized as one text: the context is the longest run of leading tokens
  whose text lies within `prefix`; a token straddling the boundary (a
  subword that carries the prefix's last space into the next word) goes
  with the continuation, and so do the byte-fallback pieces of a character
  cut in two. For bytes this is BOS + encode(prefix), then
  encode(continuation)."""
  ids = tokenizer.encode(prefix + continuation)
  if tokenizer.kind == 'byte':
    k = len(tokenizer.encode(prefix))
  else:
    k = 0
    while k < len(ids) and prefix.startswith(tokenizer.decode(ids[:k + 1])):
      k += 1
  return (np.concatenate([[bos_id(tokenizer)], ids[:k]]).astype(np.int32),
          ids[k:].astype(np.int32))


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """ASCII bytes (`train.lm.corpus.encode`): non-ASCII becomes '?'."""
  kind: str = 'byte'
  vocab_size: int = text_corpus.VOCAB_SIZE
  fingerprint: str = BYTE_FINGERPRINT

  def encode(self, text: str) -> np.ndarray:
    return text_corpus.encode(text)

  def decode(self, ids) -> str:
    return text_corpus.decode(ids)


class SentencePieceTokenizer:
  """A trained SentencePiece model (its serialized bytes)."""

  kind = 'sentencepiece'

  def __init__(self, model_proto: bytes):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    self.model_proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
    self.vocab_size = int(self._sp.piece_size())
    self.fingerprint = ('sentencepiece:'
                        + hashlib.sha256(self.model_proto).hexdigest())
    if (self._sp.pad_id(), self._sp.bos_id()) != (PAD, BOS):
      raise ValueError(f'a SentencePiece model with pad/bos ids '
                       f'{self._sp.pad_id()}/{self._sp.bos_id()}; the LM '
                       f'needs {PAD}/{BOS}')

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in np.asarray(ids).ravel()
                            if i not in (PAD, BOS)])


def train_sentencepiece(documents: Sequence[str], vocab_size: int,
                        model_type: str = 'bpe') -> bytes:
  """A SentencePiece model trained on `documents`, as bytes (deterministic)."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  if model_type not in MODEL_TYPES:
    raise ValueError(f'model_type={model_type!r}: valid: {MODEL_TYPES}')
  out = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter([d for d in documents if d]),
      model_writer=out, vocab_size=vocab_size, model_type=model_type,
      pad_id=PAD, bos_id=BOS, unk_id=2, eos_id=-1,
      byte_fallback=True, character_coverage=1.0,
      normalization_rule_name='identity', remove_extra_whitespaces=False,
      add_dummy_prefix=False, split_digits=True,
      max_sentence_length=1 << 20, input_sentence_size=0,
      shuffle_input_sentence=False, num_threads=1, minloglevel=2)
  return out.getvalue()


def check_config(config) -> None:
  """ConfigError naming the field for a bad `config.tokenizer`."""
  tok = config.get('tokenizer')
  if tok is None:
    return
  kind = tok.get('kind')
  if kind not in KINDS:
    raise ConfigError('tokenizer.kind', kind, 'unknown tokenizer', KINDS)
  if (kind == 'gemma') != (config.model.get('kind') == 'gemma'):
    raise ConfigError('tokenizer.kind', kind, "a Gemma model reads its own "
                      "tokenizer ('gemma') and no other model does")
  if kind == 'gemma':
    return
  vocab = config.model.vocab_size
  if kind == 'byte':
    if vocab != text_corpus.VOCAB_SIZE:
      raise ConfigError('model.vocab_size', vocab,
                        f'the byte tokenizer needs {text_corpus.VOCAB_SIZE}')
    return
  if tok.get('model_type', 'bpe') not in MODEL_TYPES:
    raise ConfigError('tokenizer.model_type', tok.get('model_type'),
                      'unknown SentencePiece model type', MODEL_TYPES)
  size = tok.get('vocab_size')
  if not isinstance(size, int) or not (
      MIN_SUBWORD_VOCAB <= size <= np.iinfo(np.uint16).max):
    raise ConfigError('tokenizer.vocab_size', size,
                      f'must be an integer in [{MIN_SUBWORD_VOCAB}, '
                      f'{np.iinfo(np.uint16).max}]')
  if vocab != size:
    raise ConfigError('model.vocab_size', vocab,
                      f'must equal tokenizer.vocab_size={size}')


def token_dtype(vocab_size: int) -> type:
  """The windows' storage dtype: uint8 for bytes, uint16 for the
  in-project subwords, uint32 for a pretrained vocabulary (Gemma's
  262,144)."""
  if vocab_size <= 256:
    return np.uint8
  return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def for_run(config, workdir: str) -> Tokenizer:
  """The run's tokenizer: bytes; or `workdir/tokenizer.model`, trained on
  the run's training text and written there first if it is not there."""
  tok = config.get('tokenizer')
  if tok is None or tok.kind == 'byte':
    return ByteTokenizer()
  path = fileio.join(workdir, FILENAME)
  if fileio.exists(path):
    return _read(path, tok.kind, root=workdir)
  if tok.kind == 'gemma':
    tokenizer = models.tokenizer(config)
    save(workdir, tokenizer)
    return tokenizer
  docs = text_corpus.mixture_documents(
      [tuple(e) for e in config.data.mix], config.data.train_bytes, 'train',
      config.seed)
  proto = train_sentencepiece([d for _, d in docs], tok.vocab_size,
                              tok.get('model_type', 'bpe'))
  tokenizer = SentencePieceTokenizer(proto)
  save(workdir, tokenizer)
  return tokenizer


def save(workdir: str, tokenizer: Tokenizer) -> None:
  """Writes `workdir/tokenizer.model` atomically."""
  fileio.write_bytes_atomic(fileio.join(workdir, FILENAME),
                            tokenizer.model_proto)


def _read(path: str, kind: str = 'sentencepiece',
          root: str | None = None) -> Tokenizer:
  """The tokenizer at `path` in workdir `root` (`fileio.check_local`)."""
  try:
    if kind == 'gemma':
      return gemma_tokenizer.GemmaTokenizer(fileio.read_bytes(path, root))
    return SentencePieceTokenizer(fileio.read_bytes(path, root))
  except fileio.SpecialFile:
    raise
  except (OSError, RuntimeError, ValueError) as e:
    raise UsageError(path, '<file>', f'not a readable SentencePiece model '
                     f'({str(e).splitlines()[0] if str(e) else e})') from None


def for_trained(config, workdir: str, fingerprint: str | None) -> Tokenizer:
  """A trained run's tokenizer, checked against its checkpoint's
  `fingerprint` (None: a checkpoint from before fingerprints, byte-level)."""
  tok = config.get('tokenizer')
  if tok is None or tok.kind == 'byte':
    tokenizer = ByteTokenizer()
  else:
    path = fileio.join(workdir, FILENAME)
    if not fileio.exists(path):
      raise UsageError(path, '<missing>', 'the run was trained with a '
                       'SentencePiece tokenizer and its model file is gone')
    tokenizer = _read(path, tok.kind, root=workdir)
  check_fingerprint(tokenizer, fingerprint or BYTE_FINGERPRINT,
                    f'the checkpoint in {workdir}')
  return tokenizer


def check_fingerprint(tokenizer: Tokenizer, expected: str, owner: str
                      ) -> None:
  """UsageError in one line unless `tokenizer` is the one `owner` (a
  checkpoint, a steering vector) was made with."""
  if tokenizer.fingerprint != expected:
    short = resume_check.short_fingerprint
    raise UsageError('tokenizer', short(tokenizer.fingerprint),
                     f'{owner} was made with tokenizer {short(expected)}; '
                     'a model or vector is only valid with its own')
