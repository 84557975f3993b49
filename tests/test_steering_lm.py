"""The decoder LM's cache, steering hooks, generation modes and steering-vector files."""

import io
import json
import os
import re
import tracemalloc
import zipfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from geom import steering as st
from train.lm import corpus as text_corpus
from train.lm import decoder as decoder_lm
from train.lm import generate as lm_generate
from train.lm import hooks as steering_hooks
from train.steering import evaluation as steering_eval
from train.steering import generations
from train.steering import scoring
from train.steering import vectors as steering_vectors

MODEL = decoder_lm.DecoderLM(vocab_size=64, d_model=32, num_layers=3,
                             num_heads=4, mlp_dim=64, max_len=48)


# Jitted, as the product runs them: op by op, each generation pays seconds
# of one-op compiles.
_generate = jax.jit(lm_generate.generate, static_argnames=(
    'model', 'num_steps', 'layer_path', 'mode', 'temperature'))


def _init(model, seed=0):
  return jax.jit(model.init)(jax.random.key(seed),
                             jnp.zeros((1, 4), jnp.int32))['params']


@pytest.fixture(scope='module')
def params():
  return _init(MODEL)


def _prompts():
  # Left-padded: row 0 has 3 real tokens, row 1 has 6.
  tokens = jnp.array([[0, 0, 0, 5, 6, 7], [9, 3, 4, 8, 2, 11]], jnp.int32)
  valid = jnp.array([[False] * 3 + [True] * 3, [True] * 6])
  return tokens, valid


def _steering(alpha=0.8, gate=False):
  return st.Steering('spherical', jax.random.normal(jax.random.key(1), (32,)),
                     alpha=alpha, gate=gate, beta=-0.5)


def test_cached_decoding_equals_one_full_pass(params):
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
  apply = jax.jit(MODEL.apply)
  full, _ = apply({'params': params}, tokens)
  cache = decoder_lm.init_cache(MODEL, 2, 12)
  logits, cache = apply({'params': params}, tokens[:, :5],
                        jnp.ones((2, 5), bool), cache)
  steps = [logits]
  for i in range(5, 12):
    logits, cache = apply({'params': params}, tokens[:, i:i + 1],
                          jnp.ones((2, 1), bool), cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=2e-5)


def test_kv_cached_generation_equals_recomputation_without_steering(params):
  tokens, valid = _prompts()
  # 8 steps: test_padding_is_respected_in_steered_generation's unsteered
  # programs, compiled once for both (the equality holds at any length).
  run = lambda mode: _generate(MODEL, params, tokens, valid, 8, mode=mode)
  cached, recomputed = run('cached'), run('recompute')
  np.testing.assert_array_equal(cached.tokens, recomputed.tokens)
  np.testing.assert_allclose(cached.logits, recomputed.logits, atol=2e-5)
  # Sampling with one key agrees too.
  sample = lambda mode: _generate(
      MODEL, params, tokens, valid, 10, mode=mode, temperature=1.0,
      rng=jax.random.key(3)).tokens
  np.testing.assert_array_equal(sample('cached'), sample('recompute'))


@pytest.mark.parametrize('mode', lm_generate.MODES)
def test_padding_is_respected_in_steered_generation(params, mode):
  tokens, valid = _prompts()
  steer = _steering()
  batched = _generate(MODEL, params, tokens, valid, 8, steering=steer,
                      layer_path='block_1', mode=mode)
  alone = _generate(MODEL, params, tokens[:1, 3:], valid[:1, 3:], 8,
                    steering=steer, layer_path='block_1', mode=mode)
  np.testing.assert_array_equal(batched.tokens[0], alone.tokens[0])
  np.testing.assert_allclose(batched.logits[0], alone.logits[0], atol=2e-5)
  # Steered tokens: the last prompt token and each generated one but the
  # last, per row; padding is never counted.
  assert float(batched.stats.tokens) == 2 * 8
  plain = _generate(MODEL, params, tokens, valid, 8, mode=mode)
  assert not np.allclose(plain.logits, batched.logits, atol=1e-3)


