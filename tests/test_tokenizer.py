"""train.lm.tokenizer: subwords trained offline, exact round trips, the
byte-level split kept bit for bit, and fingerprints that refuse a checkpoint
or a steering vector paired with another tokenizer (one line)."""

import hashlib
import os
import shutil

import numpy as np
import pytest

from configs import lm as lm_config
from configs import steering as steering_config
from train import fileio
from train.run import resume_check
from train.errors import ConfigError, UsageError
from train.lm import corpus as text_corpus
from train.lm import tokenizer as lm_tokenizer
from train.lm import trainer as lm_trainer
from train.steering import evaluation as steering_eval
from train.steering import vectors as steering_vectors


@pytest.fixture(scope='module')
def sp_model():
  docs = text_corpus.english_documents('pydoc', 'train')[:1000]
  return lm_tokenizer.train_sentencepiece(docs, 1024)


def _random_texts(rng, n=40):
  alphabet = list('abcdefghij XYZ.,!?\n\t  0123') + ['é', 'ß', '☃', '日本']
  return [''.join(rng.choice(alphabet, size=rng.integers(0, 60)))
          for _ in range(n)]


def test_training_is_deterministic_and_the_fingerprint_is_the_files(sp_model):
  docs = text_corpus.english_documents('pydoc', 'train')[:1000]
  assert lm_tokenizer.train_sentencepiece(docs, 1024) == sp_model
  tok = lm_tokenizer.SentencePieceTokenizer(sp_model)
  assert tok.vocab_size == 1024
  assert tok.fingerprint == ('sentencepiece:'
                             + hashlib.sha256(sp_model).hexdigest())
  other = lm_tokenizer.train_sentencepiece(docs[:500], 1024)
  assert lm_tokenizer.SentencePieceTokenizer(other).fingerprint != (
      tok.fingerprint)


def test_round_trip_is_exact_on_any_text(sp_model):
  tok = lm_tokenizer.SentencePieceTokenizer(sp_model)
  for text in _random_texts(np.random.default_rng(0)) + [
      '', ' lead', 'trail ', '  two  spaces', 'def f(x):\n    return x']:
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    # PAD and BOS are never produced, and decoding skips them.
    assert not np.isin(ids, [lm_tokenizer.PAD, lm_tokenizer.BOS]).any()
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([[1], ids, [0, 0]])) == text
  # Subwords: English compresses well below one token per byte.
  held_out = ''.join(text_corpus.english_documents('pydoc', 'validation'))
  assert len(tok.encode(held_out)) < 0.5 * len(held_out)


def test_split_keeps_the_byte_level_scoring_and_moves_straddling_tokens(
    sp_model):
  byte = lm_tokenizer.ByteTokenizer()
  ctx, cont = lm_tokenizer.split(byte, 'The film was ', 'great.')
  np.testing.assert_array_equal(
      ctx, np.concatenate([[1], text_corpus.encode('The film was ')]))
  np.testing.assert_array_equal(cont, text_corpus.encode('great.'))
  tok = lm_tokenizer.SentencePieceTokenizer(sp_model)
  rng = np.random.default_rng(1)
  for prefix, cont_text in [('The film was ', 'great.'), ('x = ', '1'),
                            ('', 'all'), ('all', '')] + list(
                                zip(_random_texts(rng), _random_texts(rng))):
    ctx, cont = lm_tokenizer.split(tok, prefix, cont_text)
    assert ctx[0] == lm_tokenizer.BOS
    joint = tok.encode(prefix + cont_text)
    np.testing.assert_array_equal(np.concatenate([ctx[1:], cont]), joint)
    head = tok.decode(ctx)
    assert prefix.startswith(head)
    # Maximal: one more token would leave the prefix.
    if len(cont):
      assert not prefix.startswith(tok.decode(np.concatenate([ctx,
                                                              cont[:1]])))
  # The separator's space starts the next word's token.
  ctx, cont = lm_tokenizer.split(tok, 'The function returns ', 'the value')
  assert tok.decode(cont).startswith(' the') or tok.decode(cont) == (
      'the value')


@pytest.mark.parametrize('arg, overrides, message', [
    ('tokenizer=sentencepiece', {'tokenizer.kind': 'wordpiece'},
     "config.tokenizer.kind='wordpiece': unknown tokenizer; valid choices: "
     "'byte', 'sentencepiece'"),
    ('tokenizer=sentencepiece', {'model.vocab_size': 512},
     'config.model.vocab_size=512: must equal tokenizer.vocab_size=384'),
    ('tokenizer=sentencepiece',
     {'tokenizer.vocab_size': 100, 'model.vocab_size': 100},
     r'config.tokenizer.vocab_size=100: must be an integer in \[320, 65535\]'),
    ('tokenizer=sentencepiece', {'tokenizer.model_type': 'char'},
     "config.tokenizer.model_type='char': unknown SentencePiece model type"),
])
def test_bad_tokenizer_settings_are_one_line(arg, overrides, message, tmp_path):
  config = lm_config.get_config(f'runlocal,{arg}')
  for field, value in overrides.items():
    section, key = field.split('.')
    config[section][key] = value
  with pytest.raises(ConfigError, match=message) as e:
    lm_trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert '\n' not in str(e.value)
  assert not os.path.exists(tmp_path / 'run' / lm_tokenizer.FILENAME)
  with pytest.raises(ValueError, match="tokenizer='bpe'; valid: byte, "):
    lm_config.get_config('tokenizer=bpe')


