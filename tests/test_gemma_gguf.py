"""The GGUF loader on small files written here (the real file's checks are in
test_gemma_reference.py): every tensor lands where Gemma3 reads it, with
its layout and the norms' offset, quantized tensors decode, and each kind of
bad file is refused in one line naming the problem."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import errors
from train.lm import gemma
from train.lm import gemma_gguf
from train.lm import gguf_file
from tests import tiny_gemma

SHAPE = tiny_gemma.SHAPE
_tensors = tiny_gemma.tensors
_write = tiny_gemma.write


def test_every_tensor_lands_in_place_with_the_norm_offset(tmp_path):
  t = _tensors(np.random.default_rng(0))
  loaded = gemma_gguf.load(_write(tmp_path / 'm.gguf', t))
  assert loaded.shape == dataclasses.replace(SHAPE, global_every=6,
                                             rms_eps=loaded.shape.rms_eps)
  p = loaded.params
  d, h, hd = SHAPE.d_model, SHAPE.num_heads, SHAPE.head_dim
  np.testing.assert_array_equal(p['embedding'], t['token_embd.weight'])
  np.testing.assert_allclose(p['final_norm']['scale'] + 1,
                             t['output_norm.weight'], rtol=1e-6)
  a = p['block_1']['attention']
  # q = x @ W_q.T: row j of W_q is head j // hd, dim j % hd.
  x = np.random.default_rng(1).standard_normal(d).astype(np.float32)
  np.testing.assert_allclose(np.einsum('d,dhk->hk', x, a['query']),
                             (t['blk.1.attn_q.weight'] @ x).reshape(h, hd),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      np.einsum('hk,hkd->d', (t['blk.1.attn_q.weight'] @ x).reshape(h, hd),
                a['out']),
      t['blk.1.attn_output.weight'] @ (t['blk.1.attn_q.weight'] @ x),
      rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(p['block_0']['mlp']['down'],
                                t['blk.0.ffn_down.weight'].T)
  np.testing.assert_allclose(a['key_norm']['scale'] + 1,
                             t['blk.1.attn_k_norm.weight'], rtol=1e-6)
  # The loaded tree is the one Gemma3 initialises, and runs.
  model = gemma.Gemma3(loaded.shape, max_len=8)
  init = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
  unboxed = jax.tree.map(lambda b: b.value, init['params'],
                         is_leaf=lambda b: hasattr(b, 'value'))
  assert (jax.tree.map(np.shape, unboxed) == jax.tree.map(np.shape, p))
  logits, _ = model.apply({'params': p}, jnp.asarray([[2, 270, 271]]))
  assert logits.shape == (1, 3, 300) and bool(jnp.all(jnp.isfinite(logits)))


def test_the_parser_reads_what_llama_cpps_reader_reads(tmp_path):
  t = _tensors(np.random.default_rng(6))
  path = _write(tmp_path / 'm.gguf', t, quantize=('blk.0.ffn_up.weight',))
  ours = gguf_file.read(path)
  theirs = gguf.GGUFReader(path)
  assert set(ours.fields) == set(theirs.fields) - {
      'GGUF.version', 'GGUF.tensor_count', 'GGUF.kv_count'}
  for key, field in theirs.fields.items():
    if key.startswith('GGUF.'):
      continue
    want = field.contents()
    got = ours.fields[key]
    if isinstance(got, np.ndarray):
      np.testing.assert_array_equal(got, np.asarray(want), err_msg=key)
    else:
      assert got == want, key
  assert [x.name for x in theirs.tensors] == list(ours.tensors)
  for x in theirs.tensors:
    mine = ours.tensors[x.name]
    assert mine.ggml_type == int(x.tensor_type)
    assert mine.dims == tuple(int(n) for n in x.shape)
    np.testing.assert_array_equal(
        gguf_file.dequantize(mine), np.asarray(gguf.quants.dequantize(
            x.data, x.tensor_type)).reshape(mine.shape))


def test_quantized_tensors_decode_within_their_rounding(tmp_path):
  t = _tensors(np.random.default_rng(2))
  names = ('token_embd.weight', 'blk.0.ffn_up.weight')
  loaded = gemma_gguf.load(_write(tmp_path / 'q.gguf', t, quantize=names))
  up = loaded.params['block_0']['mlp']['up'].T
  emb = loaded.params['embedding']
  for got, want in ((emb, t[names[0]]), (up, t[names[1]])):
    err = np.abs(got - want)
    # Q8_0: 32-value blocks, int8 steps of d = max|x| / 127 with d stored
    # in float16 (so up to 127 d 2^-11 more than half a step).
    step = np.abs(want.reshape(-1, 32)).max(1) / 127
    assert np.all(err.reshape(-1, 32) <= step[:, None] * (0.5 + 127 / 2048))
    assert err.max() > 0  # Quantized, not stored as float.


def test_bfloat16_parameters(tmp_path):
  t = _tensors(np.random.default_rng(3))
  loaded = gemma_gguf.load(_write(tmp_path / 'm.gguf', t), dtype='bfloat16')
  assert {str(x.dtype) for x in jax.tree.leaves(loaded.params)} == {'bfloat16'}


@pytest.mark.parametrize('damage, expect', [
    ('missing', 'missing [\'blk.1.ffn_up.weight\']'),
    ('extra', 'unexpected [\'blk.2.attn_q.weight\']'),
    ('shape', 'tensor blk.0.attn_k.weight has shape (32, 32), expected '
              '(16, 32)'),
    ('arch', "general.architecture='llama'"),
    ('meta', "metadata 'gemma3.attention.sliding_window' is missing"),
    ('nan', 'tensor blk.0.ffn_gate.weight holds non-finite values'),
    ('truncated', 'not a readable GGUF file'),
    ('untied', 'an untied output.weight'),
])
def test_a_bad_file_is_one_line_naming_the_problem(tmp_path, damage, expect):
  t = _tensors(np.random.default_rng(4))
  kwargs = {}
  if damage == 'missing':
    del t['blk.1.ffn_up.weight']
  elif damage == 'extra':
    t['blk.2.attn_q.weight'] = t['blk.1.attn_q.weight']
  elif damage == 'shape':
    t['blk.0.attn_k.weight'] = np.zeros((32, 32), np.float32)
  elif damage == 'arch':
    kwargs['arch'] = 'llama'
  elif damage == 'meta':
    kwargs['skip_meta'] = ('attention.sliding_window',)
  elif damage == 'nan':
    t['blk.0.ffn_gate.weight'][3, 4] = np.nan
  elif damage == 'untied':
    t['output.weight'] = t['token_embd.weight']
  path = _write(tmp_path / 'bad.gguf', t, **kwargs)
  if damage == 'truncated':
    data = open(path, 'rb').read()
    with open(path, 'wb') as f:
      f.write(data[:len(data) - 1000])
  with pytest.raises(errors.DamagedModelFile) as e:
    gemma_gguf.load(path)
  message = str(e.value)
  assert expect in message, message
  assert path in message and '\n' not in message
  assert errors.DamagedModelFile.exit_code == 6


def test_a_missing_file_names_the_path(tmp_path):
  with pytest.raises(errors.UsageError, match='no such file'):
    gemma_gguf.load(str(tmp_path / 'none.gguf'))


def test_the_tokenizer_round_trips_with_byte_fallback(tmp_path):
  loaded = gemma_gguf.load(_write(tmp_path / 'm.gguf',
                                  _tensors(np.random.default_rng(5))))
  tok = loaded.tokenizer
  # BPE merges the best-scored pair first: in ' abc', '▁a' (score -4)
  # before 'ab' (-5), then '▁ab' (-6), and '▁ab' + 'c' is no piece; alone,
  # 'abc' merges to 'ab' and then 'abc' (-7).
  pieces = lambda s: [tok.piece(i) for i in tok.encode(s)]
  assert pieces('ab abc') == ['ab', '▁ab', 'c']
  assert pieces('abc') == ['abc']
  assert pieces('b\na') == ['b', '\n', 'a']  # '\n' is user-defined.
  text = 'ab ☃ é\n'
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert any(tok.piece(i).startswith('<0x') for i in ids)
  assert tok.encode_document('a')[0] == 2


def test_a_file_is_decoded_once_and_again_when_it_changes(tmp_path):
  path = tiny_gemma.model_file(tmp_path / 'm.gguf', seed=0)
  first = gemma_gguf.load(path)
  assert gemma_gguf.load(path) is first
  # Shared between callers, so no caller may change it.
  with pytest.raises(ValueError, match='read-only'):
    first.params['embedding'][0, 0] = 1.0
  assert gemma_gguf.load(path, dtype='bfloat16') is not first
  tiny_gemma.model_file(path, seed=1)  # Rewritten in place.
  again = gemma_gguf.load(path)
  assert not np.array_equal(again.params['embedding'],
                            first.params['embedding'])
  assert again.sha256 != first.sha256
