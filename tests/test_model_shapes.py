"""A model's variables as shapes (train.training.model_shapes), and the run
state's shapes that `assemble` derives from them, against the model's own
`init` traced afresh."""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import digits as digits_config
from configs import lm as lm_config
from train.lm import trainer as lm_trainer
from train.training import model_shapes
from train.training import steps
from train.vision import experiment as vision_experiment


class _WithArray(nn.Module):
  """A model with an array among its fields: not hashable."""
  table: Any

  @nn.compact
  def __call__(self, tokens):
    return nn.Dense(2)(tokens.astype(jnp.float32) + self.table)


def _traced(init_variables):
  return jax.eval_shape(init_variables, jax.random.key(0))


def _same(got, want):
  # The same tree (the boxes' logical axes included), shapes and dtypes.
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert jax.tree.leaves(got) == jax.tree.leaves(want)


def test_an_lms_variables_are_its_init_traced_once():
  config = lm_config.get_config('runlocal')
  model = lm_trainer.create_model(config)
  got = lm_trainer.abstract_variables(model)
  _same(got, _traced(functools.partial(lm_trainer.init_variables, model)))
  # An equal model, built again, is not traced again; another model is.
  assert lm_trainer.abstract_variables(lm_trainer.create_model(config)) is got
  config.model.num_layers += 1
  deeper = lm_trainer.abstract_variables(lm_trainer.create_model(config))
  assert len(jax.tree.leaves(deeper)) > len(jax.tree.leaves(got))
  # A model that cannot be a cache key is traced each time.
  odd = _WithArray(np.ones((8,), np.float32))
  first = lm_trainer.abstract_variables(odd)
  assert first['params']['Dense_0']['kernel'].shape == (8, 2)
  assert lm_trainer.abstract_variables(odd) is not first


def test_only_equal_partials_of_a_function_share_their_shapes():
  init = lambda model, rng, *, width: model.init(rng, jnp.zeros((1, width)))
  dense = nn.Dense(3)
  four = model_shapes.abstract_variables(
      functools.partial(init, dense, width=4))
  assert four['params']['kernel'].shape == (4, 3)
  assert model_shapes.abstract_variables(
      functools.partial(init, nn.Dense(3), width=4)) is four
  # Another argument or another model is another entry.
  five = model_shapes.abstract_variables(
      functools.partial(init, dense, width=5))
  assert five['params']['kernel'].shape == (5, 3)
  six = model_shapes.abstract_variables(
      functools.partial(init, nn.Dense(6), width=4))
  assert six['params']['kernel'].shape == (4, 6)
  # Not a partial: traced each time.
  plain = lambda rng: init(dense, rng, width=4)
  assert model_shapes.abstract_variables(plain) is not (
      model_shapes.abstract_variables(plain))


@pytest.mark.parametrize('name', ['digits', 'lm'])
def test_the_run_states_shapes_are_its_init_states(name, tmp_path):
  # assemble builds them from the model's shapes, not by tracing its init
  # again: they must equal the state's own init, optimizer state included.
  if name == 'digits':
    exp = vision_experiment.build(digits_config.get_config('runlocal'),
                                  str(tmp_path))
  else:
    exp = lm_trainer.build(lm_config.get_config('runlocal'), str(tmp_path),
                           check_data=False)
  want = _traced(functools.partial(steps.init_state, exp.init_variables,
                                   exp.tx))
  got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                     exp.abstract_state)
  _same(got, want)
