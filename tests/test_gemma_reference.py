"""Gemma 3 270M (train.lm.gemma on the registry's GGUF file) against llama.cpp.

llama.cpp's outputs on the same file are recorded in
tests/gemma_reference/llama_cpp.npz (tests/gemma_reference/
record_llama_cpp.py says how and what). Checked here:

- tokenization: our SentencePiece rebuilt from the file's metadata gives
  llama.cpp's ids on a mixed corpus (unicode, digits, whitespace runs,
  code), and decodes them back to the text;
- next-token logits at every position of a ~700-token passage (past the
  512-token sliding window), computed with the KV cache in chunks, and on
  a 128-token prefix without it: against llama.cpp in float32 on the same
  dequantized weights within LOGIT_TOL, and against llama.cpp on the Q4_K_M
  file as shipped (its own dequantization, 8-bit activations) within
  QUANT_TOL;
- greedy generation: 24 tokens after each of 20 prompts, identical;
- a control vector exported by `launch.steer_eval --export_gguf`, applied
  by llama.cpp, gives geom's addition steering's logits at the same block
  and strength within LOGIT_TOL;
- planted bugs (a wrong RoPE base, the norms' 1 + w offset dropped, local
  layers made global) each fail the logit check by far.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import tiny_gemma
from tests.gemma_reference import texts
from train import errors
from train.lm import decoder
from train.lm import gemma
from train.lm import gemma_gguf
from train.lm import generate

REFERENCE = os.path.join(os.path.dirname(__file__), 'gemma_reference',
                         'llama_cpp.npz')
# Max |logit difference| over the passage, logits being ~O(10-30): float32
# against float32 (llama.cpp's GELU reads a float16 table), and against the
# quantized run (llama.cpp rounds activations to 8 bits in its matmuls).
LOGIT_TOL = 0.03
QUANT_TOL = 1.5
CHUNK = 96


@pytest.fixture(scope='module')
def reference():
  with np.load(REFERENCE) as f:
    return dict(f)


@pytest.fixture(scope='module')
def gemma_file(tmp_path_factory):
  return gemma_gguf.registry_file(str(tmp_path_factory.mktemp('gemma')))


@pytest.fixture(scope='module')
def loaded(gemma_file):
  return gemma_gguf.load(gemma_file)


def _summary(logits, reference, positions):
  """What is compared at `positions` (a slice of the passage): the logits
  at llama.cpp's top-32 ids of both runs and at the random ids, the
  log-sum-exp and the argmax (jnp, so it runs inside jit)."""
  out = dict(lse=jax.nn.logsumexp(logits, axis=-1),
             argmax=jnp.argmax(logits, axis=-1),
             random=logits[:, reference['random_ids']])
  for run in ('f_', 'q_'):
    ids = jnp.asarray(reference[run + 'top_ids'])[positions]
    out[run + 'top'] = jnp.take_along_axis(logits, ids, 1)
  return out


def _summaries_cached(model, params, ids, reference):
  """`_summary` of one sequence, prefilled CHUNK tokens at a time through
  the KV cache (the whole passage's logits would be 0.7 GB)."""
  n = len(ids)
  padded = -(-n // CHUNK) * CHUNK
  tokens = np.zeros((1, padded), np.int32)
  tokens[0, :n] = ids
  valid = np.arange(padded)[None] < n
  ref = {k: np.pad(v, [(0, padded - n)] + [(0, 0)] * (v.ndim - 1))
         if k.endswith('top_ids') else v for k, v in reference.items()
         if k.endswith('top_ids') or k == 'random_ids'}

  @jax.jit
  def step(p, t, v, c, i):
    logits, c = model.apply({'params': p}, t, v, c)
    sub = {k: (jax.lax.dynamic_slice_in_dim(jnp.asarray(x), i, CHUNK)
               if k.endswith('top_ids') else x) for k, x in ref.items()}
    return _summary(logits[0], sub, slice(None)), c

  cache = decoder.init_cache(model, 1, padded)
  parts = []
  for i in range(0, padded, CHUNK):
    out, cache = step(params, tokens[:, i:i + CHUNK], valid[:, i:i + CHUNK],
                      cache, i)
    parts.append(jax.tree.map(np.asarray, out))
  return {k: np.concatenate([p[k] for p in parts])[:n] for k in parts[0]}


def _compare(summary, reference, run, positions=slice(None)):
  """Max |difference| against llama.cpp's run `run` ('f_' or 'q_')."""
  r = {k: v[positions] for k, v in reference.items() if k.startswith(run)}
  return dict(
      top=float(np.abs(summary[run + 'top'] - r[run + 'top_logits']).max()),
      random=float(np.abs(summary['random'] - r[run + 'random_logits']
                          ).max()),
      lse=float(np.abs(summary['lse'] - r[run + 'lse']).max()),
      argmax_agree=float(np.mean(summary['argmax'] == r[run + 'top_ids'][:, 0]
                                 )))


PREFIX = 128  # The uncached checks' passage prefix.


def _prefix_program(shape, params, layer):
  """The uncached forward of `shape` on PREFIX tokens with geom's ungated
  addition (alpha 1: coefficient |v|) added to block `layer`'s output at
  every token (BOS included, as llama.cpp's control vectors are), as
  `run(params, vector, alpha, reference) -> _summary` (`reference`: the
  passage and the ids compared, its 'f_top_ids' llama.cpp's steered ones
  where the steered run is compared). At alpha 0 it adds nothing: the
  plain model. The parameters, vector, alpha and ids are arguments, so one
  compiled program serves every check at this shape and block (each trace
  and compile of the 270M costs seconds)."""
  from geom import steering as steering_lib  # pylint: disable=g-import-not-at-top
  from train.lm import hooks  # pylint: disable=g-import-not-at-top
  model = gemma.Gemma3(shape, max_len=PREFIX)
  path = hooks.resolve_layer(params, int(layer))

  @jax.jit
  def summary(p, tokens, steer, ids):
    with hooks.steered(steer, path):
      logits, _ = model.apply({'params': p}, tokens)
    return _summary(logits[0], ids, slice(None))

  def run(p, vector, alpha, reference):
    steer = steering_lib.Steering(
        'addition', jnp.asarray(vector), alpha=alpha,
        coefficient=float(np.linalg.norm(vector)), gate=False)
    ids = {k: np.asarray(reference[k][:PREFIX] if k.endswith('top_ids')
                         else reference[k], np.int32)
           for k in ('f_top_ids', 'q_top_ids', 'random_ids')}
    tokens = reference['passage_ids'][None, :PREFIX]
    return jax.tree.map(np.asarray, summary(p, tokens, steer, ids))
  return run


@pytest.fixture(scope='module')
def at_cvec_layer(loaded, reference):
  """`_prefix_program` of the loaded 270M at the recorded control vector's
  block: the uncached forward test, the norm-offset bug and the control
  vector test share its one compile."""
  return _prefix_program(loaded.shape, loaded.params,
                         reference['cvec_layers'][0])


def test_the_registry_file_loads_as_gemma3_270m(loaded):
  assert loaded.shape == dataclasses.replace(
      gemma.SHAPES['270m'], rms_eps=loaded.shape.rms_eps)
  assert abs(loaded.shape.rms_eps - 1e-6) < 1e-12
  assert gemma.param_count(loaded.params) == 268_098_176
  model = gemma.Gemma3(loaded.shape, max_len=8)
  init = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, 4), jnp.int32))['params'])
  assert (jax.tree.map(lambda a: a.shape, jax.tree.map(
      lambda b: b.value if hasattr(b, 'value') else b, init,
      is_leaf=lambda b: hasattr(b, 'value')))
          == jax.tree.map(lambda a: a.shape, loaded.params))


