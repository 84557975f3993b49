"""`train_and_evaluate(config, workdir)` for the LMs (`config.task = 'lm'`).

The LM product's parts on the shared loop (`train.training.loop`): the model
(`train.lm.models`: the in-project decoder from `config.seed`, or a
pretrained Gemma 3 from its GGUF file, fine-tuned with its own tokenizer,
the file pinned by its SHA-256), its per-sequence loss (`train.lm.loss`) and the
data, token windows of a source mixture (`train.lm.data`), built
deterministically from the config, so nothing but the step is needed to
resume. Tokens are bytes, or subwords of a SentencePiece model trained on
the run's own training text and kept beside its checkpoints
(`train.lm.tokenizer`; every checkpoint records its fingerprint). The final
evaluation reports held-out cross-entropy per source (`val_<source>_loss`,
nats per token) next to the mixture's. The mesh and
shardings, the optax chain (SAM included), the step, checkpoints with
resume and SIGTERM, metrics and plots are the shared ones.

`config.init_from` (unset by default) names another LM run's workdir: a
new run starts from its latest verified parameters (fine-tuning,
continued training) with a fresh optimizer state; the field is part of
the config, so a resume checks it like any other. Such a run keeps the
other run's tokenizer (a copy of its file, checked against its
checkpoint), whatever `config.tokenizer` says.
"""

from collections.abc import Sequence
import functools
from typing import Any, NamedTuple

from absl import logging
import flax.linen as nn
import jax
import ml_collections
import numpy as np

from train.training import experiment as experiment_lib
from train.training import loop
from train.training import model_shapes
from train.run import resume_check
from train.errors import ConfigError
from train.lm import data as lm_data
from train.lm import loss
from train.lm import models
from train.lm import tokenizer as lm_tokenizer

FINAL_METRICS = loop.FINAL_METRICS


def init_variables(model: nn.Module, rng: jax.Array) -> dict:
  return model.init(rng, np.zeros((1, 8), np.int32))


def abstract_variables(model: nn.Module) -> dict:
  """`init_variables`' shapes, traced once per model in a process
  (`train.training.model_shapes`). Read-only."""
  return model_shapes.abstract_variables(
      functools.partial(init_variables, model))


def create_model(config: ml_collections.ConfigDict) -> nn.Module:
  """The model of `config.model` (`train.lm.models`), and the data's
  window length checked against it."""
  model = models.create(config)
  # (Products on this model with their own data check their lengths.)
  if config.data.get('seq_len', 0) > model.max_len:
    raise ConfigError('data.seq_len', config.data.seq_len,
                      f'exceeds model.max_len={model.max_len}')
  return model


def build(config: ml_collections.ConfigDict, workdir: str, *,
          devices: Sequence[Any] | None = None,
          check_data: bool = True) -> experiment_lib.Experiment:
  """Validates `config` (data sources, model, then what every run shares)
  and builds the parts; nothing is placed or compiled. `devices`: the
  mesh's (default: this job's); `check_data=False` skips the checks that
  the text sources are here and `init_from` holds checkpoints (compiling
  needs shapes only)."""
  lm_data.check_config(config.data, check_sources=check_data)
  model = create_model(config)
  lm_tokenizer.check_config(config)
  if check_data and config.get('init_from'):
    experiment_lib.require_checkpoints(
        config.init_from, field='config.init_from',
        hint='train the run to start from first')
  if check_data:
    models.check_inputs(config)
  return experiment_lib.assemble(
      config, workdir, model=model,
      init_variables=functools.partial(init_variables, model),
      per_example=loss.lm_loss,
      columns={'tokens': ((config.data.seq_len + 1,),
                          lm_tokenizer.token_dtype(
                              models.vocab_size(config)))},
      devices=devices)


