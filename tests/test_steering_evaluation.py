"""One steering evaluation for both LMs: the in-project decoder and Gemma 3.

Every test here runs on both (parametrized): the in-project LM trained at
runlocal size (conftest's `lm_runlocal_run`, as the in-project steering
study steers it) and the tests' two-layer Gemma 3 GGUF file
(tests/tiny_gemma.py, as the Gemma steering study reads 270M's). The
scorers' economies (contexts run once into a KV cache; log-probabilities
and KL inside the compiled function) are checked against one plain
full-sequence pass, and `evaluation.evaluate`, what both studies call,
runs end to end on each. `make test` checks the choice scorers on the
Gemma file and runs the decoder's evaluation end to end; the choice
scorers on the decoder, and Gemma's evaluation, are `make test-all`'s.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gemma as gemma_config
from configs import steering as steering_config
from geom import steering as steering_lib
from train.lm import corpus as text_corpus
from train.lm import data as lm_data
from train.lm import gemma
from train.lm import gemma_gguf
from train.lm import hooks as steering_hooks
from train.lm import interface
from train.lm import tokenizer as lm_tokenizer
from train.lm import trainer as lm_trainer
from train.steering import evaluation
from train.steering import scoring

from tests import tiny_gemma
from tests.conftest import REPO_ROOT


@pytest.fixture(scope='module')
def tiny_file(tmp_path_factory):
  """The two-layer Gemma 3 with a window of 64 tokens: it reaches the left
  padding of the shorter contexts from their choices, and the longer
  contexts run past it (both its layers are local)."""
  return tiny_gemma.write(
      tmp_path_factory.mktemp('lm') / 'g.gguf',
      tiny_gemma.tensors(np.random.default_rng(0)),
      dataclasses.replace(tiny_gemma.SHAPE, sliding_window=64))


@pytest.fixture(scope='module')
def gemma_file(tmp_path_factory):
  return gemma_gguf.registry_file(str(tmp_path_factory.mktemp('gemma')))


# The scorers are checked on the real 270M file too, `slow`
# (docs/slow_tests.md): its 18 layers, global layers and 262k vocabulary.
LMS = ['decoder', 'gemma', pytest.param('gemma_270m', marks=pytest.mark.slow)]
# The choice scorers' decoder cases are `slow` too: the scorers are the
# same code for any model (the two-layer Gemma's cases hold them by
# default), and the decoder's evaluation scores choices end to end by
# default (test_one_evaluation_runs_both_models[decoder]).
GEMMA_LMS = [pytest.param('decoder', marks=pytest.mark.slow)] + LMS[1:]


# Parametrized per test (indirect): a module fixture, built once per model.
@pytest.fixture(scope='module')
def lm(request):
  if request.param == 'decoder':
    trained = lm_trainer.load_trained(
        request.getfixturevalue('lm_runlocal_run')[0])
    model, params, tok = (trained.model, jax.device_get(trained.params),
                          trained.tokenizer)
    layer = 1
  else:
    tiny = request.param == 'gemma'
    loaded = gemma_gguf.load(request.getfixturevalue(
        'tiny_file' if tiny else 'gemma_file'))
    model = gemma.Gemma3(loaded.shape, max_len=256)
    params, tok, layer = loaded.params, loaded.tokenizer, 0 if tiny else 6
  layer_path = steering_hooks.resolve_layer(params, layer)
  direction, coefficient = evaluation.extract(
      model, params, layer_path, text_corpus.contrastive_pairs(8, 1),
      'mean_diff', 'mean', tok)
  return dict(kind=request.param.split('_')[0], model=model, params=params, tokenizer=tok,
              layer_path=layer_path, direction=direction,
              coefficient=coefficient,
              paths=steering_hooks.layer_paths(params))


def _steerings(lm):
  """Addition (at 0.05 on Gemma, whose mean norm at block 6 is about
  5,200), and the gated rotation with kappa 1, beta -0.9: delta =
  -tanh(cos) > -0.9 steers each token by its own fraction (kappa 20
  saturates the gate shut on Gemma's block 6)."""
  alpha = 0.05 if lm['kind'] == 'gemma' else 0.5
  return [evaluation.make_steering('addition', lm['direction'], alpha,
                                   kappa=20.0, beta=0.0,
                                   coefficient=lm['coefficient']),
          steering_lib.Steering('spherical', lm['direction'], alpha=0.5,
                                kappa=1.0, beta=-0.9, gate=True)]


def _full_sequence_scores(lm, items, steering):
  """Each choice's summed log-probability from one plain pass over its
  whole row (context and choice, right-padded), steered from the last
  context token through the choice; and the steered token count."""
  parts = [lm_tokenizer.split(lm['tokenizer'], it.prefix(), c)
           for it in items for c in it.choices]
  length = max(len(c) + len(a) for c, a in parts)
  tokens = np.zeros((len(parts), length), np.int32)
  valid = np.zeros(tokens.shape, bool)
  steer = np.zeros(tokens.shape, bool)
  for i, (ctx, ans) in enumerate(parts):
    tokens[i, :len(ctx) + len(ans)] = np.concatenate([ctx, ans])
    valid[i, :len(ctx) + len(ans)] = True
    steer[i, len(ctx) - 1:len(ctx) + len(ans)] = True
  def run(p, t, v, m):
    logits, _, rec = interface.apply(
        lm['model'], p, t, v, steering=steering, layer_path=lm['layer_path'],
        steer_mask=m)
    return logits, rec.stats
  logits, stats = jax.jit(run)(lm['params'], tokens, valid, steer)
  logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
  total = np.array([sum(logp[i, len(ctx) - 1 + j, a]
                        for j, a in enumerate(ans))
                    for i, (ctx, ans) in enumerate(parts)])
  return total.reshape(-1, 2), float(stats.tokens)


@pytest.mark.parametrize('lm', GEMMA_LMS, indirect=True)
def test_cached_choice_scores_match_the_full_sequence(lm):
  items = text_corpus.mc_task('cloze', 3, 7) + text_corpus.mc_task('copa', 3, 7)
  batch = scoring.encode_mc(items, lm['tokenizer'])
  assert (batch.prefix[:, -1] != 0).all()  # Left padding.
  scorer = scoring.MCScorer(lm['model'], lm['params'], batch,
                            lm['layer_path'])
  unsteered, _, _ = scorer.logprobs(evaluation.make_steering(
      'none', lm['direction'], 0.0, kappa=20.0, beta=0.0, coefficient=1.0))
  for steering in _steerings(lm):
    total, mean, stats = scorer.logprobs(steering)
    want, steered = _full_sequence_scores(lm, items, steering)
    np.testing.assert_allclose(total, want, atol=2e-3, rtol=1e-4)
    np.testing.assert_allclose(mean, total / batch.score.sum(1).reshape(-1, 2))
    assert float(stats.tokens) == steered
    assert float(stats.tokens) == batch.tail_valid.sum()
    assert np.abs(total - unsteered).max() > 0.1  # The steering did act.


@pytest.mark.parametrize('lm', GEMMA_LMS, indirect=True)
def test_short_chunks_cut_to_their_longest_tail_score_the_same(
    lm, monkeypatch):
  """The scorer orders items by their longest choice and cuts each chunk's
  tails to its longest: in chunks of a few rows (copa's long choices
  before cloze's short ones, so the order changes) every item scores as
  in one chunk, on fewer positions than the padded batch."""
  items = text_corpus.mc_task('copa', 3, 7) + text_corpus.mc_task('cloze', 3, 7)
  batch = scoring.encode_mc(items, lm['tokenizer'])
  steering = _steerings(lm)[1]
  whole, _, _ = scoring.MCScorer(lm['model'], lm['params'], batch,
                                 lm['layer_path']).logprobs(steering)
  monkeypatch.setattr(scoring, 'CHUNK_TOKENS', 2 * batch.prefix.shape[1])
  scorer = scoring.MCScorer(lm['model'], lm['params'], batch,
                            lm['layer_path'])
  assert len(scorer.chunks) == len(items)
  assert list(scorer.order) != list(range(2 * len(items)))
  assert sorted(scorer.order) == list(range(2 * len(items)))
  for rows, width, _ in scorer.chunks:
    assert not batch.tail_valid[rows, width:].any()
  assert sum(len(r) * w for r, w, _ in scorer.chunks) < batch.tail.size
  np.testing.assert_allclose(scorer.logprobs(steering)[0], whole, atol=1e-4)


@pytest.mark.parametrize('lm', LMS, indirect=True)
def test_heldout_metrics_match_the_full_logits(lm):
  if lm['kind'] == 'gemma':
    windows = lm_data.heldout_windows(lm['tokenizer'], 3, 24)
  else:
    windows = np.asarray(text_corpus.encode(
        ' '.join(text_corpus.PREMISES))[:3 * 25]).reshape(3, 25)
  unsteered = evaluation.make_steering('none', lm['direction'], 0.0,
                                       kappa=0.0, beta=0.0, coefficient=1.0)
  scorer = scoring.HeldoutScorer(lm['model'], lm['params'], windows,
                                 lm['layer_path'], lm['paths'], unsteered)
  steering = _steerings(lm)[0]
  got = scorer.metrics(steering)
  tokens, targets = windows[:, :-1], windows[:, 1:]
  valid = np.ones(tokens.shape, bool)
  at, last = lm['layer_path'], lm['paths'][-1]
  # Jitted (the steering is a pytree argument): op by op, the two plain
  # passes cost seconds of one-op compiles.
  def run(p, s):
    logits, _, rec = interface.apply(lm['model'], p, tokens, valid,
                                     steering=s, layer_path=at,
                                     watch=(at, last))
    return logits, rec.stats, rec.norms
  run = jax.jit(run)
  logits0, _, norms0 = run(lm['params'], unsteered)
  logits, stats, norms = run(lm['params'], steering)
  logp0 = np.asarray(jax.nn.log_softmax(logits0), np.float64)
  logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
  want = {
      'kl': np.mean(np.sum(np.exp(logp0) * (logp0 - logp), -1)),
      'ce': -np.mean(np.take_along_axis(logp, targets[..., None], -1)),
      'trigger_rate': float(stats.triggered / stats.tokens),
      'norm_ratio_at': float(jnp.mean(norms[at] / norms0[at])),
      'norm_ratio_last': float(jnp.mean(norms[last] / norms0[last]))}
  assert got['kl'] > 1e-4
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=2e-3, atol=1e-5,
                               err_msg=key)


