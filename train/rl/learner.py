"""The GRPO learner: batches from rollouts, and the jitted update.

`assemble` turns a rollout of P prompts x G samples (groups consecutive)
into a `grpo.Batch` on the host: prompt and completion side by side,
right-padded to one length so every batch compiles once, the completion
tokens' loss mask and behaviour log-probabilities aligned with the
targets, and group-normalised advantages. `make_update` builds the
learner's step: the proximal log-probabilities (the weights as this
update begins, no gradient), the reference's when beta > 0, then
`iterations` gradient steps of the GRPO loss on the batch (GRPO's mu; 1
is on-policy within the batch). One call is one policy version.
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.training import aot
from train.errors import ConfigError
from train.rl import grpo
from train.rl import rollout as rollout_lib


@dataclasses.dataclass(frozen=True)
class LearnerSettings:
  """The learner's hyperparameters besides the optimizer.

  Attributes:
    loss: the GRPO loss settings.
    group_size: G, samples per prompt.
    iterations: gradient steps per batch (GRPO's mu).
  """
  loss: grpo.LossSettings
  group_size: int
  iterations: int = 1

  def check(self, field: str = 'grpo') -> None:
    self.loss.check(field)
    if not isinstance(self.group_size, int) or self.group_size < 2:
      raise ConfigError(f'{field}.group_size', self.group_size,
                        'must be an integer >= 2')
    if not isinstance(self.iterations, int) or self.iterations < 1:
      raise ConfigError(f'{field}.iterations', self.iterations,
                        'must be an integer >= 1')


def assemble(out: rollout_lib.Rollout, group_size: int, length: int
             ) -> grpo.Batch:
  """The learner batch (numpy) of a rollout, padded to `length` tokens."""
  b, p = out.prompt.shape
  s = out.completion.shape[1]
  if p + s > length:
    raise ValueError(f'length={length}: the rollout has {p} + {s} tokens')
  tokens = np.zeros((b, length), np.int32)
  valid = np.zeros((b, length), bool)
  tokens[:, :p], tokens[:, p:p + s] = out.prompt, out.completion
  valid[:, :p], valid[:, p:p + s] = out.prompt_valid, out.completion_mask
  mask = np.zeros((b, length - 1), np.float32)
  behaviour = np.zeros((b, length - 1), np.float32)
  # Target j of the row is tokens[j + 1]: completion token i is target
  # p - 1 + i.
  mask[:, p - 1:p - 1 + s] = out.completion_mask
  behaviour[:, p - 1:p - 1 + s] = out.behaviour_logps
  zeros = np.zeros_like(behaviour)
  return grpo.Batch(tokens=tokens, valid=valid, loss_mask=mask,
                    advantages=np.asarray(grpo.group_advantages(
                        out.rewards, group_size)),
                    behaviour_logps=behaviour, proximal_logps=zeros,
                    reference_logps=zeros)


Update = Callable[[Any, Any, grpo.Batch, Any],
                  tuple[Any, Any, dict[str, jax.Array]]]


def abstract_batch(rows: int, length: int,
                   sharding: jax.sharding.Sharding | None = None
                   ) -> grpo.Batch:
  """The shapes and dtypes of `assemble`'s batches of `rows` x `length`."""
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                sharding=sharding)
  per_target = s((rows, length - 1), np.float32)
  return grpo.Batch(tokens=s((rows, length), np.int32),
                    valid=s((rows, length), np.bool_), loss_mask=per_target,
                    advantages=s((rows,), np.float32),
                    behaviour_logps=per_target, proximal_logps=per_target,
                    reference_logps=per_target)


def update_program(model: nn.Module,
                   tx: optax.GradientTransformation,
                   settings: LearnerSettings, *, params: Any,
                   opt_state: Any, rows: int, length: int,
                   batch_sharding: jax.sharding.NamedSharding,
                   rules: Any) -> aot.Program:
  """The learner's update as one program on the learner mesh, for AOT
  compilation (the loop's and `launch.compile`'s): `params` and
  `opt_state` are abstract, with their shardings, which the outputs
  keep; the batch's rows are split as `batch_sharding` says; the policy's
  activation constraints follow `rules`."""
  mesh = batch_sharding.mesh
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  fn = jax.jit(update_fn(model, tx, settings),
               out_shardings=(shardings(params), shardings(opt_state), repl))
  return aot.Program('learner_update', fn,
                     (params, opt_state,
                      abstract_batch(rows, length, batch_sharding), params),
                     mesh, rules)


def make_update(model: nn.Module,
                tx: optax.GradientTransformation,
                settings: LearnerSettings) -> Update:
  """`update_fn`, jitted, its shardings those of its arguments."""
  return jax.jit(update_fn(model, tx, settings))


def update_fn(model: nn.Module,
              tx: optax.GradientTransformation,
              settings: LearnerSettings) -> Update:
  """`(params, opt_state, batch, reference_params) -> (params, opt_state,
  metrics)` (`reference_params` is unused when beta = 0)."""
  loss_settings = settings.loss
  temperature = loss_settings.temperature

  def logps_of(params, batch):
    return grpo.sequence_log_probs(model, params, batch.tokens, batch.valid,
                                   temperature)

  def update(params, opt_state, batch, reference_params):
    mask = batch.loss_mask
    proximal = jax.lax.stop_gradient(logps_of(params, batch)) * mask
    reference = (jax.lax.stop_gradient(logps_of(reference_params, batch))
                 * mask if loss_settings.beta > 0
                 else jnp.zeros_like(proximal))
    batch = batch._replace(proximal_logps=proximal,
                           reference_logps=reference)

    def loss_fn(p):
      return grpo.policy_loss(logps_of(p, batch), batch, loss_settings)

    first = None
    for _ in range(settings.iterations):
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      if first is None:
        first = dict(aux, loss=loss, grad_norm=optax.tree.norm(grads))
    # The behaviour policy's divergence from the proximal one, per token.
    count = jnp.maximum(jnp.sum(mask), 1.0)
    first['behaviour_kl'] = jnp.sum(
        (batch.behaviour_logps - proximal) * mask) / count
    return params, opt_state, first

  return update
