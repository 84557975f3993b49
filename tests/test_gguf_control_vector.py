"""Steering directions as llama.cpp control vectors (train.steering.gguf_export).

Checked here, without llama.cpp itself (tests/gemma_reference/
record_llama_cpp.py records what llama.cpp does with an exported vector):

- the file reads back through this repository's GGUF reader and through
  llama.cpp's own Python reader (`gguf.GGUFReader`) with repeng's
  architecture, keys, types and tensor names, float32, one dimension;
- the stored values are, bit for bit, what geom's addition adds at the
  same (alpha, coefficient);
- the layer numbers: llama.cpp's loader and applier, transcribed from
  their source (`_llama_cpp_additions`), add each stored vector after the
  very block of this repository's Gemma that geom's addition steers, and
  the logits agree; a vector one block off moves them;
- a failure mid-write leaves no partial file and an existing file as it was;
- every bad input and flag is refused before anything is written or
  loaded, naming the argument or flag;
- `launch.steer_eval --export_gguf` on the tests' small Gemma file writes
  the direction the evaluation used, at the strength asked for.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import gguf
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import gemma as gemma_config
from geom import steering as steering_lib
from train.errors import UsageError
from train.lm import gemma
from train.lm import gemma_gguf
from train.lm import gguf_file
from train.lm import interface
from train.steering import gguf_export
from train.steering import vectors as steering_vectors

from tests import tiny_gemma
from tests.conftest import REPO_ROOT

HIDDEN, LAYERS = 8, 5


def _directions(blocks=(1, 3), seed=0, size=HIDDEN):
  rng = np.random.default_rng(seed)
  return {b: rng.standard_normal(size) for b in blocks}


def _write(path, directions=None, **overrides):
  kwargs = dict(model_hint='gemma3', hidden_size=HIDDEN, num_layers=LAYERS,
                alpha=0.3, coefficient={1: 2.5, 3: 40.0})
  kwargs.update(overrides)
  return gguf_export.control_vector(
      str(path), _directions() if directions is None else directions,
      **kwargs)


def _geom_addition(direction, alpha, coefficient):
  """What geom's addition adds to a hidden state: its output on zeros."""
  steer = steering_lib.Steering('addition', jnp.asarray(direction,
                                                        jnp.float32),
                                alpha=alpha, coefficient=coefficient)
  return np.asarray(steer(jnp.zeros((1, len(direction)), jnp.float32))[0][0])


def test_round_trip_through_this_repositorys_reader(tmp_path):
  path = tmp_path / 'v.gguf'
  written = _write(path)
  read = gguf_export.read_control_vector(str(path))
  assert (read.model_hint, read.layer_count, list(read.vectors)) == (
      'gemma3', 2, [1, 3])
  raw = gguf_file.read(str(path))
  assert raw.fields == {'general.architecture': 'controlvector',
                        'controlvector.model_hint': 'gemma3',
                        'controlvector.layer_count': 2}
  assert sorted(raw.tensors) == ['direction.1', 'direction.3']
  for block, direction in _directions().items():
    tensor = raw.tensors[f'direction.{block}']
    assert (tensor.ggml_type, tensor.dims) == (0, (HIDDEN,))  # F32, 1-D.
    assert read.vectors[block].dtype == np.float32
    coefficient = {1: 2.5, 3: 40.0}[block]
    want = _geom_addition(direction, 0.3, coefficient)
    np.testing.assert_array_equal(read.vectors[block], want)
    np.testing.assert_array_equal(written.vectors[block], want)
    assert np.linalg.norm(want) == pytest.approx(0.3 * coefficient, rel=1e-6)


def test_llama_cpps_own_reader_reads_what_repeng_writes(tmp_path):
  path = tmp_path / 'v.gguf'
  written = _write(path)
  reader = gguf.GGUFReader(str(path))
  kinds = gguf.GGUFValueType
  fields = {k: ([int(t) for t in f.types], f.contents())
            for k, f in reader.fields.items() if not k.startswith('GGUF.')}
  # repeng: GGUFWriter(path, 'controlvector'), add_string(model_hint),
  # add_uint32(layer_count, len(directions)), add_tensor('direction.<i>').
  assert fields == {
      'general.architecture': ([kinds.STRING], 'controlvector'),
      'controlvector.model_hint': ([kinds.STRING], 'gemma3'),
      'controlvector.layer_count': ([kinds.UINT32], 2)}
  tensors = {t.name: t for t in reader.tensors}
  assert list(tensors) == ['direction.1', 'direction.3']
  for block, tensor in tensors.items():
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
    assert [int(n) for n in tensor.shape] == [HIDDEN]
    np.testing.assert_array_equal(tensor.data,
                                  written.vectors[int(block[10:])])


