"""The GGUF loader on small files written here (the real file's checks are in
test_gemma_reference.py): every tensor lands where Gemma3 reads it, with
its layout and the norms' offset, quantized tensors decode, and each kind of
bad file is refused in one line naming the problem."""

import dataclasses
import struct

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gemma as gemma_configs
from studies.gemma_steering import layers as gemma_study
from train import errors
from train.training import host_devices
from train.lm import gemma
from train.lm import gemma_gguf
from train.lm import gguf_file
from train.lm import models
from train.lm import trainer as lm_trainer
from tests import launch_runs
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
  # The loaded tree is the one Gemma3 initialises, and runs. (Its shapes
  # traced, and the forward jitted: op by op, the initialisation and the
  # forward cost 5 s of one-op compiles.)
  model = gemma.Gemma3(loaded.shape, max_len=8)
  init = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                           jnp.zeros((1, 3), jnp.int32)))
  unboxed = jax.tree.map(lambda b: b.value, init['params'],
                         is_leaf=lambda b: hasattr(b, 'value'))
  shapes = lambda tree: jax.tree.map(lambda a: tuple(np.shape(a)), tree)
  assert shapes(unboxed) == shapes(p)
  logits, _ = jax.jit(model.apply)({'params': p},
                                   jnp.asarray([[2, 270, 271]]))
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


# --- A model file is untrusted input: each bound at its limit and one past.
_U8, _U32, _I32, _F32, _BOOL, _U64 = 0, 4, 5, 6, 7, 10
_STR, _ARR = tiny_gemma.STRING, tiny_gemma.ARRAY


def _write_bytes(tmp_path, data: bytes, name: str = 'x.gguf') -> str:
  path = tmp_path / name
  path.write_bytes(data)
  return str(path)


def _bare(tmp_path, fields=(), tensors=(), data=b'', name='x.gguf',
          **counts) -> str:
  """A file of just `fields` and `tensors`; with no tensors, unpadded (so
  the bytes after the metadata are exactly `data`)."""
  parts = tiny_gemma.Layout(list(fields), list(tensors), data)
  return _write_bytes(tmp_path, tiny_gemma.to_bytes(
      parts, alignment=32 if tensors else 1, **counts), name)


def _refused(path: str, *expect: str) -> str:
  with pytest.raises(errors.DamagedModelFile) as e:
    gemma_gguf.check_file(path)
  message = str(e.value)
  assert '\n' not in message and path in message, message
  for text in expect:
    assert text in message, message
  return message


def _parse_refused(path: str, *expect: str) -> None:
  with pytest.raises(gguf_file.GGUFFormatError) as e:
    gguf_file.read(path)
  for text in expect:
    assert text in str(e.value), str(e.value)


@pytest.mark.parametrize('limit, make, expect', [
    (gguf_file.MAX_NESTING,
     lambda n: [('a', _ARR, tiny_gemma.nested(n))], 'nested deeper than 4'),
    (gguf_file.MAX_ARRAY_LENGTH,
     lambda n: [('a', _ARR, struct.pack('<IQ', _U8, n) + bytes(n))],
     'more than the limit 16777216'),
    (gguf_file.MAX_ARRAYS_IN_ARRAY,
     lambda n: [('a', _ARR, struct.pack('<IQ', _ARR, n)
                 + struct.pack('<IQ', _U8, 0) * n)],
     'more than the limit 65536'),
    (gguf_file.MAX_FIELDS,
     lambda n: [(f'k{i}', _U8, 0) for i in range(n)],
     'metadata count: 16385'),
])
def test_metadata_bounds_at_the_limit_and_one_past(tmp_path, limit, make,
                                                   expect):
  gguf_file.read(_bare(tmp_path, make(limit), name='at.gguf'))
  _parse_refused(_bare(tmp_path, make(limit + 1), name='past.gguf'), expect)


def test_deep_nesting_is_refused_without_recursing(tmp_path):
  _parse_refused(_bare(tmp_path, [('a', _ARR, tiny_gemma.nested(5000))]),
                 'nested deeper than 4')


@pytest.mark.parametrize('item, width', [(_U32, 4), (_STR, 8), (_ARR, 12)])
def test_an_array_length_is_bounded_by_the_bytes_left(tmp_path, item, width):
  # Empty strings and arrays: the fewest bytes an element takes.
  element = {_U32: bytes(4), _STR: bytes(8),
             _ARR: struct.pack('<IQ', _U8, 0)}[item]
  body = lambda n: [('a', _ARR, struct.pack('<IQ', item, n) + element * 3)]
  gguf_file.read(_bare(tmp_path, body(3), name='at.gguf'))
  _parse_refused(_bare(tmp_path, body(4), name='past.gguf'),
                 f'need at least {4 * width} bytes, past the end')


