"""What the study measures, cached per model in `measures/` below the
workdir (`train.analysis.measure_cache`: reused where made with the same
settings, config and model file, refused where made with others).

Each mid-trained model (`mid_<variant>_seed<s>.json`; the checkpoint's
once, `mid_checkpoint.json`):
  heldout_ce   cross-entropy (nats per token, `train.lm.heldout`) on
               held-out windows no run trains on
               (`train.lm.data.heldout_windows`: Python's documentation
               and template reviews, test splits);
  quant_ce     the same for its 4-bit quantisation
               (`train.lm.quantization.fake_quantize`, round-to-nearest
               per group of `group_size` input weights);
  probes, quant_probes   the knowledge probes (`probes`) of both;
and, in `sharpness_<model>.json` (its own settings, so that it can be
measured again alone), the sharpness of the mid-training loss at the
model, on a fixed batch of `sharpness_windows` training windows, in the
parameters mid-training trains (the frozen embedding held constant):
  lambda_max, lambda_min   the ends of the Hessian's spectrum
               (`geom.curvature.lanczos`, `lanczos_steps` products: the
               largest *positive* curvature, which power iteration misses
               here, a negative eigenvalue of about -2e5 dominating);
  trace, trace_stderr      Hutchinson's estimate with `trace_probes`
               Rademacher probes and its standard error.
Each post-trained model (`post_<variant>_seed<s>.json`): heldout_ce and
probes again, and what post-training bought: the held-out answer
cross-entropy and greedy pass@1 per difficulty.
"""

import functools
import json
import os
from typing import Any

import jax
import numpy as np

from geom import curvature
from studies.gemma_midtraining import probes
from studies.gemma_midtraining import settings as settings_lib
from studies.gemma_midtraining.settings import CHECKPOINT
from studies.gemma_midtraining.settings import Settings
from train.analysis import measure_cache
from train.lm import data as lm_data
from train.lm import heldout
from train.lm import models
from train.lm import quantization
from train.lm import tokenizer as lm_tokenizer
from train.lm import trainer as lm_trainer
from train.rl import sft
from train.rl import tasks
from train.run import checkpointing
from train.run import disk_space
from train.training import optim

_BATCH = 8  # Held-out windows per compiled call.
_TEXT = ('windows', 'window_len', 'bits', 'group_size')
_SHARPNESS = ('lanczos_steps', 'trace_probes', 'sharpness_windows')


# One compiled program per tree of shapes (eager, a 270M tree is 3 s of
# dispatch per model).
_quantize = jax.jit(quantization.fake_quantize, static_argnums=(1, 2))


def _identity(settings: Settings, config, root: str,
              measured: tuple[str, ...] = _TEXT) -> dict:
  as_json = json.loads(config.to_json())
  if as_json.get('init_from'):  # Relative: the workdir may move.
    as_json['init_from'] = os.path.relpath(as_json['init_from'], root)
  return dict(settings={k: getattr(settings, k) for k in measured},
              gguf=models.fingerprints(config)[models.GGUF_FINGERPRINT],
              config=as_json)


def _text_measures(settings: Settings, model, tokenizer,
                   *param_sets) -> list[dict]:
  """Held-out CE and probes of each parameter set of `model`, the text
  tokenized once for all of them."""
  windows = lm_data.heldout_windows(tokenizer, settings.windows,
                                    settings.window_len)
  tokens, mask = probes.encode(tokenizer, lm_tokenizer.bos_id(tokenizer))
  return [dict(heldout_ce=heldout.cross_entropy(model, params, windows,
                                                _BATCH),
               probes=probes.score(model, params, tokens, mask))
          for params in param_sets]


def _trainable(config, params) -> tuple[list, list, Any]:
  """(the leaves `config` trains, the frozen ones, a function of (frozen,
  trained) giving the whole tree)."""
  leaves, treedef = jax.tree.flatten(params)
  mask = optim.frozen_mask(config.optimizer, params)
  frozen = jax.tree.leaves(mask) if mask is not None else [False] * len(
      leaves)
  where = [i for i, f in enumerate(frozen) if not f]
  fixed = [i for i, f in enumerate(frozen) if f]

  def whole(frozen_leaves, trained):
    full = list(leaves)
    for i, x in zip(where + fixed, list(trained) + list(frozen_leaves)):
      full[i] = x
    return jax.tree.unflatten(treedef, full)
  return [leaves[i] for i in where], [leaves[i] for i in fixed], whole


def sharpness(settings: Settings, config, params, tokenizer,
              workdir: str) -> dict:
  """The ends of the Hessian's spectrum and its trace, for the
  mid-training loss at `params` on the first `sharpness_windows`
  training windows of seed 12345 (the same for every model), in the
  parameters `config` trains."""
  out = {}
  exp = lm_trainer.build(config, workdir, check_data=False)
  windows = lm_data.load_windows(config.data, 'train', 12345,
                                 tokenizer=tokenizer)
  batch = {'tokens': np.asarray(windows.tokens[:settings.sharpness_windows])}
  trained, frozen, whole = _trainable(config, params)

  def loss(fixed, p):
    losses, _, _ = exp.per_example(exp.model, {'params': whole(fixed, p),
                                               'batch_stats': {}}, batch,
                                   False)
    return losses.mean()
  # The frozen leaves (Gemma's 168M-parameter tied embedding) are
  # arguments, not constants folded into the compiled program (a probe
  # closing over 100 MB compiled in 4.8 s against 0.15 s as an argument);
  # the program is then the same for every model.
  if settings.lanczos_steps:
    spectrum = jax.jit(lambda fixed, p, key: curvature.lanczos(
        functools.partial(loss, fixed), p, key, settings.lanczos_steps))(
            frozen, trained, jax.random.key(0))
    out.update(lambda_max=float(spectrum.top),
               lambda_min=float(spectrum.bottom),
               lanczos_steps=int(spectrum.steps))
  if settings.trace_probes:
    trace = jax.jit(lambda fixed, p, key: curvature.hutchinson_trace(
        functools.partial(loss, fixed), p, key, settings.trace_probes))(
            frozen, trained, jax.random.key(1))
    out.update(trace=float(trace.mean), trace_stderr=float(trace.stderr))
  return out