def run_tokenizer(config: ml_collections.ConfigDict, workdir: str,
                  source: 'TrainedLM | None' = None) -> lm_tokenizer.Tokenizer:
  """The run's tokenizer (trained, or a pretrained model's, and saved on
  its first start), or, for a run started from `source`
  (`config.init_from`), the source's, copied into `workdir`."""
  if source is not None:
    if not isinstance(source.tokenizer, lm_tokenizer.ByteTokenizer):
      lm_tokenizer.save(workdir, source.tokenizer)
    return source.tokenizer
  return lm_tokenizer.for_run(config, workdir)


def inputs(config: ml_collections.ConfigDict) -> dict[str, str]:
  """Fingerprints of the files a run reads besides its data: a
  pretrained model's (the init_from run's parameters are checked by
  shape when they are loaded)."""
  return {} if config.get('init_from') else models.fingerprints(config)


def load_data(config: ml_collections.ConfigDict, workdir: str,
              source: 'TrainedLM | None' = None) -> loop.Data:
  """Training and validation windows now; at the end the validation
  mixture, each source's share of it, and the test mixture."""
  tokenizer = run_tokenizer(config, workdir, source)
  windows = functools.partial(lm_data.load_windows, config.data,
                              seed=config.seed, tokenizer=tokenizer)
  train = windows('train')
  validation = windows('validation')
  logging.info('LM data: %d training and %d validation windows of %d '
               'tokens (%s)', len(train), len(validation),
               config.data.seq_len, tokenizer.kind)

  def final():
    splits = {'val': validation}
    for source in lm_data.source_names(config.data):
      splits[f'val_{source}'] = windows('validation', only=source)
    splits['test'] = windows('test')
    return splits

  return loop.Data(train=train, validation=validation, final=final,
                   fingerprints={lm_tokenizer.FILENAME:
                                 tokenizer.fingerprint})


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, float]:
  """Trains the LM into `workdir` (resuming if it holds a checkpoint).

  Returns the final metrics: `val_loss` / `val_accuracy` on the held-out
  mixture (nats per byte, next-byte accuracy), `val_<source>_loss` per
  source, `test_loss` on the test mixture, and `step`.
  """
  exp = build(config, workdir)
  if config.get('init_from'):
    # Loaded once, inside the loop (under the workdir's lock): the data
    # needs its tokenizer, a new run its parameters.
    source = functools.cache(lambda: load_trained(config.init_from))
    return loop.train_and_evaluate(
        exp, lambda: load_data(config, exp.workdir, source()),
        lambda: {'params': source().params})
  pretrained = functools.cache(lambda: models.pretrained(config))
  return loop.train_and_evaluate(
      exp, functools.partial(load_data, config, exp.workdir),
      None if models.kind(config) == 'decoder'
      else lambda: {'params': pretrained().params},
      inputs=inputs(config))


class TrainedLM(NamedTuple):
  config: ml_collections.ConfigDict
  model: nn.Module
  params: dict
  tokenizer: lm_tokenizer.Tokenizer


def load_trained(lm_workdir: str) -> TrainedLM:
  """The config, model, parameters and tokenizer of the latest good
  checkpoint in `lm_workdir`; the tokenizer is checked against the
  fingerprint the checkpoint recorded.

  Raises:
    UsageError: `lm_workdir` holds no checkpoint, or not an LM's; or its
      tokenizer file is missing or is not the checkpoint's.
    NoGoodCheckpoint: it holds checkpoints and none loads and verifies.
  """
  run = experiment_lib.load_trained(
      lm_workdir, build, field='config.lm_workdir', task='lm', what='an LM',
      hint=('train the LM first with `python -m launch.train '
            f'--config=configs/lm.py --workdir={lm_workdir}`'))
  recorded = (run.meta.get(resume_check.FINGERPRINTS) or {}).get(
      lm_tokenizer.FILENAME)
  tokenizer = lm_tokenizer.for_trained(run.config, lm_workdir, recorded)
  logging.info('Loaded the LM at step %d from %s (%s tokens)', run.step,
               lm_workdir, tokenizer.kind)
  return TrainedLM(run.config, run.exp.model, run.state.params, tokenizer)
