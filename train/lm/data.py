"""The LM trainer's data: token windows of a configured source mixture.

`config.data` (see `configs/lm.py`):
  mix: ((source, weight), ...), sources 'attribute' (the sentiment
    template corpus), 'fortunes', 'pydoc' or a path to .txt files;
  train_bytes / eval_bytes: bytes of text per split;
  seq_len: window length in tokens (each window holds seq_len + 1);
tokens are bytes, or subwords (`train.lm.tokenizer`, `config.tokenizer`).

Windows are a pure function of (config.data, split, seed), so a resumed
run rebuilds exactly the data it had, and batches come from
`input_pipeline.TrainBatches` by step number like the image trainer's.
`heldout_windows` is the text a pretrained model never trains on here
(its steering study's KL, its fine-tuning's forgetting).
"""

import dataclasses
import functools
import os

import ml_collections
import numpy as np

from train.errors import ConfigError, UsageError
from train.training.input_pipeline import Batch
from train.lm import corpus as text_corpus
from train.lm import tokenizer as lm_tokenizer

SOURCES = ('attribute',) + text_corpus.ENGLISH_SOURCES


@dataclasses.dataclass(frozen=True)
class TokenWindows:
  """One split: (N, seq_len + 1) token windows, uint8 bytes or uint16
  subwords (an `input_pipeline.Split`)."""
  tokens: np.ndarray

  def __len__(self) -> int:
    return len(self.tokens)

  def rows(self, indices: np.ndarray) -> Batch:
    return {'tokens': self.tokens[indices]}

  def columns(self) -> Batch:
    return {'tokens': self.tokens}


def source_names(data: ml_collections.ConfigDict) -> list[str]:
  """Short names of the mixture's sources ('attribute', 'fortunes', a file's stem)."""
  return [s if s in SOURCES else
          os.path.splitext(os.path.basename(s.rstrip('/')))[0] or 'path'
          for s, w in data.mix if w > 0]


def check_config(data: ml_collections.ConfigDict,
                 check_sources: bool = True) -> None:
  """Raises ConfigError naming the field for a bad `config.data`;
  `check_sources=False` skips checking that the sources are present on
  this machine (a pod's corpus is on the pod)."""
  for field in ('train_bytes', 'eval_bytes', 'seq_len'):
    if not isinstance(data[field], int) or data[field] <= 0:
      raise ConfigError(f'data.{field}', data[field],
                        'must be a positive integer')
  if not data.mix:
    raise ConfigError('data.mix', data.mix, 'needs at least one source')
  for i, entry in enumerate(data.mix):
    if len(entry) != 2:
      raise ConfigError(f'data.mix[{i}]', entry, 'must be (source, weight)')
    source, weight = entry
    if check_sources and source not in SOURCES and not os.path.exists(
        str(source)):
      raise ConfigError(f'data.mix[{i}]', source,
                        'unknown source (or a path that does not exist)',
                        SOURCES + ('<path to .txt files>',))
    if (check_sources and source == 'fortunes'
        and not os.path.isdir(text_corpus.FORTUNES_DIR)):
      raise ConfigError(f'data.mix[{i}]', source,
                        f'{text_corpus.FORTUNES_DIR} is missing: '
                        "`apt-get install fortunes`, or use 'pydoc'")
    if not isinstance(weight, (int, float)) or not weight >= 0:
      raise ConfigError(f'data.mix[{i}]', entry, 'weight must be >= 0')
  if not any(w > 0 for _, w in data.mix):
    raise ConfigError('data.mix', data.mix, 'all weights are zero')


def load_windows(data: ml_collections.ConfigDict, split: str, seed: int,
                 only: str | None = None,
                 tokenizer: lm_tokenizer.Tokenizer | None = None
                 ) -> TokenWindows:
  """The split's windows; `only` restricts the mixture to one source name
  (as `source_names` gives it), at that source's share of the bytes;
  `tokenizer` (default: bytes) makes the tokens."""
  mix = [tuple(e) for e in data.mix]
  total = data.train_bytes if split == 'train' else data.eval_bytes
  if only is not None:
    names = source_names(data)
    kept = [(s, w) for (s, w), n in zip([e for e in mix if e[1] > 0], names)
            if n == only]
    total = int(total * sum(w for _, w in kept) / sum(w for _, w in mix))
    mix = kept
  try:
    tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
    tokens = text_corpus.build_lm_windows(
        mix, total, data.seq_len, split, seed,
        functools.partial(lm_tokenizer.encode_document, tokenizer),
        lm_tokenizer.token_dtype(tokenizer.vocab_size))
  except UsageError as e:
    raise ConfigError('data', dict(mix=mix, bytes=total), str(e)) from None
  return TokenWindows(tokens)


def heldout_windows(tokenizer, count: int, length: int,
                    split: str = 'test') -> np.ndarray:
  """(count, length + 1) token windows, half from Python's documentation
  (`split`; real English) and half from template reviews (`split`; the
  steered attribute's own domain): BOS, then `length` consecutive tokens
  of the source's documents joined by blank lines."""
  reviews, _ = text_corpus.attribute_documents(4 * count, 11, split)
  sources = {'pydoc': text_corpus.english_documents('pydoc', split),
             'reviews': reviews}
  windows = []
  for k, (name, docs) in enumerate(sources.items()):
    want = count // 2 + (count % 2 if k == 0 else 0)
    stream = tokenizer.encode('\n\n'.join(docs))
    if len(stream) < want * length:
      raise ConfigError('heldout_windows', count, f'the {name} {split} text '
                        f'holds {len(stream)} tokens, fewer than {want} '
                        f'windows of {length}')
    bos = lm_tokenizer.bos_id(tokenizer)
    windows += [np.concatenate([[bos], stream[i * length:(i + 1) * length]])
                for i in range(want)]
  return np.stack(windows).astype(np.int32)