@pytest.mark.parametrize('limit, make, expect', [
    (gguf_file.MAX_TENSORS, lambda n: [(f't{i}', (0,), 0, 0)
                                       for i in range(n)],
     'tensor count: 16385'),
    (gguf_file.MAX_DIMS, lambda n: [('t', (1,) * n, 0, 0)], '5 dims'),
    (gguf_file.MAX_TENSOR_NAME_BYTES, lambda n: [('x' * n, (0,), 0, 0)],
     'longer than 63 bytes'),
])
def test_tensor_bounds_at_the_limit_and_one_past(tmp_path, limit, make,
                                                 expect):
  gguf_file.read(_bare(tmp_path, tensors=make(limit), data=bytes(4),
                       name='at.gguf'))
  _parse_refused(_bare(tmp_path, tensors=make(limit + 1), data=bytes(4),
                       name='past.gguf'), expect)


@pytest.mark.parametrize('dims', [(2**32, 2**32), (2**63,), (2**64 - 1, 2)])
def test_a_dimension_product_does_not_wrap(tmp_path, dims):
  # In int64, 2**32 * 2**32 is 0: a tensor of no bytes.
  _parse_refused(_bare(tmp_path, tensors=[('t', dims, 0, 0)], data=bytes(64)),
                 'truncated: tensor \'t\'')


def test_a_repeated_key_tensor_or_misaligned_offset_is_refused(tmp_path):
  _parse_refused(_bare(tmp_path, [('k', _U8, 0), ('k', _U8, 1)],
                       name='key.gguf'), "metadata 'k' appears twice")
  _parse_refused(_bare(tmp_path, tensors=[('t', (1,), 0, 0)] * 2,
                       data=bytes(4), name='tensor.gguf'),
                 "tensor 't' appears twice")
  _parse_refused(_bare(tmp_path, tensors=[('t', (1,), 0, 4)], data=bytes(64),
                       name='offset.gguf'),
                 'offset 4 is not a multiple of the alignment 32')


def _parts(tmp_path) -> tiny_gemma.Layout:
  return tiny_gemma.layout(tiny_gemma.model_file(tmp_path / 'm.gguf'))


@pytest.mark.parametrize('kind, value, ok', [
    (_U32, 1, True), (_U32, 16, True), (_U64, 32, True),
    (_U32, 0, False), (_U32, 3, False), (_I32, -32, False),
    (_STR, '32', False), (_F32, 32.0, False), (_BOOL, True, False),
])
def test_alignment_is_an_integer_power_of_two(tmp_path, kind, value, ok):
  parts = tiny_gemma.set_field(_parts(tmp_path), 'general.alignment', kind,
                               value)
  path = _write_bytes(tmp_path, tiny_gemma.to_bytes(
      parts, alignment=value if ok else 32))
  if ok:
    assert gemma_gguf.load(path).shape.num_layers == 2
  else:
    _refused(path, 'general.alignment', 'power of two' if kind in (_U32, _I32)
             else 'is not an integer')


def _with(tmp_path, key: str, kind: int, value) -> str:
  parts = tiny_gemma.set_field(_parts(tmp_path), key, kind, value)
  return _write_bytes(tmp_path, tiny_gemma.to_bytes(parts),
                      f'{key}-{kind}-{value}.gguf'[:60])


def test_the_layer_count_is_bounded_by_the_tensors_present(tmp_path):
  # 28 tensors: 2 for the embedding and final norm, 13 a layer.
  assert gemma_gguf.check_file(_with(tmp_path, 'gemma3.block_count', _U32,
                                     2)).shape.num_layers == 2
  for layers in (3, 10**9):
    _refused(_with(tmp_path, 'gemma3.block_count', _U32, layers),
             f'gemma3.block_count={layers} needs 13 tensors a layer; the '
             'file holds 28 tensors')


@pytest.mark.parametrize('key, kind, value, expect', [
    ('block_count', _U32, 0, 'block_count=0 is not a positive integer'),
    ('attention.head_count', _U32, 0, 'head_count=0 is not a positive'),
    ('attention.head_count_kv', _U32, 0, 'head_count_kv=0 is not a positive'),
    ('embedding_length', _I32, -1, 'embedding_length=-1 is not a positive'),
    ('block_count', _STR, '2', "block_count='2' is not an integer"),
    ('block_count', _F32, 2.0, 'block_count=2.0 is not an integer'),
    ('block_count', _BOOL, True, 'block_count=True is not an integer'),
    ('feed_forward_length', _ARR, (_U32, [64]),
     'feed_forward_length=array([64], dtype=uint32) is not an integer'),
    ('attention.head_count_kv', _U32, 3, 'head_count=2 is not divisible by '
     'head_count_kv=3'),
    ('attention.sliding_window', _U64, 2**31,
     'sliding_window=2147483648 is not a positive integer of at most '
     '2147483647'),
    ('rope.freq_base', _F32, float('nan'), 'freq_base=nan is outside'),
    ('rope.freq_base', _F32, 0.0, 'freq_base=0.0 is outside'),
    ('rope.freq_base', _STR, 'x', "freq_base='x' is not a number"),
    ('attention.layer_norm_rms_epsilon', _F32, 1.0,
     'layer_norm_rms_epsilon=1.0 is outside (0, 1.0)'),
])
def test_the_shape_metadata_is_checked(tmp_path, key, kind, value, expect):
  _refused(_with(tmp_path, f'gemma3.{key}', kind, value), expect)