def test_tokenization_is_llama_cpps(loaded, reference):
  tok = loaded.tokenizer
  for i, text in enumerate(texts.CORPUS):
    ours = tok.encode(text)
    np.testing.assert_array_equal(ours, reference[f'corpus_ids_{i}'],
                                  err_msg=repr(text))
    if '\x00' not in text:
      assert tok.decode(ours) == text
  np.testing.assert_array_equal(tok.encode_document(texts.PASSAGE),
                                reference['passage_ids'])


# 35 s of the 270M's cached prefill: the logits against llama.cpp are held
# by the uncached forward's 128 tokens, and the window and the chunked
# cache by the two-layer file's test below (docs/slow_tests.md).
@pytest.mark.slow
def test_logits_match_llama_cpp_on_a_passage_past_the_window(
    loaded, reference):
  ids = reference['passage_ids']
  assert len(ids) > 512 + CHUNK
  summary = _summaries_cached(gemma.Gemma3(loaded.shape, max_len=1024),
                              loaded.params, ids, reference)
  f = _compare(summary, reference, 'f_')
  assert f['top'] < LOGIT_TOL and f['random'] < LOGIT_TOL, f
  assert f['lse'] < LOGIT_TOL, f
  assert f['argmax_agree'] == 1.0, f
  q = _compare(summary, reference, 'q_')
  assert q['top'] < QUANT_TOL and q['random'] < QUANT_TOL, q
  assert q['argmax_agree'] > 0.9, q
  print('float32 run:', f, 'Q4_K_M run:', q)


