"""The learner: batch layout from a rollout, and the update's gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests import host_params
from train.lm import decoder as decoder_lm
from train.rl import grpo
from train.rl import learner
from train.rl import rollout
from train.rl import tasks


@pytest.fixture(scope='module')
def policy_and_rollout():
  model = decoder_lm.DecoderLM(vocab_size=256, d_model=32, num_layers=1,
                               num_heads=2, mlp_dim=64, max_len=32)
  params = host_params.draw(model, 0)
  problems = [p for p in tasks.sample('add', 2, 3, 0) for _ in range(4)]
  out = rollout.sample(model, params, problems, jax.random.key(3),
                       temperature=1.0)
  # Rewards are zero for an untrained policy: give the groups some spread.
  out = out.__class__(**{**out.__dict__, 'rewards': np.array(
      [1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1], np.float32)})
  return model, params, out


def test_batch_targets_line_up_with_the_behaviour_log_probs(policy_and_rollout):
  model, params, out = policy_and_rollout
  length = 20
  batch = learner.assemble(out, 4, length)
  assert batch.tokens.shape == (12, length)
  # Jitted, as the learner runs it (op by op it paid ~100 compiles).
  logps = jax.jit(grpo.sequence_log_probs, static_argnums=0)(
      model, params, jnp.asarray(batch.tokens), jnp.asarray(batch.valid))
  mask = batch.loss_mask > 0
  assert mask.sum() == out.completion_mask.sum()
  np.testing.assert_allclose(np.asarray(logps)[mask],
                             batch.behaviour_logps[mask], atol=2e-5)
  assert not batch.behaviour_logps[~mask].any()
  np.testing.assert_allclose(batch.advantages,
                             grpo.group_advantages(out.rewards, 4))
  with pytest.raises(ValueError, match='length=5'):
    learner.assemble(out, 4, 5)


def test_an_on_policy_update_is_the_policy_gradient_step(policy_and_rollout):
  model, params, out = policy_and_rollout
  batch = learner.assemble(out, 4, 20)
  settings = learner.LearnerSettings(grpo.LossSettings(correction='tis'),
                                     group_size=4)
  tx = optax.sgd(0.5)
  new, _, metrics = learner.make_update(model, tx, settings)(
      params, jax.jit(tx.init)(params), batch, params)

  def objective(p):  # -(1/N) sum_i A_i mean_t log pi(o_i,t).
    logps = grpo.sequence_log_probs(model, p, jnp.asarray(batch.tokens),
                                    jnp.asarray(batch.valid))
    m = batch.loss_mask
    per_seq = (logps * m).sum(-1) / jnp.maximum(m.sum(-1), 1)
    return -(batch.advantages * per_seq).mean()

  # The reference step, jitted (op by op it paid ~100 compiles).
  want = jax.jit(lambda params: jax.tree.map(
      lambda p, g: p - 0.5 * g, params, jax.grad(objective)(params)))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6),
               new, want)
  assert float(metrics['ratio_mean']) == pytest.approx(1.0, abs=1e-5)
  assert abs(float(metrics['behaviour_kl'])) < 1e-5
  assert float(metrics['grad_norm']) > 0


def test_more_iterations_move_further_and_clip(policy_and_rollout):
  model, params, out = policy_and_rollout
  batch = learner.assemble(out, 4, 20)
  tx = optax.adam(0.05)
  opt_state = jax.jit(tx.init)(params)
  moved = []
  for iterations in (1, 3):
    settings = learner.LearnerSettings(grpo.LossSettings(), group_size=4,
                                       iterations=iterations)
    new, _, metrics = learner.make_update(model, tx, settings)(
        params, opt_state, batch, params)
    # The metrics are the first iteration's, taken at the proximal policy.
    assert float(metrics['ratio_mean']) == pytest.approx(1.0, abs=1e-5)
    moved.append(float(np.sqrt(sum(
        np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params))))))
  assert moved[1] > moved[0] > 0


@pytest.mark.parametrize('field,value', [('group_size', 1),
                                         ('iterations', 0)])
def test_bad_learner_settings_name_the_field(field, value):
  kwargs = {'loss': grpo.LossSettings(), 'group_size': 4, field: value}
  with pytest.raises(Exception, match=f'grpo.{field}'):
    learner.LearnerSettings(**kwargs).check()