def test_shape_bounds_at_the_limit(tmp_path):
  window = gemma_gguf.check_file(_with(
      tmp_path, 'gemma3.attention.sliding_window', _U64,
      gemma_gguf.MAX_SLIDING_WINDOW))
  assert window.shape.sliding_window == 2**31 - 1
  eps = gemma_gguf.check_file(_with(
      tmp_path, 'gemma3.attention.layer_norm_rms_epsilon', _F32, 0.5))
  assert eps.shape.rms_eps == 0.5


def test_the_decoded_size_is_bounded_by_memory(tmp_path, monkeypatch):
  path = tiny_gemma.model_file(tmp_path / 'm.gguf')
  tensors = gguf_file.read(path).tensors
  decoded = 4 * sum(x.data.size // 4 for x in tensors.values())  # float32.
  monkeypatch.setattr(host_devices, 'host_memory_bytes', lambda: 2 * decoded)
  assert gemma_gguf.load(path).shape.num_layers == 2
  monkeypatch.setattr(host_devices, 'host_memory_bytes',
                      lambda: 2 * decoded - 2)
  gemma_gguf.check_file(path)  # The shape alone (compiling) needs no memory.
  # A new file: `load` caches the last one.
  path = tiny_gemma.model_file(tmp_path / 'again.gguf')
  with pytest.raises(errors.DamagedModelFile, match='more than half of this '
                     'host\'s memory'):
    gemma_gguf.load(path)
  config = tiny_gemma.gemma_config(path, 'finetune')
  with pytest.raises(errors.DamagedModelFile, match='more than half'):
    models.check_inputs(config)


@pytest.mark.parametrize('key, kind, value', [
    ('tokenizer.ggml.tokens', _ARR, (_U32, [1, 2])),
    ('tokenizer.ggml.token_type', _ARR, (_I32, [9] * 300)),
    ('tokenizer.ggml.scores', _ARR, (_STR, ['a'] * 300)),
    ('tokenizer.ggml.bos_token_id', _STR, '2'),
    ('tokenizer.ggml.model', _U32, 1),
    ('tokenizer.ggml.add_space_prefix', _ARR, (_U8, [1, 0])),
])
def test_tokenizer_metadata_of_the_wrong_type_is_refused(tmp_path, key, kind,
                                                         value):
  _refused(_with(tmp_path, key, kind, value), key)


# --- Refused before the run or study touches its workdir.
@pytest.mark.parametrize('damage, model_shape, expect', [
    ('missing', 'gguf', "missing ['blk.1.ffn_up.weight']"),
    ('missing', '270m', "missing ['blk.1.ffn_up.weight']"),
    ('zero_heads', 'gguf', 'head_count=0 is not a positive integer'),
])
def test_a_damaged_file_is_refused_before_the_workdir(tmp_path, damage,
                                                      model_shape, expect):
  t = _tensors(np.random.default_rng(7))
  shape = SHAPE
  if damage == 'missing':
    del t['blk.1.ffn_up.weight']
  else:
    shape = dataclasses.replace(SHAPE, num_heads=0)
  path = _write(tmp_path / 'bad.gguf', t, shape)
  config = tiny_gemma.gemma_config(path, 'finetune')
  config.model.shape = model_shape
  config.batch_size = config.eval_batch_size = 8  # 8 simulated devices.
  workdir = tmp_path / 'w'
  with pytest.raises(errors.DamagedModelFile) as e:
    lm_trainer.build(config, str(workdir))
  assert expect in str(e.value)
  assert not workdir.exists()


def test_the_steering_study_refuses_deep_nesting_before_its_workdir(tmp_path):
  parts = tiny_gemma.set_field(_parts(tmp_path), 'general.tags', _ARR,
                               tiny_gemma.nested(5000))
  path = _write_bytes(tmp_path, tiny_gemma.to_bytes(parts))
  config = gemma_configs.get_config('runlocal')
  config.gguf, config.shape = path, 'gguf'
  workdir = tmp_path / 'w'
  with pytest.raises(errors.DamagedModelFile, match='nested deeper than 4'):
    gemma_study.run(config, str(workdir), [0.1])
  assert not workdir.exists()


def test_launch_train_refuses_a_billion_layers_in_one_line(tmp_path):
  path = _write(tmp_path / 'big.gguf', _tensors(np.random.default_rng(8)),
                dataclasses.replace(SHAPE, num_layers=10**9))
  workdir = tmp_path / 'w'
  result, peak = launch_runs.run_measured(launch_runs.command(
      str(workdir), f'--config.model.gguf={path}',
      '--config.model.shape=gguf',
      config='configs/gemma.py:finetune,runlocal'), timeout=120)
  assert result.returncode == errors.DamagedModelFile.exit_code, (
      result.stderr[-2000:])
  lines = launch_runs.error_lines(result)
  assert len(lines) == 1, lines
  assert (f'error: cannot load the model file {path}: metadata '
          'gemma3.block_count=1000000000 needs 13 tensors a layer; the file '
          'holds 28 tensors') == lines[0]
  assert not workdir.exists()
  assert peak < 2**30, peak