def test_the_uncached_forward_matches_too(loaded, reference, at_cvec_layer):
  # Alpha 0: the steering hook adds nothing (the plain model).
  summary = at_cvec_layer(loaded.params, reference['cvec_vectors'][0], 0.0,
                          reference)
  f = _compare(summary, reference, 'f_', slice(0, PREFIX))
  assert f['top'] < LOGIT_TOL and f['random'] < LOGIT_TOL, f


@pytest.mark.parametrize('bug', [
    # 10 s (its shape is another 270M program to compile); the norm bug
    # shows the check's reach at no compile.
    pytest.param('rope_base', marks=pytest.mark.slow), 'norm_offset',
    # 26 s (a 640-token prefill); the window itself is held by the passage
    # test, whose positions past 512 fail without it.
    pytest.param('no_window', marks=pytest.mark.slow)])
def test_each_planted_bug_fails_the_logit_check(loaded, reference, bug,
                                               at_cvec_layer):
  shape, params = loaded.shape, loaded.params
  if bug == 'rope_base':
    shape = dataclasses.replace(shape, local_base=shape.global_base)
  elif bug == 'norm_offset':
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 1.0 if path[-1].key == 'scale' else x, params)
  n = 640  # Past the window, for the window bug.
  ids = reference['passage_ids'][:n]
  if bug == 'no_window':
    shape = dataclasses.replace(shape, sliding_window=10**6)
    summary = _summaries_cached(gemma.Gemma3(shape, max_len=1024), params,
                                ids, reference)
    summary = {k: v[512:] for k, v in summary.items()}
    f = _compare(summary, reference, 'f_', slice(512, n))
  else:
    # The norm bug changes only the parameters: the shared program runs it
    # (alpha 0: unsteered); the RoPE bug's shape is another program.
    run = (at_cvec_layer if shape == loaded.shape else _prefix_program(
        shape, params, reference['cvec_layers'][0]))
    summary = run(params, reference['cvec_vectors'][0], 0.0, reference)
    f = _compare(summary, reference, 'f_', slice(0, PREFIX))
  assert f['top'] > 20 * LOGIT_TOL, f


# 31 s of the 270M's decoding: cached greedy decoding is the full forward's
# argmax in test_lm_prefill.py (the two-layer Gemma), and that forward is
# llama.cpp's here (test_the_uncached_forward_matches_too).
@pytest.mark.slow
def test_greedy_generations_are_llama_cpps(loaded, reference):
  prompts = [reference[f'prompt_ids_{i}'] for i in range(len(texts.PROMPTS))]
  tok = loaded.tokenizer
  for i, prompt in enumerate(texts.PROMPTS):
    np.testing.assert_array_equal(tok.encode_document(prompt), prompts[i])
  width = max(map(len, prompts))
  batch = np.zeros((len(prompts), width), np.int32)
  valid = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):  # Left padding.
    batch[i, width - len(p):] = p
    valid[i, width - len(p):] = True
  model = gemma.Gemma3(loaded.shape, max_len=width + texts.GREEDY_STEPS)
  out = jax.jit(lambda p, t, v: generate.generate(
      model, p, t, v, texts.GREEDY_STEPS).tokens)(loaded.params, batch, valid)
  out = np.asarray(out)
  for i in range(len(prompts)):
    np.testing.assert_array_equal(
        out[i], reference[f'greedy_{i}'],
        err_msg=f'{texts.PROMPTS[i]!r}: ours {tok.decode(out[i])!r}, '
        f'llama.cpp {tok.decode(reference[f"greedy_{i}"])!r}')