def test_modes_differ_only_once_steered_states_enter_the_cache(params):
  tokens, valid = _prompts()
  steer = _steering()
  # 8 steps: test_padding_is_respected_in_steered_generation's steered
  # programs, compiled once for both (any length past one step shows it).
  out = {m: _generate(MODEL, params, tokens, valid, 8, steering=steer,
                      layer_path='block_1', mode=m)
         for m in lm_generate.MODES}
  # The first token comes from the same computation in both modes.
  np.testing.assert_allclose(out['cached'].logits[:, 0],
                             out['recompute'].logits[:, 0], atol=2e-5)
  # Later ones attend to steered (cached) vs unsteered (recomputed) states.
  assert not np.allclose(out['cached'].logits[:, 1:],
                         out['recompute'].logits[:, 1:], atol=1e-4)


def test_hook_steers_exactly_the_masked_outputs_of_the_layer(params):
  tokens = jax.random.randint(jax.random.key(4), (2, 9), 0, 64)
  valid = jnp.ones((2, 9), bool)
  mask = jnp.zeros((2, 9), bool).at[:, 4:].set(True)
  steer = _steering(alpha=0.5)

  @jax.jit
  def run(p):
    with steering_hooks.steered(None, None, capture=('block_1',)) as clean:
      base, _ = MODEL.apply({'params': p}, tokens, valid)
    with steering_hooks.steered(steer, 'block_1', mask,
                                capture=('block_1',)) as rec:
      logits, _ = MODEL.apply({'params': p}, tokens, valid)
    return base, logits, clean.hidden['block_1'], rec.hidden['block_1'], (
        rec.stats)

  base, logits, clean, steered, stats = run(params)
  expected, _ = jax.jit(lambda h, m: steer(h, m))(clean, mask)
  np.testing.assert_allclose(steered, expected, atol=1e-6)
  # Causal: logits before the first steered position are unchanged.
  np.testing.assert_array_equal(logits[:, :4], base[:, :4])
  assert not np.allclose(logits[:, 4:], base[:, 4:], atol=1e-3)
  assert float(stats.tokens) == 10


def test_layer_paths_and_out_of_range_layer(params):
  assert steering_hooks.layer_paths(params) == ['block_0', 'block_1',
                                                'block_2']
  # Nested models: paths below a parent module are found too.
  nested = {'encoder': {'layers_1': {'w': 1}, 'layers_0': {'w': 1}}}
  assert steering_hooks.layer_paths(nested) == ['encoder/layers_0',
                                                'encoder/layers_1']
  assert steering_hooks.resolve_layer(params, 2) == 'block_2'
  with pytest.raises(ValueError, match=r'layer=3: out of range; the model '
                     r'has 3 layers \(valid: 0..2\)'):
    steering_hooks.resolve_layer(params, 3)
  with pytest.raises(ValueError, match='layer=-1'):
    steering_hooks.resolve_layer(params, -1)


def test_generation_rejects_bad_mode_and_length(params):
  tokens, valid = _prompts()
  with pytest.raises(ValueError, match="mode='beam'.*cached, recompute"):
    lm_generate.generate(MODEL, params, tokens, valid, 4, mode='beam')
  with pytest.raises(ValueError, match='num_steps=60'):
    lm_generate.generate(MODEL, params, tokens, valid, 60)


def test_vector_file_roundtrip_and_mismatches(params, tmp_path):
  vec = steering_vectors.SteeringVector(
      np.asarray(st.unit(jnp.arange(1.0, 33.0))), 1, 'block_1',
      steering_vectors.fingerprint(params), {'method': 'mean_diff'})
  path = str(tmp_path / 'v.npz')
  steering_vectors.save(path, vec)
  assert os.listdir(tmp_path) == ['v.npz']  # No temporary file left.
  back = steering_vectors.load(path, params)
  np.testing.assert_array_equal(back.direction, vec.direction)
  assert (back.layer, back.layer_path, back.info) == (1, 'block_1',
                                                      {'method': 'mean_diff'})

  other = _init(MODEL, 9)
  with pytest.raises(ValueError, match='model_fingerprint=.*does not match'):
    steering_vectors.load(path, other)
  wider = _init(decoder_lm.DecoderLM(vocab_size=64, d_model=48, num_layers=3,
                                     num_heads=4, mlp_dim=64))
  with pytest.raises(ValueError, match="hidden_size=32 does not match the "
                     "model's 48"):
    steering_vectors.load(path, wider)
  shallow = _init(decoder_lm.DecoderLM(vocab_size=64, d_model=32,
                                       num_layers=1, num_heads=4, mlp_dim=64))
  with pytest.raises(ValueError, match="layer_path='block_1'.*not a layer"):
    steering_vectors.load(path, shallow)
  with pytest.raises(ValueError, match='direction: is zero'):
    steering_vectors.save(str(tmp_path / 'z.npz'),
                          steering_vectors.SteeringVector(
                              np.zeros(32, np.float32), 1, 'block_1', 'x'))
  assert not os.path.exists(tmp_path / 'z.npz')