# The Gemma case is slow (17 s): test_gemma_steering.py's
# test_study_end_to_end_reuse_and_refusal[tiny] runs the same evaluation
# (the two-layer file at block 1, none and addition at 0.3) through the
# Gemma study, and the scorers' tests above run on it.
@pytest.mark.parametrize('kind', [
    'decoder', pytest.param('gemma', marks=pytest.mark.slow)])
def test_one_evaluation_runs_both_models(kind, request, tmp_path):
  """`evaluation.evaluate` on either model: the same grid, rows, table and
  vector file; what differs is the model's own held-out text (per source
  for the in-project LM) and its generations' judge."""
  if kind == 'gemma':
    config = gemma_config.get_config('runlocal')
    config.update(dict(gguf=str(request.getfixturevalue('tiny_file')),
                       shape='gguf', layer=1, sweep_layers=()))
  else:
    config = steering_config.get_config('runlocal')
    config.lm_workdir = request.getfixturevalue('lm_runlocal_run')[0]
  config.methods = ('none', 'addition')
  config.alphas = (0.3,)
  assert evaluation.lm_kind(config) == kind
  rows = evaluation.evaluate(config, str(tmp_path))
  assert [(r['method'], r['alpha']) for r in rows] == [('none', 0.0),
                                                       ('addition', 0.3)]
  none, add = rows
  assert none['kl'] == pytest.approx(0.0, abs=1e-6) and add['kl'] > 1e-3
  for r in rows:
    for task, n in config.tasks.items():
      assert [len(c) for c in r[f'{task}_correct_mean']] == [n] * len(
          config.mc_seeds)
    # The lexicon's share is nan where no text holds a sentiment word (the
    # runlocal LM's 8 bytes rarely do).
    assert not r['positive_share'] < 0.0 and not r['positive_share'] > 1.0
    assert np.isfinite(r['gen_ce'])
    assert ('vader_compound' in r) == (kind == 'gemma')
    assert any(k.endswith('_kl') for k in r) == (kind == 'decoder')
  results = json.load(open(tmp_path / 'results.json'))
  assert results['meta']['layer_path'] == 'block_1'
  table = open(tmp_path / 'results.md').read()
  assert table == evaluation.markdown_table(rows, list(config.tasks))
  assert len(table.splitlines()) == 2 + len(rows)
  for name in ('steering_vector.npz', 'pareto.png'):
    assert os.path.exists(tmp_path / name), name


@pytest.mark.parametrize('config, flag, message', [
    ('configs/steering.py:runlocal', '--config.lm_workdir=/nonexistent',
     'holds no checkpoints'),
    ('configs/gemma.py:runlocal', '--config.layer=18',
     'config.layer=18: Gemma 3 270m has blocks 0..17'),
    # With a selection block the launcher runs train.steering.selection.
    ('configs/gemma.py:runlocal,selection', '--config.selection.layers=(3,40)',
     'config.selection.layers=(3, 40): block 40 is out of range'),
])
def test_one_launcher_reads_both_configs(config, flag, message, tmp_path):
  """`launch.steer_eval` takes either config; a bad one is refused in one
  line by the one `check_config` (or the LM's loading) before compute."""
  proc = subprocess.run(
      [sys.executable, '-m', 'launch.steer_eval', f'--config={config}', flag,
       f'--workdir={tmp_path}/out'], cwd=REPO_ROOT, capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and message in lines[0], proc.stderr
