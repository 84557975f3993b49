"""Errors that describe a user's mistake or a run's end, reported as one line.

The launcher prints `str(error)` without a traceback and exits non-zero.
"""

from collections.abc import Iterable
from typing import Any


class UsageError(ValueError):
  """A setting (a config field or a flag) holds a value the run cannot use.

  The message names the setting, the bad value and, when the valid values
  are a finite set, the choices.
  """

  def __init__(self, name: str, value: Any, problem: str,
               choices: Iterable[Any] | None = None):
    self.name = name
    self.value = value
    self.choices = None if choices is None else list(choices)
    message = f'{name}={value!r}: {problem}'
    if self.choices is not None:
      message += f'; valid choices: {", ".join(map(repr, self.choices))}'
    super().__init__(message)


class ConfigError(UsageError):
  """A config field is wrong; `field` is its dotted path below `config`."""

  def __init__(self, field: str, value: Any, problem: str,
               choices: Iterable[Any] | None = None):
    self.field = field
    super().__init__(f'config.{field}', value, problem, choices)


class NonFiniteLossError(RuntimeError):
  """Training produced non-finite values and the config says stop.

  `what` says where: the loss (policy 'stop'), or the train state found
  non-finite by the check that runs before every checkpoint.
  """

  def __init__(self, step: int, last_checkpoint: int | None,
               what: str = 'loss'):
    self.step = step
    self.last_checkpoint = last_checkpoint
    where = ('no checkpoint was written' if last_checkpoint is None
             else f'last good checkpoint: step {last_checkpoint}')
    super().__init__(
        f'non-finite {what} at step {step}; stopped without saving '
        f'({where}). Lower the learning rate, or set '
        '--config.nonfinite=skip to skip such steps.')


class Preempted(Exception):
  """The run received SIGTERM, saved a checkpoint at `step` and stopped."""

  def __init__(self, step: int):
    self.step = step
    super().__init__(
        f'stopped by SIGTERM at step {step}; checkpoint saved. Run the same '
        'command again to resume.')