def test_the_window_reaches_back_window_minus_one_per_layer(tmp_path):
  """What the 270M passage test (slow) checks past position 512, on the
  tests' two-layer file (both layers local, window 4: a query at p sees
  keys p - 3..p): the logits at the last position depend on the token
  2 * 3 positions back and not on the one before it (the receptive field's
  closed form), and the KV cache filled in chunks gives the uncached
  forward's logits at every position, past the window."""
  loaded = gemma_gguf.load(tiny_gemma.model_file(tmp_path / 'g.gguf'))
  assert loaded.shape.sliding_window == 4
  n, chunk = 16, 3
  model = gemma.Gemma3(loaded.shape, max_len=n + chunk)
  tokens = np.random.default_rng(0).integers(4, 300, (1, n)).astype(np.int32)
  forward = jax.jit(lambda p, t: model.apply({'params': p}, t)[0][0])
  full = np.asarray(forward(loaded.params, tokens))
  reach = loaded.shape.num_layers * (loaded.shape.sliding_window - 1)
  for back, seen in ((reach, True), (reach + 1, False)):
    changed = tokens.copy()
    changed[0, n - 1 - back] = 4 + (changed[0, n - 1 - back] - 3) % 296
    last = np.asarray(forward(loaded.params, changed))[-1]
    assert (np.abs(last - full[-1]).max() > 1e-3) == seen, back
  padded = -(-n // chunk) * chunk
  ids = np.zeros((1, padded), np.int32)
  ids[0, :n] = tokens[0]
  valid = np.arange(padded)[None] < n
  step = jax.jit(lambda p, t, v, c: model.apply({'params': p}, t, v, c))
  cache, parts = decoder.init_cache(model, 1, padded), []
  for i in range(0, padded, chunk):
    logits, cache = step(loaded.params, ids[:, i:i + chunk],
                         valid[:, i:i + chunk], cache)
    parts.append(np.asarray(logits[0]))
  np.testing.assert_allclose(np.concatenate(parts)[:n], full, atol=1e-4)


def test_a_truncated_or_foreign_file_is_one_line(tmp_path, gemma_file):
  with open(gemma_file, 'rb') as f:
    head = f.read(50 << 20)
  cut = tmp_path / 'cut.gguf'
  cut.write_bytes(head)
  with pytest.raises(errors.DamagedModelFile) as e:
    gemma_gguf.load(str(cut))
  assert str(cut) in str(e.value) and '\n' not in str(e.value)
  foreign = tmp_path / 'foreign.gguf'
  foreign.write_bytes(b'not a gguf file at all' * 100)
  with pytest.raises(errors.DamagedModelFile) as e:
    gemma_gguf.load(str(foreign))
  assert 'GGUF' in str(e.value) and '\n' not in str(e.value)


@pytest.mark.parametrize('model_file', [
    'tiny', pytest.param('270m', marks=pytest.mark.slow)])
def test_steering_hooks_run_unchanged_on_gemma(request, tmp_path,
                                               model_file):
  """train.lm.hooks steers a Gemma block as it does the in-project decoder:
  the spherical rotation keeps each token's norm at the steered layer and
  turns it toward the direction (a mean-difference vector of two prompts'
  states), later layers see it, and cached generation runs steered. On the
  tests' two-layer file (block 0 steered, block 1 watched), and on the
  real 270M (blocks 6 and 12) `slow`."""
  from geom import steering as steering_lib  # pylint: disable=g-import-not-at-top
  from train.lm import hooks  # pylint: disable=g-import-not-at-top
  if model_file == 'tiny':
    loaded = gemma_gguf.load(tiny_gemma.model_file(tmp_path / 'g.gguf'))
    layer, watched = hooks.resolve_layer(loaded.params, 0), 'block_1'
    width = 40  # Its pieces are bytes, mostly.
  else:
    loaded = request.getfixturevalue('loaded')
    layer, watched = hooks.resolve_layer(loaded.params, 6), 'block_12'
    width = 16
  tok = loaded.tokenizer
  model = gemma.Gemma3(loaded.shape, max_len=width + 8)

  def left_pad(text):
    ids = tok.encode_document(text)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, width - len(ids):] = ids
    return tokens, np.arange(width)[None] >= width - len(ids)

  @jax.jit
  def run(params, tokens, valid, steer):
    # alpha = 0 steers nothing: one program for the steered and plain runs.
    with hooks.steered(steer, layer, valid, capture=(layer,),
                       watch=(watched,)) as rec:
      logits, _ = model.apply({'params': params}, tokens, valid)
    return logits, rec.hidden[layer][0], rec.norms[watched], rec.stats

  def steering(direction, alpha):
    return steering_lib.Steering('spherical', direction, alpha=alpha,
                                 beta=-1.0 + 1e-6)

  zero = steering(jnp.ones(loaded.shape.d_model), 0.0)

  def states(text):
    tokens, valid = left_pad(text)
    hidden = run(loaded.params, tokens, valid, zero)[1]
    return hidden[valid[0]][1:]  # Past BOS.

  direction = (states('I love this, it is wonderful and happy').mean(0)
               - states('I hate this, it is awful and sad').mean(0))
  steer = steering(direction, 0.5)
  tokens, valid = left_pad('The weather today is')
  base_logits, before, base_norms, _ = run(loaded.params, tokens, valid,
                                           steering(direction, 0.0))
  logits, after, norms, stats = run(loaded.params, tokens, valid, steer)
  v = valid[0]
  np.testing.assert_allclose(np.linalg.norm(after[v], axis=-1),
                             np.linalg.norm(before[v], axis=-1), rtol=1e-5)
  mu = np.asarray(direction) / np.linalg.norm(direction)
  cos = lambda h: (np.asarray(h) @ mu) / np.linalg.norm(h, axis=-1)
  assert np.all(cos(after[v]) > cos(before[v]))
  assert float(stats.trigger_rate) == 1.0
  assert not np.allclose(norms[0, v], base_norms[0, v])
  assert float(np.abs(np.asarray(logits - base_logits)[0, v]).max()) > 1.0
  g = jax.jit(lambda p, t, m, s: generate.generate(
      model, p, t, m, 8, steering=s, layer_path=layer))(
          loaded.params, tokens, valid, steer)
  assert g.tokens.shape == (1, 8)
  assert float(g.stats.tokens) == 8  # The last prompt token, then 7 steps.