def measure_sharpness(settings: Settings, base, root: str, variant: str,
                      seed: int) -> dict:
  """`sharpness` of a mid-trained model (the checkpoint's for
  CHECKPOINT), cached in its own record; {} where nothing is measured."""
  if not settings.lanczos_steps and not settings.trace_probes:
    return {}
  checkpoint = variant == CHECKPOINT
  config = settings_lib.mid_config(
      base, settings_lib.REFERENCE if checkpoint else variant,
      0 if checkpoint else seed)
  name = 'checkpoint' if checkpoint else f'{variant}_seed{seed}'

  def compute():
    if checkpoint:
      return sharpness(settings, config, models.pretrained(config).params,
                       models.tokenizer(config), root)
    run_dir = settings_lib.mid_dir(root, variant, seed)
    trained = lm_trainer.load_trained(run_dir)
    return sharpness(settings, config, trained.params, trained.tokenizer,
                     run_dir)
  record = measure_cache.cached(
      os.path.join(root, 'measures', f'sharpness_{name}.json'),
      _identity(settings, config, root, _SHARPNESS), compute)
  return {k: v for k, v in record.items() if k != 'identity'}


def ensure_midtrained(settings: Settings, base, root: str, variant: str,
                      seed: int) -> None:
  """Trains (or resumes) the mid-trained (variant, seed) when a record
  that needs its run (sharpness, post-training) is missing and the run's
  last checkpoint is not there: a workdir may hold the records of a run
  and not the run."""
  names = [f'post_{variant}_seed{seed}']
  if settings.lanczos_steps or settings.trace_probes:
    names.append(f'sharpness_{variant}_seed{seed}')
  if all(os.path.exists(os.path.join(root, 'measures', f'{n}.json'))
         for n in names):
    return
  run_dir = settings_lib.mid_dir(root, variant, seed)
  config = settings_lib.mid_config(base, variant, seed)
  if config.num_steps not in disk_space.completed_steps(
      os.path.join(run_dir, checkpointing.CHECKPOINTS)):
    lm_trainer.train_and_evaluate(config, run_dir)


def _logged(run_dir: str) -> dict:
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    logged = [r for r in map(json.loads, f) if 'train_loss' in r]
  return dict(final_train_loss=logged[-1]['train_loss'],
              hallucination_steps=logged[-1].get(
                  'opt/hallucination_steps', 0))


def measure_mid(settings: Settings, base, root: str, variant: str,
                seed: int) -> dict:
  """Mid-trains (or resumes, or reuses) one model and measures it; the
  checkpoint's (any seed) is the model file's."""
  checkpoint = variant == CHECKPOINT
  config = settings_lib.mid_config(
      base, settings_lib.REFERENCE if checkpoint else variant,
      0 if checkpoint else seed)
  run_dir = None if checkpoint else settings_lib.mid_dir(root, variant, seed)

  def compute():
    if checkpoint:
      model, tokenizer = models.create(config), models.tokenizer(config)
      params = models.pretrained(config).params
      extra = dict(pass_at_1=sft.evaluate_pass_at_1(
          base.posttrain, model, params, tasks.codec(tokenizer)))
    else:
      lm_trainer.train_and_evaluate(config, run_dir)
      trained = lm_trainer.load_trained(run_dir)
      model, params, tokenizer = (trained.model, trained.params,
                                  trained.tokenizer)
      extra = _logged(run_dir)
    quantised = _quantize(params, settings.bits, settings.group_size or None)
    text, quant = _text_measures(settings, model, tokenizer, params,
                                 quantised)
    return dict(variant=variant, seed=None if checkpoint else seed,
                heldout_ce=text['heldout_ce'], probes=text['probes'],
                quant_ce=quant['heldout_ce'], quant_probes=quant['probes'],
                **extra)
  name = 'mid_checkpoint' if checkpoint else f'mid_{variant}_seed{seed}'
  return measure_cache.cached(
      os.path.join(root, 'measures', f'{name}.json'),
      _identity(settings, config, root), compute)


def measure_post(settings: Settings, base, root: str, variant: str,
                 seed: int) -> dict:
  """Post-trains (or resumes, or reuses) one model and measures it."""
  config = settings_lib.post_config(base, root, variant, seed)
  run_dir = settings_lib.post_dir(root, variant, seed)

  def compute():
    final = sft.train_and_evaluate(config, run_dir)
    policy = sft.load_policy(run_dir)
    tokenizer = lm_tokenizer.for_trained(policy.config, run_dir,
                                         policy.codec.name)
    text, = _text_measures(settings, policy.model, tokenizer, policy.params)
    return dict(
        variant=variant, seed=seed, **text, answer_ce=final['val_loss'],
        pass_at_1={k[len('pass_at_1_'):]: v for k, v in final.items()
                   if k.startswith('pass_at_1_')}, **_logged(run_dir))
  return measure_cache.cached(
      os.path.join(root, 'measures', f'post_{variant}_seed{seed}.json'),
      _identity(settings, config, root), compute)