def _llama_cpp_additions(path, n_layer, n_embd, strength=1.0):
  """{il: vector} that llama.cpp adds after block il, from the file at
  `path` read by llama.cpp's Python reader, as its C++ does it:
  common_control_vector_load_one puts direction.N (N >= 1, F32, 1-D) times
  the strength at offset n_embd * (N - 1) of a buffer; common_init_from_
  params applies it over layers [1, n_layer]; llama_adapter_cvec::apply
  fills tensors[il], il = 1 .. n_layer - 1, from offset n_embd * (il - 1)
  (no tensor for layer 0); the graph adds tensors[il] to block il's output
  (build_cvec(cur, il) before `l_out`). Blocks given zeros are left out."""
  buffer = np.zeros(0, np.float32)
  for tensor in gguf.GGUFReader(str(path)).tensors:
    prefix, _, index = tensor.name.partition('.')
    layer_idx = int(index) if prefix == 'direction' else -1
    assert layer_idx > 0, f'llama.cpp refuses {tensor.name}'
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
    assert len(tensor.shape) == 1 and int(tensor.shape[0]) == n_embd
    buffer = np.pad(buffer, (0, max(0, n_embd * layer_idx - buffer.size)))
    buffer[n_embd * (layer_idx - 1):n_embd * layer_idx] += (
        tensor.data * np.float32(strength))
  il_start, il_end = 1, n_layer
  out = {}
  for il in range(1, n_layer):
    off = n_embd * (il - 1)
    if off + n_embd <= buffer.size and il_start <= il <= il_end and (
        np.any(buffer[off:off + n_embd])):
      out[il] = buffer[off:off + n_embd]
  return out


def _logits_with_additions(model, params, tokens, additions):
  """Logits with additions[il] added to block il's output at every token
  (a plain interceptor: no geom code)."""

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    block = re.fullmatch(r'block_(\d+)', '/'.join(context.module.path))
    if context.method_name != '__call__' or not block:
      return out
    il = int(block.group(1))
    if il not in additions:
      return out
    return (out[0] + jnp.asarray(additions[il]), *out[1:])

  with nn.intercept_methods(interceptor):
    logits, _ = model.apply({'params': params}, tokens)
  return np.asarray(logits)


@pytest.fixture(scope='module')
def four_blocks(tmp_path_factory):
  """The tests' small Gemma 3 file with four blocks, loaded."""
  shape = dataclasses.replace(tiny_gemma.SHAPE, num_layers=4)
  path = tiny_gemma.model_file(tmp_path_factory.mktemp('g') / 'g.gguf',
                               shape=shape)
  loaded = gemma_gguf.load(path)
  return gemma.Gemma3(loaded.shape, max_len=16), loaded.params


