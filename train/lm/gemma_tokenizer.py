"""Gemma's SentencePiece tokenizer, rebuilt from a GGUF file's metadata.

Gemma 3 tokenizes with SentencePiece (BPE, 262,144 pieces). A GGUF file
carries the whole vocabulary in `tokenizer.ggml.{tokens,scores,token_type}`
(the pieces in id order with their scores and SentencePiece types), and
llama.cpp's converter copies the special ids and `add_space_prefix` from
the original model. `from_gguf_fields` writes them back into a
SentencePiece `ModelProto`:

- model type BPE, byte fallback on (the 256 `<0xXX>` pieces), so any
  Unicode text encodes and decodes back exactly;
- the normalizer of Gemma's own model: identity (no NFKC), no dummy
  prefix, extra whitespace kept, spaces escaped as U+2581;
- the types as stored: user-defined pieces (newline and space runs,
  `[multimodal]`) match greedily in the text, their spaces escaped back to
  U+2581 (llama.cpp's converter writes them unescaped); control pieces
  (`<start_of_turn>`, ...) never come from text;
- pad 0, eos 1, bos 2, unk 3 from the file (checked).

SentencePiece then encodes exactly as Gemma's `tokenizer.model` does, with
digits split one per token because no piece of the vocabulary holds a digit
with anything else. `tests/test_gemma_reference.py` checks the ids
against llama.cpp's tokenizer on the same file.

Every document starts with BOS (id 2), as Gemma was trained; `encode`
returns the ids without it, as `train.lm.tokenizer`'s tokenizers do.
"""

import hashlib

import numpy as np

from train import errors

PAD, EOS, BOS, UNK = 0, 1, 2, 3
_USER_DEFINED = 4  # SentencePiece's (and GGUF's) piece type.
_SPACE = '\u2581'


def _array(fields, key: str, path: str):
  if key not in fields:
    raise errors.DamagedModelFile(path, f'metadata {key!r} is missing')
  return fields[key]


def from_gguf_fields(fields, path: str) -> 'GemmaTokenizer':
  """The tokenizer of a GGUF file's metadata (`train.lm.gguf_file`)."""
  from sentencepiece import sentencepiece_model_pb2 as spm_pb2  # pylint: disable=g-import-not-at-top
  model = _array(fields, 'tokenizer.ggml.model', path)
  if model != 'llama':  # llama.cpp's name for a SentencePiece vocabulary.
    raise errors.DamagedModelFile(
        path, f'tokenizer.ggml.model={model!r}; Gemma\'s is SentencePiece '
        '(\'llama\')')
  pieces = _array(fields, 'tokenizer.ggml.tokens', path)
  scores = _array(fields, 'tokenizer.ggml.scores', path)
  types = _array(fields, 'tokenizer.ggml.token_type', path)
  if not len(pieces) == len(scores) == len(types):
    raise errors.DamagedModelFile(
        path, f'{len(pieces)} tokens, {len(scores)} scores and {len(types)} '
        'types')
  special = {k: int(fields[f'tokenizer.ggml.{k}_token_id'])
             for k in ('padding', 'eos', 'bos', 'unknown')
             if f'tokenizer.ggml.{k}_token_id' in fields}
  want = dict(padding=PAD, eos=EOS, bos=BOS, unknown=UNK)
  if special != want:
    raise errors.DamagedModelFile(
        path, f'special token ids {special}; Gemma\'s are {want}')
  space_prefix = fields.get('tokenizer.ggml.add_space_prefix', False)
  proto = spm_pb2.ModelProto()
  for piece, score, kind in zip(pieces, scores, types):
    p = proto.pieces.add()
    if kind == _USER_DEFINED:
      # llama.cpp's converter writes the user-defined space runs with real
      # spaces (its tokenizer matches them in the raw text); SentencePiece
      # matches them after escaping spaces, as Gemma's own model holds them.
      piece = piece.replace(' ', _SPACE)
    p.piece, p.score, p.type = piece, float(score), int(kind)
  spec = proto.trainer_spec
  spec.model_type = spm_pb2.TrainerSpec.BPE
  spec.vocab_size = len(pieces)
  spec.byte_fallback = True
  spec.split_digits = True
  spec.pad_id, spec.eos_id, spec.bos_id, spec.unk_id = PAD, EOS, BOS, UNK
  norm = proto.normalizer_spec
  norm.name = 'identity'
  norm.add_dummy_prefix = bool(space_prefix)
  norm.remove_extra_whitespaces = False
  norm.escape_whitespaces = True
  return GemmaTokenizer(proto.SerializeToString())


class GemmaTokenizer:
  """SentencePiece over Gemma's vocabulary (see the module docstring)."""

  kind = 'gemma'
  pad_id, eos_id, bos_id = PAD, EOS, BOS

  def __init__(self, model_proto: bytes):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    self.model_proto = bytes(model_proto)
    self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
    self.vocab_size = int(self._sp.piece_size())
    self.fingerprint = 'gemma:' + hashlib.sha256(self.model_proto).hexdigest()

  def encode(self, text: str) -> np.ndarray:
    """int32 ids of `text`, without BOS."""
    return np.asarray(self._sp.encode(text), np.int32)

  def encode_document(self, text: str) -> np.ndarray:
    """BOS, then the ids of `text`."""
    return np.concatenate([[BOS], self.encode(text)]).astype(np.int32)

  def decode(self, ids) -> str:
    """The text of `ids`, skipping PAD, BOS and EOS."""
    return self._sp.decode([int(i) for i in np.asarray(ids).ravel()
                            if i not in (PAD, BOS, EOS)])

  def piece(self, token_id: int) -> str:
    return self._sp.id_to_piece(int(token_id))