def test_fingerprints_refuse_another_file_naming_it():
  meta = {resume_check.FINGERPRINTS: {'tokenizer.model': 'sentencepiece:'
                                      + 'a' * 64}}
  resume_check.check_fingerprints('/w', 4, meta,
                                  {'tokenizer.model': 'sentencepiece:'
                                   + 'a' * 64})
  resume_check.check_fingerprints('/w', 4, {}, {'tokenizer.model': 'x'})
  with pytest.raises(UsageError) as e:
    resume_check.check_fingerprints('/w', 4, meta, {'tokenizer.model':
                                                    'sentencepiece:' + 'b' * 64})
  assert str(e.value).startswith(
      "tokenizer.model='sentencepiece:bbbbbbbbbbbb': differs from "
      'sentencepiece:aaaaaaaaaaaa, the one the checkpoint of /w at step 4')
  assert '\n' not in str(e.value)


def _tiny_sp_config(num_steps=4):
  config = lm_config.get_config('runlocal,tokenizer=sentencepiece')
  config.num_steps = num_steps
  config.optimizer.warmup_steps = 1
  config.log_every = config.eval_every = config.checkpoint_every = 2
  return config


@pytest.fixture(scope='module')
def sp_lm(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('sp_lm'))
  lm_trainer.train_and_evaluate(_tiny_sp_config(), workdir)
  return workdir


def test_a_subword_lm_trains_and_loads_with_its_tokenizer(sp_lm):
  path = os.path.join(sp_lm, lm_tokenizer.FILENAME)
  with open(path, 'rb') as f:
    saved = f.read()
  lm = lm_trainer.load_trained(sp_lm)
  assert lm.tokenizer.fingerprint == (
      'sentencepiece:' + hashlib.sha256(saved).hexdigest())
  assert lm.model.vocab_size == lm.tokenizer.vocab_size == 384
  # The tokenizer is the one trained on the run's own training text.
  config = _tiny_sp_config()
  docs = text_corpus.mixture_documents([tuple(e) for e in config.data.mix],
                                       config.data.train_bytes, 'train',
                                       config.seed)
  assert saved == lm_tokenizer.train_sentencepiece([d for _, d in docs], 384)


def test_a_replaced_tokenizer_is_refused_in_one_line(sp_lm, sp_model,
                                                     tmp_path):
  workdir = str(tmp_path / 'copy')
  shutil.copytree(sp_lm, workdir)
  os.remove(os.path.join(workdir, '.lock'))
  other = lm_tokenizer.train_sentencepiece(
      text_corpus.english_documents('pydoc', 'train')[:300], 384)
  with open(os.path.join(workdir, lm_tokenizer.FILENAME), 'wb') as f:
    f.write(other)
  # Loading the LM (the steering evaluation's way in) ...
  with pytest.raises(UsageError) as e:
    lm_trainer.load_trained(workdir)
  assert 'was made with tokenizer sentencepiece:' in str(e.value)
  assert '\n' not in str(e.value)
  # ... and resuming the run (extended, so that it restores and trains).
  with pytest.raises(UsageError) as e:
    lm_trainer.train_and_evaluate(_tiny_sp_config(num_steps=6), workdir)
  assert str(e.value).startswith("tokenizer.model='sentencepiece:")
  assert 'a run resumes only with its own' in str(e.value)
  # A symlink out of the workdir: another user's file is not read as this
  # run's.
  outside = tmp_path / 'outside.model'
  outside.write_bytes(sp_model)
  os.remove(os.path.join(workdir, lm_tokenizer.FILENAME))
  os.symlink(outside, os.path.join(workdir, lm_tokenizer.FILENAME))
  with pytest.raises(fileio.SpecialFile, match='outside'):
    lm_trainer.load_trained(workdir)
  # A missing file.
  os.remove(os.path.join(workdir, lm_tokenizer.FILENAME))
  with pytest.raises(UsageError, match='its model file is gone'):
    lm_trainer.load_trained(workdir)


def test_a_steering_vector_of_another_tokenizer_is_refused(sp_lm, tmp_path):
  lm = lm_trainer.load_trained(sp_lm)
  direction = np.zeros(32, np.float32)
  direction[0] = 1.0
  # A vector of these very weights, but recorded with the byte tokenizer
  # (as every file from before tokenizers is read).
  path = str(tmp_path / 'v.npz')
  steering_vectors.save(path, steering_vectors.SteeringVector(
      direction, 1, 'block_1', steering_vectors.fingerprint(lm.params),
      dict(coefficient=1.0)))
  config = steering_config.get_config('runlocal')
  config.lm_workdir = sp_lm
  config.vector_file = path
  with pytest.raises(UsageError) as e:
    steering_eval.evaluate(config, str(tmp_path / 'eval'))
  assert str(e.value) == (
      f"tokenizer='{lm.tokenizer.fingerprint[:26]}': the steering vector "
      f'{path} was made with tokenizer byte:ascii-v1; a model or vector is '
      'only valid with its own')
  assert not os.path.exists(tmp_path / 'eval' / 'results.json')
