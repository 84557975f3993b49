"""Rollouts and SFT examples: behaviour log-probs, pass@1, answer masks."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import scipy.special

from tests import host_params
from train.lm import decoder as decoder_lm
from train.lm import generate as generate_lib
from train.rl import grpo
from train.rl import rollout
from train.rl import sft
from train.rl import tasks


@pytest.fixture(scope='module')
def policy():
  model = decoder_lm.DecoderLM(vocab_size=256, d_model=32, num_layers=2,
                               num_heads=2, mlp_dim=64, max_len=32)
  return model, host_params.draw(model, 0)


def test_behaviour_logps_are_the_learners_log_probs(trained):
  # What the actor records equals what the learner computes on the same
  # sequence with the same weights: the basis of every ratio in GRPO.
  model, params = trained
  problems = (tasks.sample('add', 1, 3, 0) + tasks.sample('add', 3, 3, 0))
  out = rollout.sample(model, params, problems, jax.random.key(5),
                       temperature=0.7)
  tokens = np.concatenate([out.prompt, out.completion], 1)
  valid = np.concatenate([out.prompt_valid, out.completion_mask], 1)
  # Jitted, as the learner runs it (op by op it paid ~100 compiles).
  logps = jax.jit(grpo.sequence_log_probs, static_argnums=0,
                  static_argnames='temperature')(
                      model, params, jnp.asarray(tokens), jnp.asarray(valid),
                      temperature=0.7)
  p = out.prompt.shape[1]
  learner = np.asarray(logps)[:, p - 1:]
  np.testing.assert_allclose(np.where(out.completion_mask, learner, 0.0),
                             out.behaviour_logps, atol=2e-5)
  assert out.completion_mask[:, 0].all()
  assert not out.completion_mask.all()  # Some rows end early (at EOS).
  assert (out.behaviour_logps[out.completion_mask] <= 0).all()


def test_sampling_is_seeded_and_greedy_ignores_the_key(policy):
  model, params = policy
  problems = tasks.sample('add', 2, 4, 0)
  a = rollout.sample(model, params, problems, jax.random.key(1))
  b = rollout.sample(model, params, problems, jax.random.key(1))
  c = rollout.sample(model, params, problems, jax.random.key(2))
  np.testing.assert_array_equal(a.completion, b.completion)
  assert not np.array_equal(a.completion, c.completion)
  g1 = rollout.sample(model, params, problems, jax.random.key(1),
                      temperature=0.0)
  g2 = rollout.sample(model, params, problems, None, temperature=0.0)
  np.testing.assert_array_equal(g1.completion, g2.completion)


@pytest.fixture(scope='module')
def trained(sft_policy_run):
  """The session's SFT warm start (tests/conftest.py): a one-layer LM
  taught one- and two-digit sums, which answers most one-digit sums and
  few two-digit ones, so pass@1 is neither 0 nor 1. (Its own 400 steps of
  training here cost more CPU than the rest of this file.)"""
  _, model, params, _ = sft.load_policy(sft_policy_run[0])
  return model, params


def test_pass_at_1_equals_greedy_decoding_by_full_recomputation(trained):
  model, params = trained
  problems = tasks.evaluation_set('add', 1, 100) + tasks.evaluation_set(
      'add', 2, 60)
  # Independent path: 'recompute' generation (no cache), unpadded prompts
  # grouped by length, the verifier on the decoded text.
  recompute = jax.jit(generate_lib.generate, static_argnums=(0, 4),
                      static_argnames='mode')
  solved = {}
  for length in {len(p.prompt) for p in problems}:
    group = [p for p in problems if len(p.prompt) == length]
    tok, valid = tasks.encode_prompts(group)
    assert valid.all()
    out = recompute(model, params, jnp.asarray(tok), jnp.asarray(valid),
                    tasks.max_answer_tokens('add', 2), mode='recompute')
    solved.update({p.expression: tasks.reward(p, tasks.decode_completion(t))
                   for p, t in zip(group, np.asarray(out.tokens))})
  want = sum(solved.values()) / len(problems)
  assert 0.05 < want < 0.95, want  # The comparison is not vacuous.
  # A solved problem last: the padding of the last batch repeats it.
  problems.sort(key=lambda p: solved[p.expression])
  for batch_size in (64, 160, 7):
    got = rollout.pass_at_1(model, params, problems, batch_size=batch_size)
    assert got == pytest.approx(want), batch_size


def test_sft_examples_mask_exactly_the_answer_targets():
  data = ml_collections.ConfigDict(dict(families=('add', 'mul'),
                                        difficulties=(1, 4)))
  length = sft.sequence_length(data)
  problems = [tasks.sample(f, d, 1, 3)[0] for f in ('add', 'mul')
              for d in (1, 4)]
  ex = sft.encode(problems, length)
  assert ex.tokens.shape == (4, length + 1)
  for i, p in enumerate(problems):
    targets = ex.tokens[i, 1:][ex.loss_mask[i] == 1]
    assert bytes(targets).decode() == p.target
    assert ex.tokens[i, 0] == tasks.BOS
    assert bytes(ex.tokens[i, 1:1 + len(p.prompt)]).decode() == p.prompt
  # The longest problem fills the buffer exactly.
  top = tasks.Problem('add', 4, '9999+9999', '19998')
  assert sft.encode([top], length).tokens[0, -1] == tasks.EOS


def test_sft_loss_is_the_answer_cross_entropy(trained):
  model, params = trained
  data = ml_collections.ConfigDict(dict(families=('add',),
                                        difficulties=(1, 2)))
  length = sft.sequence_length(data)
  problems = tasks.sample('add', 1, 6, 1) + tasks.sample('add', 2, 6, 1)
  ex = sft.encode(problems, length)
  # Jitted, as the training loop runs it; the reference passes too (one
  # compile per sequence length), their softmax in numpy: op by op, on
  # each length, they paid ~270 compiles.
  loss, exact, _ = jax.jit(sft.sft_loss, static_argnums=(0, 3))(
      model, {'params': params, 'batch_stats': {}},
      ex.rows(np.arange(len(problems))), True)
  loss, exact = np.asarray(loss), np.asarray(exact)
  assert 0 < float(exact.sum()) < len(problems)
  apply = jax.jit(model.apply)
  for i, p in enumerate(problems):
    prompt = [tasks.BOS] + list(p.prompt.encode())
    full = prompt + list(p.target.encode())
    logits, _ = apply({'params': params}, jnp.asarray([full[:-1]]))
    logits = np.asarray(logits, np.float64)[0]
    logp = scipy.special.log_softmax(logits, -1)
    ce = [-float(logp[j, full[j + 1]]) for j in range(len(prompt) - 1,
                                                        len(full) - 1)]
    assert float(loss[i]) == pytest.approx(np.mean(ce), rel=1e-4, abs=1e-6)
    greedy = all(int(np.argmax(logits[j])) == full[j + 1]
                 for j in range(len(prompt) - 1, len(full) - 1))
    assert float(exact[i]) == float(greedy)
