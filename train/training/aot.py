"""Ahead-of-time compilation of a run's steps, with their memory statistics.

`compile_steps` lowers and compiles the train step (one program per kind
of step the method asks for, `MethodHooks.variants`), the eval step and
the finiteness check that guards every checkpoint, before the first step
runs, and logs what each needs per device. When the training split fits
in `config.device_data_max_mb` per device, it is placed (replicated) on
the devices once and the train step gathers each batch there; the host
then sends indices only, which keeps the loop within a few percent of a
bare jitted loop on small data sets.
"""

from collections.abc import Callable, Hashable, Mapping
import dataclasses
import functools
from typing import Any
from absl import logging
import flax.linen as nn
import jax
import optax

from train.training import experiment as experiment_lib
from train.training import input_pipeline
from train.training import sharding as sharding_lib
from train.training import steps

Batch = dict[str, jax.Array]
# (state, batch) -> (state, metrics); the state is donated.
TrainFn = Callable[[steps.TrainState, Batch],
                   tuple[steps.TrainState, dict[str, jax.Array]]]
# (state, masked batch) -> sums of loss, correct and count.
EvalFn = Callable[[steps.TrainState, Batch], dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
  """The compiled steps of a run.

  Attributes:
    variants: train steps `(state, batch) -> (state, metrics)` (donating
      the state), keyed by the kind of step they were traced with (None:
      the only one).
    choose: `(step, opt_state) -> key of variants` on the host, or None
      for the only one.
    eval: `(state, batch) -> sums of loss, correct, count`.
    state_is_finite: `state -> bool scalar`.
    data_on_device: whether the training split lives on the devices; then
      train steps take batches of indices ({'index': int32}).
  """
  variants: Mapping[Hashable, TrainFn]
  choose: Callable[[int, optax.OptState], Hashable] | None
  eval: EvalFn
  state_is_finite: Callable[[steps.TrainState], jax.Array]
  data_on_device: bool

  def train(self, state: steps.TrainState, batch: Batch,
            step: int) -> tuple[steps.TrainState, dict[str, jax.Array]]:
    """One update; `step` is the state's step count (known on the host)."""
    key = None if self.choose is None else self.choose(step, state.opt_state)
    return self.variants[key](state, batch)


def log_memory_stats(name: str,
                     compiled: jax.stages.Compiled) -> dict[str, int]:
  """Logs (and returns) what a compiled program needs per device."""
  stats = compiled.memory_analysis()
  if stats is None:
    logging.info('%s: no memory statistics on this backend', name)
    return {}
  fields = ('argument_size_in_bytes', 'output_size_in_bytes',
            'alias_size_in_bytes', 'temp_size_in_bytes',
            'generated_code_size_in_bytes')
  values = {f: int(getattr(stats, f, 0)) for f in fields}
  logging.info('%s compiled (per device): %s', name, ', '.join(
      f'{f.removesuffix("_size_in_bytes")} {v / 2**20:.2f} MiB'
      for f, v in values.items()))
  return values


@dataclasses.dataclass(frozen=True)
class Program:
  """A jitted step and the arguments it is compiled for.

  Attributes:
    name: what the step is, e.g. 'eval_step' or 'train_step (<the
      method's variant argument>=<value>)'.
    fn: the `jax.jit`-wrapped function, with its shardings and donation.
    args: its arguments: abstract (ShapeDtypeStructs with shardings) or
      arrays.
    mesh, rules: the mesh and logical-axis rules the function is traced
      under, for the models' activation constraints
      (`nn.with_logical_constraint`); None: none.
  """
  name: str
  fn: Any
  args: tuple[Any, ...]
  mesh: jax.sharding.Mesh | None = None
  rules: Any = None

  def lower(self) -> jax.stages.Lowered:
    if self.mesh is None:
      return self.fn.lower(*self.args)
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(
        self.rules or ()):
      return self.fn.lower(*self.args)


def _variant_name(exp: experiment_lib.Experiment, key: Hashable | None
                  ) -> str:
  variants = exp.hooks.variants
  return ('train_step' if key is None
          else f'train_step ({variants.argument}={key})')


def train_programs(exp: experiment_lib.Experiment,
                   resident: Mapping[str, Any] | None = None
                   ) -> dict[Hashable | None, Program]:
  """The train step of each kind the method asks for (`hooks.variants`),
  keyed by kind (None: the only one).

  With `resident` (the training split on the devices, replicated: arrays
  or their abstract shapes) the step takes batches of indices and gathers
  the examples there; else it takes the batch.
  """
  config = exp.config
  repl = sharding_lib.replicated(exp.mesh)
  sharding_of = steps.metric_shardings(exp.batch_sharding, repl)
  variants = exp.hooks.variants
  context = _context(exp)

  def program(variant: Hashable | None) -> Program:
    train_fn = steps.make_train_step(
        exp.model, exp.tx, exp.per_example, nonfinite=config.nonfinite,
        log_every=config.log_every, hooks=exp.hooks, mesh=exp.mesh,
        variant=variant)

    def train_step(state, batch):
      # Each metric's sharding, by name, set where the metric is made: the
      # out-shardings would need the names first, which cost a trace of the
      # whole step before the one that lowers it.
      new_state, metrics = train_fn(state, batch)
      return new_state, {
          name: jax.lax.with_sharding_constraint(value, sharding_of(name))
          for name, value in metrics.items()}

    out_shardings = (exp.state_shardings, None)
    name = _variant_name(exp, variant)
    if resident is None:
      return Program(name, jax.jit(
          train_step, in_shardings=(exp.state_shardings, exp.batch_sharding),
          out_shardings=out_shardings, donate_argnums=(0,)),
                     (exp.abstract_state,
                      exp.abstract_batch(config.batch_size)), *context)
    return Program(name, jax.jit(
        lambda state, data, batch: train_step(
            state, input_pipeline.gather(data, batch['index'])),
        in_shardings=(exp.state_shardings, repl, exp.batch_sharding),
        out_shardings=out_shardings, donate_argnums=(0,)),
                   (exp.abstract_state, resident,
                    exp.abstract_index_batch(config.batch_size)), *context)

  keys = (None,) if variants is None else variants.values
  return {k: program(k) for k in keys}


def eval_programs(exp: experiment_lib.Experiment) -> dict[str, Program]:
  """The eval step (sums over a masked batch) and the finiteness check
  that guards every checkpoint."""
  repl = sharding_lib.replicated(exp.mesh)
  return {
      'eval_step': Program('eval_step', jax.jit(
          steps.make_eval_step(exp.model, exp.per_example),
          in_shardings=(exp.state_shardings, exp.batch_sharding),
          out_shardings=repl), (exp.abstract_state, exp.abstract_batch(
              exp.config.eval_batch_size, with_mask=True)), *_context(exp)),
      'state_is_finite': Program('state_is_finite', jax.jit(
          steps.state_is_finite, in_shardings=(exp.state_shardings,),
          out_shardings=repl), (exp.abstract_state,)),
  }


def _context(exp: experiment_lib.Experiment) -> tuple[Any, Any]:
  return exp.mesh, tuple(tuple(r) for r in exp.config.logical_axis_rules)


def programs(exp: experiment_lib.Experiment) -> list[Program]:
  """Every program the loop compiles for `exp`, batches fed by the host."""
  return [*train_programs(exp).values(), *eval_programs(exp).values()]


def compile_eval_and_finite(exp: experiment_lib.Experiment
                            ) -> tuple[jax.stages.Compiled,
                                       jax.stages.Compiled]:
  """The compiled eval step and finiteness check (`eval_programs`;
  compiled here, so a save never waits for the check)."""
  compiled = {k: p.lower().compile() for k, p in eval_programs(exp).items()}
  return compiled['eval_step'], compiled['state_is_finite']


def compile_steps(exp: experiment_lib.Experiment,
                  train_data: input_pipeline.Split) -> CompiledSteps:
  """AOT-compiles the train and eval steps; logs their memory statistics.

  With step variants (e.g. a method's plain warm-up steps, which skip its
  second gradient), each kind is compiled apart and `CompiledSteps.train`
  runs the one the method's host-side rule picks.
  """
  config = exp.config
  repl = sharding_lib.replicated(exp.mesh)
  variants = exp.hooks.variants
  on_device = input_pipeline.fits_on_devices(
      train_data, config.get('device_data_max_mb', 0))
  resident = (input_pipeline.put_replicated(train_data, repl) if on_device
              else None)
  compiled_variants = {k: p.lower().compile()
                       for k, p in train_programs(exp, resident).items()}
  compiled_eval, compiled_finite = compile_eval_and_finite(exp)
  logging.info('Training data on the devices: %s (%.2f MiB per device)',
               on_device, input_pipeline.nbytes(train_data) / 2**20)
  for key, compiled in compiled_variants.items():
    log_memory_stats(_variant_name(exp, key), compiled)
  log_memory_stats('eval_step', compiled_eval)
  if on_device:
    compiled_variants = {
        k: functools.partial(lambda c, data, state, batch: c(state, data,
                                                             batch), c,
                             resident)
        for k, c in compiled_variants.items()}
  return CompiledSteps(
      compiled_variants, None if variants is None else variants.choose,
      compiled_eval, compiled_finite, on_device)
