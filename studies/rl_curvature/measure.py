"""lambda_max of the policy's loss per difficulty, on the SFT warm starts.

For each warm start and each difficulty: prompts training problems, each
sampled several times from the policy at temperature 1.0
(`train.rl.rollout.sample`), assembled into the learner's batch
(`train.rl.learner.assemble`); the loss is the mean negative
log-likelihood of the sampled answer tokens under the policy (the
batch's loss mask), whose Hessian's expectation over on-policy samples
is the Fisher information (see `geom.gas`). Every batch is padded to the
hardest difficulty's length, so each estimator compiles once for all
warm starts and difficulties; padding carries no loss.

Per batch: |lambda_max| by `geom.gas.curvature(method='power')` and the
one-product proxy (`method='rayleigh'`), each timed after a warm-up call
that compiles it; and, untimed, signed power iteration with more
products, to show whether the power estimate had converged and whether
the top-magnitude eigenvalue is negative (the sample Hessian need not be
PSD). Per warm start: alpha fitted by `geom.gas.fit_alpha` from each
method, and the Spearman rank correlation of power and proxy across
difficulties.
"""

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from geom import curvature
from geom import gas
from train.rl import grpo
from train.rl import learner
from train.rl import rollout
from train.rl import sft
from train.rl import tasks
from train.analysis import stats


def nll_loss(model: Any, batch: Any) -> Callable[[Any], jax.Array]:
  """params -> the mean negative log-likelihood of the batch's answer tokens
  (the completions the policy sampled), over its loss mask."""
  mask = jnp.asarray(batch.loss_mask, jnp.float32)
  tokens, valid = jnp.asarray(batch.tokens), jnp.asarray(batch.valid)

  def loss(params):
    logps = grpo.sequence_log_probs(model, params, tokens, valid)
    return -jnp.sum(logps * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  return loss


def estimators(model: Any, num_iters: int, check_iters: int
               ) -> dict[str, Callable[..., jax.Array]]:
  """Jitted (params, batch, key) -> estimate: 'power' and 'rayleigh' as
  |lambda_max| (`gas.curvature`), 'check' the signed eigenvalue after
  `check_iters` products."""
  def power(params, batch, key):
    return gas.curvature(nll_loss(model, batch), params, key, 'power',
                         num_iters)

  def proxy(params, batch, key):
    return gas.curvature(nll_loss(model, batch), params, key, 'rayleigh')

  def check(params, batch, key):
    return curvature.power_iteration(nll_loss(model, batch), params, key,
                                     check_iters).eigenvalue

  out = {'power': jax.jit(power), 'rayleigh': jax.jit(proxy)}
  if check_iters:
    out['check'] = jax.jit(check)
  return out


def on_policy_batch(model: Any, params: Any, family: str, difficulty: int,
                    prompts: int, samples: int, length: int, seed: int,
                    key: jax.Array, codec: tasks.Codec = tasks.BYTES
                    ) -> tuple[Any, rollout.Rollout]:
  """`prompts` training problems of `seed` (the same for every warm
  start, so that they compare on equal problems), `samples` completions
  of each at temperature 1, and their learner batch (numpy) padded to
  `length` tokens."""
  problems = tasks.sample(family, difficulty, prompts, seed)
  problems = [p for p in problems for _ in range(samples)]
  out = rollout.sample(model, params, problems, key, temperature=1.0,
                       num_steps=tasks.max_answer_tokens(family, difficulty),
                       codec=codec)
  return learner.assemble(out, samples, length), out


def _timed(fn, *args) -> tuple[float, float]:
  start = time.perf_counter()
  value = float(jax.block_until_ready(fn(*args)))
  return value, time.perf_counter() - start


def measure(sft_workdirs: list[str], difficulties: list[int], *, family: str,
            prompts: int, samples: int, num_iters: int, check_iters: int,
            seed: int) -> dict[str, Any]:
  """Every estimate, fit and timing, as a JSON-able dict."""
  length = (tasks.max_prompt_tokens(family, max(difficulties))
            + tasks.max_answer_tokens(family, max(difficulties)))
  device = jax.devices()[0]
  runs, seconds = [], {'power': [], 'rayleigh': []}
  fns, warmed = None, False
  for workdir in sft_workdirs:
    _, model, params, codec = sft.load_policy(workdir)
    params = jax.device_put(params, device)
    if fns is None:
      fns = estimators(model, num_iters, check_iters)
    rows = []
    for d in difficulties:
      key = jax.random.fold_in(jax.random.key(seed), d)
      batch, out = on_policy_batch(model, params, family, d, prompts, samples,
                                   length, seed, key, codec)
      batch = jax.device_put(batch, device)
      hkey = jax.random.fold_in(key, 1)
      if not warmed:  # Compile each estimator before anything is timed.
        for name in ('power', 'rayleigh'):
          jax.block_until_ready(fns[name](params, batch, hkey))
        warmed = True
      row = {'difficulty': d, 'reward': float(out.rewards.mean()),
             'answer_tokens': float(np.asarray(batch.loss_mask).sum()
                                    / len(out.rewards)),
             'nll': float(nll_loss(model, batch)(params))}
      for name in ('power', 'rayleigh'):
        row[name], s = _timed(fns[name], params, batch, hkey)
        seconds[name].append(s)
        row[f'{name}_seconds'] = s
      if check_iters:
        row['check_signed'] = float(fns['check'](params, batch, hkey))
        row['check_rel_diff'] = abs(row['power'] - abs(row['check_signed'])
                                    ) / abs(row['check_signed'])
      rows.append(row)
      print(f'{workdir} d={d}: power {row["power"]:.4g} rayleigh '
            f'{row["rayleigh"]:.4g} ({row["power_seconds"]:.2f} s, '
            f'{row["rayleigh_seconds"]:.2f} s)', flush=True)
    fits = {f'alpha_{name}': gas.fit_alpha(
        difficulties, np.log([r[name] for r in rows]))
            for name in ('power', 'rayleigh')}
    if check_iters:
      fits['alpha_check'] = gas.fit_alpha(
          difficulties, np.log([abs(r['check_signed']) for r in rows]))
    fits['spearman'] = stats.spearman([r['power'] for r in rows],
                                [r['rayleigh'] for r in rows])
    runs.append({'sft_workdir': workdir, 'rows': rows, **fits})
  return {
      'settings': {'family': family, 'difficulties': difficulties,
                   'prompts': prompts, 'samples': samples,
                   'num_iters': num_iters, 'check_iters': check_iters,
                   'seed': seed, 'length': length,
                   'device': str(device), 'backend': jax.default_backend()},
      'runs': runs,
      'seconds_per_estimate': {k: float(np.mean(v)) for k, v in
                               seconds.items()},
  }