def test_llama_cpp_steered_by_an_exported_vector_is_geoms_addition(
    loaded, reference, at_cvec_layer):
  """launch.steer_eval --export_gguf's control vector, applied by llama.cpp
  (`llama_set_adapter_cvec`, recorded by record_llama_cpp.py
  --control_vector), gives the logits of geom's addition at the same block
  and strength, within the unsteered comparison's tolerance; the vector
  moves them by far more, and a flipped sign or a block off fails."""
  (layer,), (vector,) = reference['cvec_layers'], reference['cvec_vectors']
  n = PREFIX
  steered = dict(reference, **{'f_' + k[len('cvec_f_'):]: v
                               for k, v in reference.items()
                               if k.startswith('cvec_f_')})
  at_layer = lambda v, alpha=1.0: at_cvec_layer(loaded.params, v, alpha,
                                                 steered)
  f = _compare(at_layer(vector), steered, 'f_', slice(0, n))
  assert f['top'] < LOGIT_TOL and f['random'] < LOGIT_TOL, f
  assert f['lse'] < LOGIT_TOL and f['argmax_agree'] == 1.0, f
  print('steered, against llama.cpp:', f)
  # Unsteered (alpha 0: the same program adds nothing; test_logits_match_
  # llama_cpp checks the unsteered model itself).
  plain = _compare(at_layer(vector, 0.0), steered, 'f_', slice(0, n))
  assert plain['top'] > 20 * LOGIT_TOL, plain
  print('unsteered, against llama.cpp steered:', plain)
  for bad in (at_layer(-vector),
              _prefix_program(loaded.shape, loaded.params, layer + 1)(
                  loaded.params, vector, 1.0, steered)):
    bad = _compare(bad, steered, 'f_', slice(0, n))
    assert bad['top'] > 20 * LOGIT_TOL, bad


def test_the_tasks_read_gemmas_tokens_one_per_character(gemma_file, loaded):
  """The arithmetic tasks on Gemma's vocabulary (train.rl.tasks.codec):
  each character its own token (Gemma splits digits), so prompts and
  answers have their byte lengths; every piece holding a newline ends a
  completion. The metadata-only tokenizer is the loader's."""
  from train.rl import tasks  # pylint: disable=g-import-not-at-top
  tokenizer = gemma_gguf.read_tokenizer(gemma_file)
  assert tokenizer.fingerprint == loaded.tokenizer.fingerprint
  codec = tasks.codec(tokenizer)
  assert codec.ids['\n'] == 107 and codec.bos == 2 and codec.pad == 0
  problems = tasks.evaluation_set('add', 3, 50) + tasks.evaluation_set(
      'mul', 4, 50)
  for p in problems:
    assert tokenizer.encode(p.prompt).tolist() == codec.encode(p.prompt)
    assert tokenizer.encode(p.target).tolist() == codec.encode(p.target)
  ends = np.flatnonzero(codec.ends)
  assert 107 in ends and len(ends) > 1
  assert all('\n' in tokenizer.decode([i]) for i in ends)
  newline_runs = tokenizer.encode('\n\n\n')
  assert len(newline_runs) == 1 and codec.ends[newline_runs[0]]