def _vector_file(path, params, direction=None, drop=(), meta_bytes=None,
                 arrays=('direction', 'meta')):
  """Writes a vector file as `save` would, with the given parts replaced.

  The fingerprint always matches `params`: these files fail on their own
  contents, not on belonging to another model.
  """
  if direction is None:
    direction = _unit32()
  meta = dict(format=steering_vectors.FORMAT_VERSION, layer=1,
              layer_path='block_1', hidden_size=32,
              model_fingerprint=steering_vectors.fingerprint(params), info={})
  for field in drop:
    del meta[field]
  if meta_bytes is None:
    meta_bytes = json.dumps(meta).encode()
  contents = dict(direction=np.asarray(direction, np.float32),
                  meta=np.frombuffer(meta_bytes, np.uint8))
  np.savez(path, **{k: v for k, v in contents.items() if k in arrays})


def _unit32():
  return np.asarray(st.unit(jnp.arange(1.0, 33.0)))


def _truncate(path, params):
  _vector_file(path, params)
  data = open(path, 'rb').read()
  with open(path, 'wb') as f:
    f.write(data[:len(data) // 2])


def _flip_a_direction_byte(path, params):
  _vector_file(path, params)
  data = bytearray(open(path, 'rb').read())
  data[data.index(b'\x93NUMPY') + 140] ^= 0x40  # Inside direction's values.
  with open(path, 'wb') as f:
    f.write(bytes(data))


def _npy_not_npz(path, params):
  del params
  with open(path, 'wb') as f:
    np.save(f, _unit32())


def _write(contents):
  def write(path, params):
    del params
    with open(path, 'wb') as f:
      f.write(contents)
  return write


@pytest.mark.parametrize('make,message', [
    (lambda p, params: _vector_file(p, params, np.where(
        np.arange(32) == 5, np.nan, _unit32())),
     'direction: has 1 non-finite entries'),
    (lambda p, params: _vector_file(p, params, np.zeros(32)),
     'direction: is zero'),
    (lambda p, params: _vector_file(p, params, _unit32()[None]),
     r'direction: shape \(1, 32\): must be \(32,\), a vector of the hidden '
     'size'),
    (lambda p, params: _vector_file(p, params, _unit32()[:31] / np.linalg.norm(
        _unit32()[:31])),
     r'direction: shape \(31,\): must be \(32,\)'),
    (lambda p, params: _vector_file(p, params, 1e6 * _unit32()),
     r'direction: norm 1e\+06: must be a unit vector'),
    (_truncate, r'damaged steering vector file \(a truncated or corrupt '
     r'\.npz archive: BadZipFile'),
    (_write(b''), r'empty file \(0 bytes\), not a steering vector'),
    (_write(b'\x93NUMPY' + bytes(np.random.default_rng(0).integers(
        0, 256, 4096, dtype=np.uint8))),
     r"not a steering vector file \(not an \.npz archive; it starts with "
     r"b'\\x93NUM'\)"),
    (_npy_not_npz,
     r"not a steering vector file \(not an \.npz archive; it starts with "),
    (_flip_a_direction_byte, r'damaged steering vector file \(an array does '
     r"not read back: BadZipFile: Bad CRC-32 for file 'direction\.npy'\)"),
    (lambda p, params: _vector_file(p, params, drop=('layer',)),
     'meta: missing layer'),
    (lambda p, params: _vector_file(p, params, meta_bytes=b'{"layer": 1,'),
     r'damaged steering vector file \(meta is not JSON'),
    (lambda p, params: _vector_file(p, params, arrays=('direction',)),
     r'not a steering vector file: missing meta \(it has \[.direction.\]\)'),
], ids=['nan', 'zero', '2d', 'wrong_hidden_size', 'scaled_1e6', 'truncated',
        'empty', 'garbage', 'npy_not_npz', 'flipped_byte',
        'missing_meta_field', 'meta_not_json', 'missing_array'])
def test_damaged_or_invalid_vector_file_is_one_value_error(params, tmp_path,
                                                          make, message):
  path = str(tmp_path / 'v.npz')
  make(path, params)
  # Whether or not the caller passes the model, the file is checked.
  for model in (params, None):
    with pytest.raises(ValueError) as caught:
      steering_vectors.load(path, model)
    assert caught.type is ValueError  # Not BadZipFile, EOFError, KeyError.
    text = str(caught.value)
    assert '\n' not in text
    assert re.match(re.escape(path) + ': ' + message, text), text


def test_a_file_stating_a_huge_array_is_refused_before_reading_it(
    params, tmp_path):
  # Its header states 2**28 floats (1 GiB); the data is 64 bytes. The
  # array was allocated whole before any check.
  path = str(tmp_path / 'v.npz')
  _vector_file(path, params)
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(header, {
      'descr': '<f4', 'fortran_order': False, 'shape': (1 << 28,)})
  with zipfile.ZipFile(path) as f:
    meta = f.read('meta.npy')
  with zipfile.ZipFile(path, 'w') as f:
    f.writestr('direction.npy', header.getvalue() + bytes(64))
    f.writestr('meta.npy', meta)
  tracemalloc.start()
  try:
    with pytest.raises(ValueError) as caught:
      steering_vectors.load(path, params)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert str(caught.value) == (
      f'{path}: not a steering vector file: direction has shape '
      '(268435456,), more than 1048576 elements')
  assert peak < 16 << 20, peak


def test_save_refuses_a_direction_load_would_refuse(params, tmp_path):
  path = str(tmp_path / 'v.npz')
  fp = steering_vectors.fingerprint(params)
  with pytest.raises(ValueError, match=r'direction: norm 3: must be a unit'):
    steering_vectors.save(path, steering_vectors.SteeringVector(
        3 * _unit32(), 1, 'block_1', fp))
  with pytest.raises(ValueError, match=r'direction: shape \(2, 32\)'):
    steering_vectors.save(path, steering_vectors.SteeringVector(
        np.stack([_unit32()] * 2), 1, 'block_1', fp))
  assert not os.listdir(tmp_path)
  # What save writes, load reads back unchanged.
  _vector_file(path, params)
  steering_vectors.save(path, steering_vectors.load(path, params))
  np.testing.assert_array_equal(steering_vectors.load(path).direction,
                                _unit32())


def test_multiple_choice_scores_equal_a_direct_computation(params):
  model = decoder_lm.DecoderLM(vocab_size=256, d_model=32, num_layers=2,
                               num_heads=4, mlp_dim=64, max_len=256)
  p = jax.jit(model.init)(jax.random.key(5),
                          jnp.zeros((1, 4), jnp.int32))['params']
  items = text_corpus.mc_task('cloze', 3, seed=0)
  batch = scoring.encode_mc(items)
  steer = st.Steering('spherical', jax.random.normal(jax.random.key(6), (32,)),
                      alpha=0.5, gate=False)
  total, mean, stats = scoring.MCScorer(model, p, batch,
                                       'block_0').logprobs(steer)

  @jax.jit
  def row_logits(seq, mask):
    with steering_hooks.steered(steer, 'block_0', mask):
      return model.apply({'params': p}, seq)[0]

  for i, item in enumerate(items):
    ctx = np.concatenate([[text_corpus.BOS],
                          text_corpus.encode(item.prefix())])
    for c, choice in enumerate(item.choices):
      ans = text_corpus.encode(choice)
      n = len(ctx) + len(ans)
      # One row alone, padded on the right to one length (one compile):
      # causal, so the padding cannot reach positions before it.
      seq = np.zeros((1, 200), np.int32)
      seq[0, :n] = np.concatenate([ctx, ans])
      mask = np.zeros((1, 200), bool)
      mask[0, len(ctx) - 1:n] = True
      logits = np.asarray(row_logits(jnp.asarray(seq), jnp.asarray(mask)),
                          np.float64)[0, len(ctx) - 1:n - 1]
      logp = scipy.special.log_softmax(logits, -1)
      ref = float(np.sum(logp[np.arange(len(ans)), ans]))
      np.testing.assert_allclose(total[i, c], ref, rtol=1e-5)
      np.testing.assert_allclose(mean[i, c], ref / len(ans), rtol=1e-5)
  # Steered: the last context byte and every choice byte, per row.
  assert float(stats.tokens) == sum(
      len(text_corpus.encode(c)) + 1 for it in items for c in it.choices)


def test_hooks_steer_a_model_they_were_not_written_for():

  class Stack(nn.Module):
    """Flax's usual list-of-layers naming: layers_0, layers_1, ..."""

    def setup(self):
      self.layers = [nn.Dense(8) for _ in range(3)]

    def __call__(self, x):
      for layer in self.layers:
        x = nn.tanh(layer(x))
      return x

  model = Stack()
  x = jax.random.normal(jax.random.key(7), (4, 5, 8))
  p = model.init(jax.random.key(8), x)['params']
  path = steering_hooks.resolve_layer(p, 1)
  assert path == 'layers_1'
  steer = st.Steering('addition', jnp.ones(8), alpha=1.0, coefficient=0.5)
  with steering_hooks.steered(steer, path, None):
    out = model.apply({'params': p}, x)
  # By hand: the second Dense's output shifted, then the rest of the stack.
  h = nn.tanh(nn.Dense(8).apply({'params': p['layers_0']}, x))
  h = nn.Dense(8).apply({'params': p['layers_1']}, h) + 0.5 * st.unit(
      jnp.ones(8))
  h = nn.tanh(nn.Dense(8).apply({'params': p['layers_2']}, nn.tanh(h)))
  np.testing.assert_allclose(out, h, atol=1e-6)


def test_generation_ce_under_the_unsteered_model_equals_a_direct_computation(
    params):
  """gen_ce: the unsteered model's cross-entropy of steered generations,
  against scoring each row alone, unpadded, token by token; steering
  changes the texts and so their CE."""
  tokens, valid = _prompts()
  steer = _steering(alpha=0.9)
  out = generations.generation_metrics(
      MODEL, params, (tokens, valid), steer, 'block_1', 7, 1.0, seed=4,
      tokenizer=_VocabTokenizer())
  gen = _generate(MODEL, params, tokens, valid, 7, steering=steer,
                  layer_path='block_1', temperature=1.0,
                  rng=jax.random.key(4)).tokens
  log_probs = jax.jit(lambda p, seq: jax.nn.log_softmax(
      MODEL.apply({'params': p}, seq)[0][0]))
  nll = []
  for row in range(2):
    prompt = np.asarray(tokens[row])[np.asarray(valid[row])]
    seq = np.concatenate([prompt, np.asarray(gen[row])])
    logp = np.asarray(log_probs(params, jnp.asarray(seq[None])))
    for i in range(len(prompt), len(seq)):
      nll.append(-logp[i - 1, seq[i]])
  np.testing.assert_allclose(out['gen_ce'], np.mean(nll), rtol=1e-5)
  plain = generations.generation_metrics(
      MODEL, params, (tokens, valid), None, 'block_1', 7, 1.0, seed=4,
      tokenizer=_VocabTokenizer())
  assert plain['gen_ce'] != out['gen_ce']


class _VocabTokenizer:
  """Decodes this test model's 64 ids as letters (for the text measures)."""
  kind = 'test'

  def decode(self, ids):
    return ' '.join(chr(97 + int(i) % 26) for i in ids)


def test_results_table_has_one_ce_column_per_source_and_the_generations_last():
  row = {'method': 'spherical_gate', 'alpha': 0.5, 'cloze_acc_sum': 0.5,
         'cloze_acc_mean': 0.25, 'kl': 0.3, 'trigger_rate': 0.6,
         'positive_share': 0.7, 'distinct_2': 0.4, 'repetition_3': 0.01,
         'gen_ce': 1.234}
  for source, ce in (('reviews', 0.25), ('fortunes', 1.5)):
    row.update({f'{source}_kl': 0.3, f'{source}_ce': ce,
                f'{source}_norm_ratio_at': 1.0,
                f'{source}_norm_ratio_next': 0.9,
                f'{source}_norm_ratio_last': 0.8})
  head, _, line = steering_eval.markdown_table([row], ['cloze']).splitlines()
  cols = [c.strip() for c in head.strip('|').split('|')]
  cells = [c.strip() for c in line.strip('|').split('|')]
  assert len(cols) == len(cells)
  assert [c for c in cols if c.endswith(' CE')] == ['fortunes CE',
                                                     'reviews CE']
  got = dict(zip(cols, cells))
  assert got['fortunes CE'] == '1.5000' and got['reviews CE'] == '0.2500'
  assert got['generations CE (unsteered model)'] == '1.234'
  assert got['cloze acc (sum / mean)'] == '0.500 / 0.250'
