"""What the study measures on each model, cached per model in `measures/`
below the workdir.

Per run: the forgetting, i.e. the increase of the model's cross-entropy
(nats per token, `train.lm.heldout`) on held-out text it never sees in
fine-tuning (`train.lm.data.heldout_windows`: Python's documentation and
template reviews, test splits) over the pretrained model's; and what the
fine-tuning bought: the held-out answer cross-entropy and greedy pass@1
per difficulty. With `sharpness_iters` > 0, also the sharpness of each
model (the pretrained one included) on the fine-tuning loss: the top
eigenvalue of its Hessian in the trained parameters (power iteration,
`geom.curvature`) on a fixed batch of `sharpness_problems` training
problems, whether SAM's minima are flatter where it matters to SAM.

A measure is reused where it was made with the same settings, config and
model file, and refused (UsageError) where it was made with others.
"""

import json
import os

import jax
import numpy as np

from geom import curvature
from studies.gemma_forgetting.settings import REFERENCE
from studies.gemma_forgetting.settings import Settings
from studies.gemma_forgetting.settings import run_config
from train.analysis import measure_cache
from train.lm import data as lm_data
from train.lm import heldout
from train.lm import models
from train.lm import tokenizer as lm_tokenizer
from train.rl import sft
from train.rl import tasks

# Held-out windows per compiled call.
_BATCH = 8


def sharpness_batch(config, codec: tasks.Codec, count: int
                    ) -> dict[str, np.ndarray]:
  """`count` training problems, the same for every model of a study
  (spread over the config's families and difficulties)."""
  cells = [(f, d) for f in config.data.families
           for d in config.data.difficulties]
  problems = [p for i, (f, d) in enumerate(cells)
              for p in tasks.sample(f, d, count // len(cells)
                                    + (i < count % len(cells)), 54321)]
  examples = sft.encode(problems, sft.sequence_length(config.data), codec,
                        sft.token_dtype(config))
  return examples.columns()


def top_eigenvalue(config, params, codec: tasks.Codec,
                   settings: Settings, workdir: str) -> dict:
  """The top Hessian eigenvalue of the fine-tuning loss at `params` in
  the parameters the config trains (its loss sees frozen ones through
  stop_gradient, so their rows of the Hessian are zero)."""
  exp = sft.build(config, workdir, check_data=False)
  batch = sharpness_batch(config, codec, settings.sharpness_problems)

  def loss(p):
    losses, _, _ = exp.per_example(exp.model, {'params': p,
                                               'batch_stats': {}}, batch,
                                   False)
    return losses.mean()

  top = jax.jit(lambda p, key: curvature.power_iteration(
      loss, p, key, settings.sharpness_iters, tol=1e-3))(
          params, jax.random.key(0))
  return dict(lambda_max=float(top.eigenvalue),
              power_iterations=int(top.iterations))


def measure_sharpness(settings: Settings, base, root: str, variant: str | None,
                      seed: int) -> dict:
  """`top_eigenvalue` of a run's model (the pretrained one for None):
  lambda_max and power_iterations."""
  config = run_config(base, variant or REFERENCE, seed)
  name = 'pretrained' if variant is None else f'{variant}_seed{seed}'
  identity = dict(iters=settings.sharpness_iters,
                  problems=settings.sharpness_problems,
                  gguf=models.fingerprints(config)[models.GGUF_FINGERPRINT],
                  config=None if variant is None
                  else json.loads(config.to_json()))

  def compute():
    if variant is None:
      loaded = models.pretrained(config)
      return top_eigenvalue(config, loaded.params,
                            tasks.codec(loaded.tokenizer), settings, root)
    run_dir = os.path.join(root, 'runs', name)
    policy = sft.load_policy(run_dir)
    return top_eigenvalue(config, policy.params, policy.codec, settings,
                          run_dir)
  record = measure_cache.cached(
      os.path.join(root, 'measures', f'sharpness_{name}.json'), identity,
      compute)
  return {k: record[k] for k in ('lambda_max', 'power_iterations')}


def _identity(settings: Settings, config, gguf_sha: str) -> dict:
  return dict(gguf=gguf_sha, windows=settings.windows,
              window_len=settings.window_len,
              config=json.loads(config.to_json()))


def measure_pretrained(settings: Settings, base, root: str) -> dict:
  """The pretrained model's held-out CE and pass@1 (once per study)."""
  sha = models.fingerprints(base)[models.GGUF_FINGERPRINT]
  identity = dict(gguf=sha, windows=settings.windows,
                  window_len=settings.window_len,
                  data=json.loads(base.data.to_json()))

  def compute():
    loaded = models.pretrained(base)
    model = models.create(base)
    windows = lm_data.heldout_windows(loaded.tokenizer, settings.windows,
                                      settings.window_len)
    codec = tasks.codec(loaded.tokenizer)
    return dict(heldout_ce=heldout.cross_entropy(model, loaded.params,
                                                 windows, _BATCH),
                pass_at_1=sft.evaluate_pass_at_1(base, model, loaded.params,
                                                 codec))
  return measure_cache.cached(
      os.path.join(root, 'measures', 'pretrained.json'), identity, compute)


def measure_run(settings: Settings, base, root: str, variant: str,
                seed: int) -> dict:
  """Trains (or resumes, or reuses) one run and measures it."""
  config = run_config(base, variant, seed)
  run_dir = os.path.join(root, 'runs', f'{variant}_seed{seed}')
  sha = models.fingerprints(config)[models.GGUF_FINGERPRINT]

  def compute():
    final = sft.train_and_evaluate(config, run_dir)
    policy = sft.load_policy(run_dir)
    windows = lm_data.heldout_windows(
        lm_tokenizer.for_trained(policy.config, run_dir, policy.codec.name),
        settings.windows, settings.window_len)
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
      logged = [r for r in map(json.loads, f) if 'train_loss' in r]
    return dict(
        variant=variant, seed=seed,
        heldout_ce=heldout.cross_entropy(policy.model, policy.params,
                                         windows, _BATCH),
        answer_ce=final['val_loss'], answer_exact=final['val_accuracy'],
        pass_at_1={k[len('pass_at_1_'):]: v for k, v in final.items()
                   if k.startswith('pass_at_1_')},
        final_train_loss=logged[-1]['train_loss'],
        hallucination_steps=logged[-1].get('opt/hallucination_steps', 0))
  return measure_cache.cached(
      os.path.join(root, 'measures', f'{variant}_seed{seed}.json'),
      _identity(settings, config, sha), compute)
