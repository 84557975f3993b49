"""Test-time adaptation methods by name: source, BN statistics, TENT, EATA, SAR.

Each method adapts a classifier trained by `launch.train` on an unlabelled
test stream, one batch at a time, and predicts each batch with the forward
pass it adapts on (online evaluation, as the TENT, EATA and SAR papers
report). Labels never reach a step.

- 'source': the source model as trained (running BN statistics), and
  'bn_stats': normalisation with the test batch's statistics, no update
  (`train.tta.unadapted`).
- 'tent': the mean prediction entropy minimised over the normalisation
  layers' affine parameters (`train.tta.tent`).
- 'eata': entropy on reliable, non-redundant samples, weighted, plus an
  EWC penalty with the source model's Fisher (`train.tta.eata`).
- 'sar': reliable entropy minimised with SAM, and a reset to the source
  when its loss collapses (`train.tta.sar`).

Each is a `train.tta.interface.Method` with a state of its own; `METHODS`
maps the config's name to it.

No step updates when no sample of a batch passes the filters (as in EATA's
and SAR's code): the parameters and the optimizer state stay as they were.

The learning rate is the config's: a fixed rate (`optax.scale_by_learning_rate`)
or CONGA (`geom.conga.conga`), after Adam's or momentum's direction; CONGA
reads every sample's entropy through the `entropies` update argument.
"""

import flax.linen as nn
import jax
import optax

from train.tta import classifier as classifier_lib
from train.tta import eata
from train.tta import interface
from train.tta import sar
from train.tta import tent
from train.tta import unadapted

# What `make` and `bind` take (benchmarks and studies build it too).
Settings = interface.Settings

# The config's `method.name` -> the method.
METHODS: dict[str, type[interface.Method]] = {
    'source': unadapted.Source, 'bn_stats': unadapted.BNStats,
    'tent': tent.Tent, 'eata': eata.Eata, 'sar': sar.Sar}


def kind(name: str) -> type[interface.Method]:
  """The method `name` names (ValueError naming the valid ones)."""
  if name not in METHODS:
    raise ValueError(f'method={name!r}: unknown method; valid choices: '
                     f'{", ".join(METHODS)}')
  return METHODS[name]


def init(method: interface.Method) -> interface.State:
  """`method.init()`, as a function to jit or trace."""
  return method.init()


def step(method: interface.Method, state: interface.State,
         images: jax.Array) -> tuple[interface.State, dict[str, jax.Array]]:
  """`method.step(state, images)`, as a function to jit: the method's
  arrays are then arguments, not constants."""
  return method.step(state, images)


def make(settings: interface.Settings, model: nn.Module, params, batch_stats,
         tx: optax.GradientTransformationExtraArgs,
         fisher_batches: list[jax.Array] | None = None) -> interface.Method:
  """A method on the source model `params`/`batch_stats`.

  Args:
    settings: the method and its hyperparameters.
    model: the classifier.
    params: its trained parameters (as `launch.train` saved them).
    batch_stats: its running BN statistics ({} without BatchNorm).
    tx: the optimizer of the adapted parameters (unused by source and
      bn_stats).
    fisher_batches: EATA's in-distribution images.
  """
  method = bind(settings, model, *jax.device_put((params, batch_stats)), tx)
  if isinstance(method, eata.Eata):
    method = method.replace(fisher=eata.fisher_diagonal(
        method.classifier, fisher_batches or []))
  return method


def bind(settings: interface.Settings, model: nn.Module, params, batch_stats,
         tx: optax.GradientTransformationExtraArgs,
         fisher: interface.Flat | None = None) -> interface.Method:
  """The method on `params` as they are (arrays or their abstract shapes:
  `launch.compile` binds a method to shapes only); EATA's `fisher` given."""
  cls = kind(settings.method)
  method = cls(settings=settings,
               classifier=classifier_lib.bind(model, params, batch_stats,
                                              cls.SKIP),
               tx=optax.with_extra_args_support(tx))
  return method if fisher is None else method.replace(fisher=fisher)