@pytest.mark.parametrize('block', [1, 2, 3])
def test_llama_cpp_adds_it_after_the_block_geom_steers(four_blocks, tmp_path,
                                                       block):
  model, params = four_blocks
  direction = _directions((block,), seed=block, size=model.d_model)[block]
  path = tmp_path / 'v.gguf'
  gguf_export.control_vector(str(path), {block: direction},
                             model_hint='gemma3', hidden_size=model.d_model,
                             num_layers=4, alpha=0.5, coefficient=6.0)
  additions = _llama_cpp_additions(path, 4, model.d_model)
  assert list(additions) == [block]
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 300, (2, 9)),
                       jnp.int32)
  steer = steering_lib.Steering('addition', jnp.asarray(direction,
                                                        jnp.float32),
                                alpha=0.5, coefficient=6.0)
  want, _, _ = interface.apply(model, params, tokens, jnp.ones_like(
      tokens, bool), steering=steer, layer_path=f'block_{block}')
  unsteered = _logits_with_additions(model, params, tokens, {})
  got = _logits_with_additions(model, params, tokens, additions)
  assert np.abs(np.asarray(want) - unsteered).max() > 0.1
  np.testing.assert_allclose(got, want, atol=1e-5)
  # The check tells blocks apart: the same vector one block away does not
  # pass it.
  other = block - 1 if block > 1 else block + 1
  off = _logits_with_additions(model, params, tokens,
                               {other: additions[block]})
  assert np.abs(off - np.asarray(want)).max() > 0.1
  # --control-vector-scaled FILE S is addition at alpha * S.
  scaled = _llama_cpp_additions(path, 4, model.d_model, strength=0.5)
  np.testing.assert_allclose(scaled[block],
                             _geom_addition(direction, 0.25, 6.0), rtol=1e-6)


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
  path = tmp_path / 'v.gguf'
  _write(path)
  before = path.read_bytes()
  partial = []

  def fail_midway(writer, *args, **kwargs):
    del args, kwargs
    writer.write_ti_data_to_file()  # After the header and the metadata.
    writer.fout[0].close()
    partial.extend(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path)
                   if n != 'v.gguf')
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(gguf.GGUFWriter, 'write_tensors_to_file', fail_midway)
  for target in (path, tmp_path / 'new.gguf'):
    with pytest.raises(OSError, match='No space'):
      _write(target, alpha=0.9)
  assert len(partial) == 2 and min(partial) > 0, partial
  assert path.read_bytes() == before
  assert os.listdir(tmp_path) == ['v.gguf']


@pytest.mark.parametrize('field, change', [
    ('directions', dict(directions={0: np.ones(HIDDEN)}, coefficient=1.0)),
    ('directions', dict(directions={LAYERS: np.ones(HIDDEN)},
                        coefficient=1.0)),
    ('directions', dict(directions={}, coefficient=1.0)),
    ('directions', dict(directions={'1': np.ones(HIDDEN)}, coefficient=1.0)),
    ('directions[1]', dict(directions={1: np.ones(HIDDEN + 1)},
                           coefficient=1.0)),
    ('directions[1]', dict(directions={1: np.full(HIDDEN, np.nan)},
                           coefficient=1.0)),
    ('directions[1]', dict(directions={1: np.zeros(HIDDEN)},
                           coefficient=1.0)),
    ('hidden_size', dict(hidden_size=0)),
    ('num_layers', dict(num_layers=1)),
    ('alpha', dict(alpha=0.0)),
    ('alpha', dict(alpha=1.5)),
    ('alpha', dict(alpha=float('nan'))),
    ('coefficient', dict(coefficient=-1.0)),
    ('coefficient', dict(coefficient={1: 1.0})),
    ('coefficient[3]', dict(coefficient={1: 1.0, 3: float('inf')})),
    ('model_hint', dict(model_hint='')),
])
def test_bad_inputs_name_the_field_and_write_nothing(tmp_path, field, change):
  directions = change.pop('directions', None)
  with pytest.raises(UsageError) as e:
    _write(tmp_path / 'v.gguf', directions, **change)
  assert e.value.name == field, e.value
  assert str(e.value).startswith(f'{field}='), e.value
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize('path', ['', 'gs://bucket/v.gguf', '.'])
def test_a_path_that_cannot_be_written_is_refused(tmp_path, monkeypatch,
                                                  path):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UsageError, match='^path='):
    _write(path)
  assert not os.listdir(tmp_path)


def _raw_file(path, name='direction.1', values=None, arch='controlvector'):
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_string(f'{arch}.model_hint', 'gemma3')
  writer.add_uint32(f'{arch}.layer_count', 1)
  writer.add_tensor(name, np.ones(HIDDEN, np.float32) if values is None
                    else values)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


def test_the_reader_refuses_what_llama_cpp_refuses(tmp_path):
  cases = {
      'general.architecture=': _raw_file(tmp_path / 'a.gguf', arch='gemma3'),
      'N >= 1': _raw_file(tmp_path / 'b.gguf', name='direction.0'),
      "'layer.1'": _raw_file(tmp_path / 'c.gguf', name='layer.1'),
      'one-dimensional float32': _raw_file(
          tmp_path / 'd.gguf', values=np.ones(HIDDEN, np.float16)),
      'one-dimensional float32 ': _raw_file(
          tmp_path / 'e.gguf', values=np.ones((2, HIDDEN), np.float32)),
      'not a GGUF file': str(tmp_path / 'f.gguf'),
  }
  (tmp_path / 'f.gguf').write_bytes(b'not gguf')
  for needle, path in cases.items():
    with pytest.raises(ValueError, match=None) as e:
      gguf_export.read_control_vector(path)
    assert str(e.value).startswith(path) and needle.strip() in str(e.value), (
        needle, e.value)
  model = tiny_gemma.model_file(tmp_path / 'model.gguf')
  with pytest.raises(ValueError, match="general.architecture='gemma3'"):
    gguf_export.read_control_vector(model)


