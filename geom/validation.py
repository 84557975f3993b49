"""Argument checks for all of geom, and the error they raise.

Every geom factory, options object and function checks its arguments the
same way and raises `ArgumentError`, a `ValueError` that carries the
argument's name, its value and what was wrong, so a caller (a trainer
mapping arguments to its config fields, say) reads the attributes instead
of parsing the message. The message names the owner and the argument:

    geom.sam.sam: grad_fn: update needs grad_fn=...     (a function's argument)
    geom.sam.SAMOptions.rho=-0.1: must be >= 0          (a class's field)
    ...: response='panic'; valid choices: flag, warm_restart, shrink_rho

Values that are traced (inside `jit`, or hyperparameters injected by
`optax.inject_hyperparams`) cannot be checked and pass; they were checked
where they were concrete.

Example:

  >>> from geom import validation
  >>> try:
  ...   validation.check('my_method', 'rho', -1.0, lambda r: r >= 0, '>= 0')
  ... except validation.ArgumentError as e:
  ...   print(e.argument, e.value, '|', e)
  rho -1.0 | my_method: rho=-1.0: must be >= 0
"""

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

__all__ = ['ArgumentError', 'check', 'check_choice', 'is_concrete']

_UNSHOWN = object()


def _shown(value: Any) -> Any:
  """A scalar array as the Python number it holds (for the message)."""
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(
      value) == 0:
    return np.asarray(value).item()
  return value


class ArgumentError(ValueError):
  """An argument of a geom function or class holds a value it cannot use.

  Attributes:
    owner: the function or class, e.g. 'geom.sam.sam' or
      'geom.hallucination.DetectorConfig'.
    argument: the argument's (or field's) name, e.g. 'rho'.
    value: the value given (None when the message does not show it).
    problem: what is wrong, e.g. 'must be >= 0' (None with only choices).
    choices: the valid values when they are a finite set, else None.

  Example:

    >>> from geom import validation
    >>> e = validation.ArgumentError('geom.sam.SAMOptions', 'rho',
    ...                              'must be >= 0', value=-0.1)
    >>> str(e)
    'geom.sam.SAMOptions.rho=-0.1: must be >= 0'
    >>> e.argument, e.value, isinstance(e, ValueError)
    ('rho', -0.1, True)
  """

  def __init__(self, owner: str, argument: str, problem: str | None = None,
               *, value: Any = _UNSHOWN, choices: Iterable[Any] | None = None):
    self.owner = owner
    self.argument = argument
    self.value = None if value is _UNSHOWN else _shown(value)
    self.problem = problem
    self.choices = None if choices is None else tuple(choices)
    # A class's field reads Class.field; a function's argument, function: arg.
    last = owner.rsplit('.', 1)[-1]
    message = owner + ('.' if last[:1].isupper() else ': ') + argument
    if value is not _UNSHOWN:
      message += f'={self.value!r}'
    if problem:
      message += f': {problem}'
    if self.choices is not None:
      message += f'; valid choices: {", ".join(map(str, self.choices))}'
    super().__init__(message)


def is_concrete(value: Any) -> bool:
  """Whether `value` can be checked now: numbers, arrays and sequences, not
  tracers nor the placeholders JAX's tree utilities unflatten with.

  Example:

    >>> import jax, jax.numpy as jnp
    >>> from geom import validation
    >>> validation.is_concrete(0.1), validation.is_concrete(jnp.ones(2))
    (True, True)
    >>> seen = []
    >>> _ = jax.jit(lambda x: seen.append(validation.is_concrete(x)) or x)(1.0)
    >>> seen   # Traced inside jit: not checkable.
    [False]
  """
  if isinstance(value, jax.core.Tracer):
    return False
  return isinstance(value, (int, float, list, tuple, np.ndarray, np.generic,
                            jax.Array))


def check(owner: str, argument: str, value: Any, ok: Callable[[Any], bool],
          requirement: str) -> None:
  """Raises `ArgumentError` when a concrete scalar `value` fails `ok`.

  Args:
    owner: the function or class whose argument this is.
    argument: its name.
    value: its value; traced values and non-scalars (schedules) pass.
    ok: the test, on the value as a Python number.
    requirement: what the value must be, e.g. '>= 0' ('must be' is added).

  Example:

    >>> from geom import validation
    >>> validation.check('f', 'rho', 0.5, lambda r: r >= 0, '>= 0')  # Passes.
    >>> validation.check('f', 'rho', -1, lambda r: r >= 0, '>= 0')
    Traceback (most recent call last):
    ...
    geom.validation.ArgumentError: f: rho=-1: must be >= 0
  """
  if not is_concrete(value) or np.ndim(value) != 0:
    return
  if not ok(_shown(value)):
    raise ArgumentError(owner, argument, f'must be {requirement}',
                        value=value)


def check_choice(owner: str, argument: str, value: Any,
                 choices: Iterable[Any], problem: str | None = None) -> None:
  """Raises `ArgumentError` listing `choices` unless `value` is one of them.

  Example:

    >>> from geom import validation
    >>> choices = ('flag', 'shrink_rho')
    >>> validation.check_choice('f', 'response', 'flag', choices)
    >>> validation.check_choice('f', 'response', 'panic', choices)
    Traceback (most recent call last):
    ...
    geom.validation.ArgumentError: f: response='panic'; valid choices: flag, shrink_rho
  """
  choices = tuple(choices)
  if value not in choices:
    raise ArgumentError(owner, argument, problem, value=value,
                        choices=choices)
