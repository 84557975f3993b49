"""Sampling completions of task prompts with their behaviour log-probabilities.

One jitted program per (batch, prompt length, steps, temperature): the
policy's KV-cached generation (`train.lm.generate`; the in-project
decoder or Gemma 3), then
each generated token's log-probability under the distribution it was
drawn from, softmax(logits / temperature), recorded at generation time
(the behaviour policy's, which off-policy corrections need). Rewards are
the task verifier's, on the host, on the text the policy's codec
(`tasks.Codec`) reads. A row's tokens after its first newline token are
padding: not rewarded, not trained.
"""

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from train.training import aot
from train.lm import generate as generate_lib
from train.rl import grpo
from train.rl import tasks


@dataclasses.dataclass(frozen=True)
class Rollout:
  """Completions of a batch of prompts (host arrays).

  Attributes:
    problems: the prompts' problems (one per row).
    prompt: (B, P) int32 left-padded prompts; prompt_valid (B, P) bool.
    completion: (B, S) int32 generated tokens; completion_mask (B, S)
      bool, up to and including the first newline token.
    behaviour_logps: (B, S) float32, log pi_behave of each generated
      token (0 off the mask).
    rewards: (B,) float32 from the verifier.
    version: the policy version that generated them.
  """
  problems: tuple[tasks.Problem, ...]
  prompt: np.ndarray
  prompt_valid: np.ndarray
  completion: np.ndarray
  completion_mask: np.ndarray
  behaviour_logps: np.ndarray
  rewards: np.ndarray
  version: int = 0

  @property
  def generated_tokens(self) -> int:
    return int(self.completion_mask.sum())


def _sample_fn(model, params: Any, prompt: jax.Array,
               prompt_valid: jax.Array, num_steps: int, temperature: float,
               rng: jax.Array) -> tuple[jax.Array, jax.Array]:
  out = generate_lib.generate(model, params, prompt, prompt_valid, num_steps,
                              temperature=temperature,
                              rng=None if temperature == 0 else rng)
  logps = grpo.token_log_probs(out.logits, out.tokens,
                               temperature if temperature > 0 else 1.0)
  return out.tokens, logps


_sample = jax.jit(_sample_fn, static_argnums=(0, 4, 5))


def sample_program(model, params: Any, rows: int,
                   prompt_len: int, num_steps: int, temperature: float,
                   mesh: jax.sharding.Mesh) -> aot.Program:
  """`sample`'s program on shapes only (for `launch.compile`): the policy
  (abstract `params`) replicated on `mesh`, `rows` prompts of
  `prompt_len` tokens split over its 'data' axis, `num_steps` tokens
  generated with the KV cache."""
  repl = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  split = jax.sharding.NamedSharding(mesh,
                                     jax.sharding.PartitionSpec('data'))
  place = lambda tree, sharding: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
      tree)
  fn = jax.jit(lambda p, prompt, valid, rng: _sample_fn(
      model, p, prompt, valid, num_steps, float(temperature), rng))
  return aot.Program(
      f'rollout_generate ({num_steps} tokens)', fn,
      (place(params, repl),
       jax.ShapeDtypeStruct((rows, prompt_len), np.int32, sharding=split),
       jax.ShapeDtypeStruct((rows, prompt_len), np.bool_, sharding=split),
       place(jax.eval_shape(lambda: jax.random.key(0)), repl)))


def sample(model, params: Any,
           problems: Sequence[tasks.Problem], rng: jax.Array | None, *,
           temperature: float = 1.0, num_steps: int | None = None,
           prompt_len: int | None = None, version: int = 0,
           sharding: jax.sharding.Sharding | None = None,
           codec: tasks.Codec = tasks.BYTES) -> Rollout:
  """Completes `problems` (temperature 0: greedy) and verifies them.

  Args:
    model, params: the policy (params on any devices; the call runs where
      they are).
    problems: one prompt per row.
    rng: the sampling key (unused when greedy).
    temperature: sampling temperature.
    num_steps: tokens to generate (default: the longest target among the
      problems, so each can finish).
    prompt_len: pad prompts to this length (default: the longest).
    version: recorded on the rollout.
    sharding: where the prompts go (rows split over a mesh's data axis);
      None: the default device.
    codec: the policy's tokens (`tasks.Codec`; default bytes).
  """
  prompt, valid = tasks.encode_prompts(problems, prompt_len, codec)
  if num_steps is None:
    num_steps = max(tasks.max_answer_tokens(p.family, p.difficulty)
                    for p in problems)
  put = (jnp.asarray if sharding is None
         else lambda x: jax.device_put(x, sharding))
  tokens, logps = _sample(model, params, put(prompt), put(valid), num_steps,
                          float(temperature),
                          jax.random.key(0) if rng is None else rng)
  tokens, logps = np.asarray(tokens), np.asarray(logps, np.float32)
  mask = tasks.completion_mask(tokens, codec)
  rewards = np.array([tasks.reward(p, tasks.decode_completion(t, codec))
                      for p, t in zip(problems, tokens)], np.float32)
  return Rollout(tuple(problems), prompt, valid, tokens, mask,
                 np.where(mask, logps, 0.0).astype(np.float32), rewards,
                 version)


def pass_at_1(model, params: Any,
              problems: Sequence[tasks.Problem], batch_size: int = 256,
              sharding: jax.sharding.Sharding | None = None,
              codec: tasks.Codec = tasks.BYTES) -> float:
  """The share of `problems` that greedy decoding answers exactly."""
  if not problems:
    raise ValueError('pass_at_1: no problems')
  prompt_len = 1 + max(len(p.prompt) for p in problems)
  num_steps = max(tasks.max_answer_tokens(p.family, p.difficulty)
                  for p in problems)
  correct = 0.0
  for start in range(0, len(problems), batch_size):
    chunk = list(problems[start:start + batch_size])
    # Pad the last chunk to the batch size: one compiled program.
    padded = chunk + [chunk[-1]] * (min(batch_size, len(problems)) -
                                     len(chunk))
    out = sample(model, params, padded, None, temperature=0.0,
                 num_steps=num_steps, prompt_len=prompt_len,
                 sharding=sharding, codec=codec)
    correct += float(out.rewards[:len(chunk)].sum())
  return correct / len(problems)