def _gemma_config(**overrides):
  config = gemma_config.get_config('runlocal')
  config.update(overrides)
  return config


@pytest.mark.parametrize('flags, config, needle', [
    ((None, 0.5), _gemma_config(), '--export_alpha=0.5: needs --export_gguf'),
    (('v.gguf', 1.5), _gemma_config(), '--export_alpha=1.5: must be'),
    (('v.gguf', 0.0), _gemma_config(), '--export_alpha=0.0: must be'),
    (('v.gguf', None), _gemma_config(layer=0), 'config.layer=0: block 0'),
    (('v.gguf', None), _gemma_config(alphas=()), '--export_alpha=None: '
     'config.alphas is empty'),
    (('v.gguf', None), ml_collections.ConfigDict(dict(
        lm_workdir='w', layer=2, alphas=(0.5,))), 'in-project decoder'),
    (('gs://b/v.gguf', None), _gemma_config(), 'local path'),
])
def test_bad_flags_name_the_flag(flags, config, needle):
  with pytest.raises(UsageError) as e:
    gguf_export.check_export_flags(config, *flags)
  flag = '--export_alpha' if 'alpha' in needle else '--export_gguf'
  assert str(e.value).startswith(f'{flag}=') and needle in str(e.value), (
      e.value)


def test_the_flags_default_to_no_export_and_the_largest_alpha():
  config = _gemma_config(alphas=(0.1, 0.6, 0.3))
  assert gguf_export.check_export_flags(config, None, None) is None
  assert gguf_export.check_export_flags(config, 'v.gguf', None) == 0.6
  assert gguf_export.check_export_flags(config, 'v.gguf', 0.05) == 0.05


def _launch(args, timeout=600):
  return subprocess.run([sys.executable, '-m', 'launch.steer_eval', *args],
                        cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=timeout)


def test_a_bad_flag_is_one_line_before_the_model_loads(tmp_path):
  # The file does not exist: an evaluation that got as far as loading
  # would say so instead.
  proc = _launch(['--config=configs/gemma.py:runlocal',
                  '--config.gguf=/nonexistent.gguf', '--config.layer=0',
                  f'--workdir={tmp_path}/w',
                  f'--export_gguf={tmp_path}/v.gguf'], timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and '--export_gguf=' in lines[0], proc.stderr
  assert 'config.layer=0' in lines[0] and 'Traceback' not in proc.stderr
  assert not os.listdir(tmp_path)


def test_the_launcher_exports_the_direction_the_evaluation_used(tmp_path):
  model = tiny_gemma.model_file(tmp_path / 'g.gguf')
  workdir, path = tmp_path / 'eval', tmp_path / 'out' / 'v.gguf'
  proc = _launch([
      '--config=configs/gemma.py:runlocal', f'--config.gguf={model}',
      '--config.shape=gguf', '--config.layer=1', '--config.sweep_layers=()',
      "--config.methods=('none','addition')", '--config.alphas=(0.3,0.6)',
      '--config.generation.enabled=False', f'--workdir={workdir}',
      f'--export_gguf={path}', '--export_alpha=0.3'])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f'control vector: {path} (direction.1)' in proc.stdout, proc.stdout
  vec = steering_vectors.load(str(workdir / 'steering_vector.npz'))
  with open(workdir / 'results.json') as f:
    meta = json.load(f)['meta']
  assert (vec.layer, meta['layer'], meta['num_layers']) == (1, 1, 2)
  read = gguf_export.read_control_vector(str(path))
  assert (read.model_hint, list(read.vectors)) == ('gemma3', [1])
  # What the evaluation's addition row added at alpha 0.3, bit for bit.
  np.testing.assert_array_equal(read.vectors[1], _geom_addition(
      vec.direction, 0.3, meta['coefficient']))
  assert meta['coefficient'] == vec.info['coefficient'] > 0
