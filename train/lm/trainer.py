"""`train_and_evaluate(config, workdir)` for the decoder LM (`config.task = 'lm'`).

The supervised trainer's parts, reused: the mesh and logical-axis
shardings, the optax chain (SAM included), the train step with its
non-finite policy (`steps.make_train_step` with `steps.lm_loss`), the
step-addressed batches, Orbax checkpoints with resume and SIGTERM, the
JSONL/TensorBoard metrics and `trainer.train_loop` itself. What is the
LM's own: the data (byte windows from `train.text_corpus`, built
deterministically from the config, so nothing but the step is needed to
resume) and the final evaluation, which reports held-out cross-entropy
per source (`val_<source>_loss`, nats per byte) next to the mixture's.
"""

import contextlib
import dataclasses
import functools
import json
import os

from absl import logging
import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding
import ml_collections
import numpy as np
import optax

from train import checkpointing
from train import decoder_lm
from train import experiment as experiment_lib
from train import fileio
from train import lm_data
from train import metrics as metrics_lib
from train import optim
from train import plots
from train import sharding as sharding_lib
from train import steps
from train import trainer as trainer_lib
from train.errors import ConfigError, UsageError

FINAL_METRICS = trainer_lib.FINAL_METRICS


@dataclasses.dataclass
class LMExperiment:
  """The LM run's parts; the attributes `trainer.train_loop` reads included."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: Mesh
  model: decoder_lm.DecoderLM
  tx: optax.GradientTransformationExtraArgs
  learning_rate: optax.Schedule
  state_shardings: steps.TrainState
  batch_sharding: NamedSharding
  abstract_state: steps.TrainState

  def init_state(self) -> steps.TrainState:
    return jax.jit(functools.partial(_init_state, self.model, self.tx),
                   out_shardings=self.state_shardings)(
                       jax.random.key(self.config.seed))

  def abstract_batch(self, batch_size: int,
                     with_mask: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    s = self.batch_sharding
    batch = {'tokens': jax.ShapeDtypeStruct(
        (batch_size, self.config.data.seq_len + 1), np.uint8, sharding=s)}
    if with_mask:
      batch['mask'] = jax.ShapeDtypeStruct((batch_size,), np.float32,
                                           sharding=s)
    return batch


def _init_state(model: decoder_lm.DecoderLM, tx: optax.GradientTransformation,
                rng: jax.Array) -> steps.TrainState:
  params = nn.meta.unbox(model.init(rng, np.zeros((1, 8), np.int32)))['params']
  return steps.TrainState(step=np.int32(0), params=params, batch_stats={},
                          opt_state=tx.init(params),
                          skipped_steps=np.int32(0))


def create_model(config: ml_collections.ConfigDict) -> decoder_lm.DecoderLM:
  kwargs = dict(config.model)
  fields = set(decoder_lm.DecoderLM.__dataclass_fields__) - {'parent', 'name'}
  unknown = sorted(set(kwargs) - fields)
  if unknown:
    raise ConfigError(f'model.{unknown[0]}', kwargs[unknown[0]],
                      'not a field of the decoder LM', sorted(fields))
  for field, value in kwargs.items():
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(f'model.{field}', value, 'must be a positive integer')
  if kwargs['d_model'] % kwargs['num_heads'] or (
      kwargs['d_model'] // kwargs['num_heads']) % 2:
    raise ConfigError('model.num_heads', kwargs['num_heads'],
                      f'must divide d_model={kwargs["d_model"]} into heads '
                      'of even size (rotary embeddings)')
  if config.data.seq_len > kwargs['max_len']:
    raise ConfigError('data.seq_len', config.data.seq_len,
                      f'exceeds model.max_len={kwargs["max_len"]}')
  return decoder_lm.DecoderLM(**kwargs)


def build(config: ml_collections.ConfigDict, workdir: str) -> LMExperiment:
  """Validates `config` (names, mesh, divisibility, data sources) and builds
  the parts; nothing is placed or compiled."""
  experiment_lib.check_positive(
      config, 'num_steps', 'batch_size', 'eval_batch_size', 'log_every',
      'eval_every', 'checkpoint_every', 'keep_checkpoints')
  if config.nonfinite not in steps.NONFINITE_POLICIES:
    raise ConfigError('nonfinite', config.nonfinite, 'unknown policy',
                      steps.NONFINITE_POLICIES)
  lm_data.check_config(config.data)
  model = create_model(config)
  tx = optim.create_optimizer(config.optimizer, config.num_steps)
  learning_rate = optim.learning_rate_schedule(config.optimizer,
                                               config.num_steps)
  mesh, rules = experiment_lib.build_mesh(config)
  workdir = experiment_lib.check_workdir(workdir)

  boxed = jax.eval_shape(model.init, jax.random.key(0),
                         np.zeros((1, 8), np.int32))
  param_shardings = sharding_lib.logical_to_shardings(boxed['params'], mesh,
                                                      rules)
  repl = sharding_lib.replicated(mesh)
  state_shardings = steps.TrainState(
      step=repl, params=param_shardings, batch_stats={},
      opt_state=sharding_lib.optimizer_state_shardings(
          tx, nn.meta.unbox(boxed['params']), param_shardings, mesh),
      skipped_steps=repl)
  abstract = jax.eval_shape(functools.partial(_init_state, model, tx),
                            jax.random.key(0))
  abstract_state = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, state_shardings)
  return LMExperiment(config, workdir, mesh, model, tx, learning_rate,
                      state_shardings, sharding_lib.batch_sharding(mesh, rules),
                      abstract_state)


def compile_steps(exp: LMExperiment) -> trainer_lib.CompiledSteps:
  config = exp.config
  repl = sharding_lib.replicated(exp.mesh)
  train_fn = steps.make_train_step(
      exp.model, exp.tx, config.nonfinite, config.log_every,
      diagnostics=optim.method_diagnostics(config.optimizer),
      per_example=steps.lm_loss)
  batch = exp.abstract_batch(config.batch_size)
  names = jax.eval_shape(train_fn, exp.abstract_state, batch)[1]
  sharding_of = steps.metric_shardings(exp.batch_sharding, repl)
  compiled = jax.jit(
      train_fn, in_shardings=(exp.state_shardings, exp.batch_sharding),
      out_shardings=(exp.state_shardings,
                     {n: sharding_of(n) for n in names}),
      donate_argnums=(0,)).lower(exp.abstract_state, batch).compile()
  compiled_eval, compiled_finite = trainer_lib.compile_eval_and_finite(
      exp, steps.lm_loss)
  trainer_lib.log_memory_stats('lm train_step', compiled)
  return trainer_lib.CompiledSteps({None: compiled}, None, compiled_eval,
                                   compiled_finite, False)


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> dict[str, float]:
  """Trains the LM into `workdir` (resuming if it holds a checkpoint).

  Returns the final metrics: `val_loss` / `val_accuracy` on the held-out
  mixture (nats per byte, next-byte accuracy), `val_<source>_loss` per
  source, `test_loss` on the test mixture, and `step`.
  """
  exp = build(config, workdir)
  final_path = fileio.join(exp.workdir, FINAL_METRICS)
  with checkpointing.Checkpoints(
      exp.workdir, every_steps=config.checkpoint_every,
      keep=config.keep_checkpoints) as ckpts:
    latest = ckpts.latest_step()
    if (latest is not None and latest >= config.num_steps
        and fileio.exists(final_path)):
      logging.info('The run in %s is complete (step %d)', exp.workdir, latest)
      return metrics_lib.read_json(final_path)
    if latest is None:
      state = exp.init_state()
    else:
      state, _ = ckpts.restore(latest, exp.abstract_state)
      logging.info('Resumed from the checkpoint at step %d', latest)
    train_data = lm_data.load_windows(config.data, 'train', config.seed)
    val_data = lm_data.load_windows(config.data, 'validation', config.seed)
    logging.info('LM data: %d training and %d validation windows of %d bytes',
                 len(train_data), len(val_data), config.data.seq_len)
    compiled = compile_steps(exp)
    with contextlib.closing(metrics_lib.MetricWriter(
        exp.workdir, resume_step=latest)) as writer:
      state = trainer_lib.train_loop(exp, state, compiled, train_data,
                                     val_data, ckpts, writer, latest)
      final = {'step': config.num_steps}
      final.update(trainer_lib.evaluate(exp, compiled.eval, state, val_data,
                                        'val'))
      for source in lm_data.source_names(config.data):
        part = lm_data.load_windows(config.data, 'validation', config.seed,
                                    only=source)
        final.update(trainer_lib.evaluate(exp, compiled.eval, state, part,
                                          f'val_{source}'))
      final.update(trainer_lib.evaluate(
          exp, compiled.eval, state,
          lm_data.load_windows(config.data, 'test', config.seed), 'test'))
      writer.write(config.num_steps,
                   {k: v for k, v in final.items() if k != 'step'})
  if jax.process_index() == 0:
    metrics_lib.write_json_atomic(final_path, final)
    plots.plot_curves(writer.path, fileio.join(exp.workdir, 'curves.png'))
  return final


def load_trained(lm_workdir: str) -> tuple[ml_collections.ConfigDict,
                                           decoder_lm.DecoderLM, dict]:
  """The config, model and parameters of the latest checkpoint in `lm_workdir`.

  Raises:
    UsageError: `lm_workdir` holds no checkpoint, or not an LM's.
  """
  directory = os.path.join(os.path.abspath(lm_workdir), 'checkpoints')
  if not os.path.isdir(directory):
    raise UsageError('config.lm_workdir', lm_workdir,
                     'holds no checkpoints; train the LM first with '
                     '`python -m launch.train --config=configs/lm.py '
                     f'--workdir={lm_workdir}`')
  with checkpointing.Checkpoints(lm_workdir, every_steps=1, keep=1,
                                 async_save=False) as ckpts:
    step = ckpts.latest_step()
    if step is None:
      raise UsageError('config.lm_workdir', lm_workdir, 'holds no checkpoints')
    config = ml_collections.ConfigDict(
        json.loads(ckpts.restore_meta(step)['config']))
    if config.get('task') != 'lm':
      raise UsageError('config.lm_workdir', lm_workdir,
                       f'holds a {config.get("task", "classification")!r} '
                       'run, not an LM')
    exp = build(config, lm_workdir)
    state, _ = ckpts.restore(step, exp.abstract_state)
  logging.info('Loaded the LM at step %d from %s', step, lm_workdir)
  return config, exp.model, state.params
