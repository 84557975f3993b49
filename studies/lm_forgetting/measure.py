"""One (variant, seed) of the study: its runs trained (what is missing) and
its measures, kept in `measures/` below the workdir so a rerun only
computes what is missing.

Measured: the pretraining held-out cross-entropy (nats per byte, the
validation windows of the pretraining data) before, after post-training
and after 4-bit quantisation (`train.lm.quantization.fake_quantize`); the
post-training target's held-out CE before and after, so that a smaller
forgetting bought by a worse fit shows; and the sharpness of the
pretrained model: the top Hessian eigenvalue (power iteration) and the
trace (Hutchinson) of the pretraining loss on `hessian_windows` training
windows (`geom.curvature`).
"""

import functools
import json
import os

from absl import logging
import jax
import numpy as np
import optax

from geom import curvature
from studies.lm_forgetting import runs
from studies.lm_forgetting.settings import Settings
from train.run import metrics
from train.lm import data as lm_data
from train.lm import heldout
from train.lm import quantization
from train.lm import trainer


@functools.cache
def _sharpness_fns(model, power_iters: int, trace_samples: int):
  """Jitted (params, tokens, key) -> top Hessian eigenpair and Hutchinson
  trace, one pair per model and settings: each holds the LM's
  Hessian-vector product in a loop, the study's costliest compiles (10-20 s
  each on a CPU), and every variant and seed reuses them."""

  def loss_on(tokens):
    def loss(p):
      logits, _ = model.apply({'params': p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, tokens[:, 1:]).mean()
    return loss

  top = jax.jit(lambda p, tokens, key: curvature.power_iteration(
      loss_on(tokens), p, key, power_iters, tol=1e-3))
  trace = jax.jit(lambda p, tokens, key: curvature.hutchinson_trace(
      loss_on(tokens), p, jax.random.fold_in(key, 1), trace_samples))
  return top, trace


def _sharpness(settings: Settings, model, params, windows, seed: int
               ) -> dict:
  tokens = np.asarray(windows[:settings.hessian_windows], np.int32)
  top_fn, trace_fn = _sharpness_fns(model, settings.power_iters,
                                    settings.trace_samples)
  key = jax.random.key(1000 + seed)
  top = top_fn(params, tokens, key)
  trace = trace_fn(params, tokens, key)
  return dict(lambda_max=float(top.eigenvalue),
              power_iterations=int(top.iterations),
              trace=float(trace.mean), trace_stderr=float(trace.stderr))


def measure(settings: Settings, variant: str, seed: int) -> dict:
  """Trains what is missing for (variant, seed) and measures it."""
  root = settings.workdir
  path = os.path.join(root, 'measures', f'{variant}_seed{seed}.json')
  if os.path.exists(path):
    return metrics.read_json(path)
  pre_dir = os.path.join(root, f'pretrain_{variant}_seed{seed}')
  post_dir = os.path.join(root, f'post_{variant}_seed{seed}')
  pre_config = runs.pretrain_config(settings, variant, seed)
  trainer.train_and_evaluate(pre_config, pre_dir)
  post = runs.post_config(settings, seed, pre_dir)
  post_final = trainer.train_and_evaluate(post, post_dir)
  with open(os.path.join(pre_dir, 'metrics.jsonl')) as f:
    last = [r for r in map(json.loads, f) if 'train_loss' in r][-1]
  pre = trainer.load_trained(pre_dir)
  model, pre_params = pre.model, pre.params
  post_params = trainer.load_trained(post_dir).params
  windows = functools.partial(lm_data.load_windows, seed=seed,
                              tokenizer=pre.tokenizer)
  held_out = windows(pre_config.data, 'validation').tokens
  target = windows(post.data, 'validation').tokens
  train_windows = windows(pre_config.data, 'train').tokens
  ce = functools.partial(heldout.cross_entropy, model)
  before = ce(pre_params, held_out)
  after_post = ce(post_params, held_out)
  quantised = quantization.fake_quantize(pre_params, settings.bits)
  after_quant = ce(quantised, held_out)
  out = dict(
      variant=variant, seed=seed, pretrain_ce=before,
      post_ce=after_post, quant_ce=after_quant,
      forgetting_post=after_post - before,
      forgetting_quant=after_quant - before,
      target_ce_before=ce(pre_params, target),
      target_ce_after=ce(post_params, target),
      post_trainer_val_loss=post_final['val_loss'],
      # The hallucination detector over pretraining (SAM variants).
      sam_steps=last.get('opt/sam_steps', 0),
      flagged_steps=last.get('opt/hallucination_steps', 0),
      **_sharpness(settings, model, pre_params, train_windows, seed))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  metrics.write_json_atomic(path, out)
  logging.info('%s seed %d: %s', variant, seed, out)
  return out
