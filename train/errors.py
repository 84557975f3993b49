"""Errors that describe a user's mistake or a run's end, reported as one line.

The launcher prints `str(error)` without a traceback and exits non-zero.
"""

from collections.abc import Iterable
from typing import Any


def cause_line(error: BaseException) -> str:
  """The root cause's type and first line: libraries wrap a precise message
  (which file, which byte range) in vaguer ones."""
  seen = set()
  while id(error) not in seen and (error.__cause__ or error.__context__):
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  text = str(error).strip().splitlines()
  return f'{type(error).__name__}: {text[0][:300] if text else ""}'


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


def from_argument_error(error: Exception, prefix: str,
                        renames: dict[str, str] | None = None,
                        value: Any = None) -> 'ConfigError':
  """A geom `ArgumentError` (geom/validation.py) as the `ConfigError` of the
  config field that set the argument: `prefix.argument`, or
  `renames[argument]` (a field below `config`) where the names differ;
  the problem and choices as geom gave them, and the value too unless
  `value` gives the config's (where the field is not the argument, e.g.
  two fields that make one argument)."""
  argument = error.argument
  field = (renames or {}).get(argument, f'{prefix}.{argument}')
  return ConfigError(field, error.value if value is None else value,
                     error.problem or f'unknown {argument}', error.choices)


class RunError(RuntimeError):
  """The run cannot go on, for a reason outside its config (one line).

  `exit_code` is the launcher's exit status for it.
  """
  exit_code = 1


class NonFiniteLossError(RunError):
  """Training produced non-finite values and the config says stop.

  `what` says where: the loss (policy 'stop'), or the train state found
  non-finite by the check that runs before every checkpoint.
  """
  exit_code = 3

  def __init__(self, step: int, last_checkpoint: int | None,
               what: str = 'loss', skipping: bool = False,
               can_skip: bool = True):
    """`skipping`: nonfinite='skip' is already set; `can_skip`: the loop
    has that setting (the RL loop has not)."""
    self.step = step
    self.last_checkpoint = last_checkpoint
    where = ('no checkpoint was written' if last_checkpoint is None
             else f'last good checkpoint: step {last_checkpoint}')
    # With nonfinite='skip' already set, skipping did not keep the state
    # finite (e.g. finite but huge updates overflowed it).
    advice = ('Lower the learning rate.' if skipping or not can_skip else
              'Lower the learning rate, or set --config.nonfinite=skip to '
              'skip such steps.')
    super().__init__(
        f'non-finite {what} at step {step}; stopped without saving '
        f'({where}). {advice}')


class DiskFull(RunError):
  """Writing to the workdir ran out of space; what was saved before stays."""
  exit_code = 5

  def __init__(self, path: str, needed_bytes: int | None,
               free_bytes: int | None, last_checkpoint: int | None):
    mb = lambda n: '?' if n is None else f'{n / 2**20:.1f} MB'
    kept = ('no checkpoint was saved before' if last_checkpoint is None
            else f'checkpoints up to step {last_checkpoint} are intact')
    super().__init__(
        f'disk full writing {path} (needs about {mb(needed_bytes)}, '
        f'{mb(free_bytes)} free); {kept}. Free space and run the same '
        'command to resume.')


class DamagedDataFile(RunError):
  """A data file cannot be read (truncated, corrupt)."""
  exit_code = 6

  def __init__(self, what: str, files: list[str], error: BaseException):
    super().__init__(
        f'cannot read {what}: damaged data file(s) {", ".join(files)} '
        f'({cause_line(error)}). Prepare the data set again.')


class DamagedModelFile(RunError):
  """A model file (a GGUF checkpoint) cannot be read as the model it names."""
  exit_code = 6

  def __init__(self, path: str, problem: str):
    super().__init__(f'cannot load the model file {path}: {problem}')


class Preempted(Exception):
  """The run received SIGTERM or SIGINT, saved a checkpoint at `step` and
  stopped."""

  def __init__(self, step: int, signal_name: str = 'SIGTERM'):
    self.step = step
    self.signal_name = signal_name
    super().__init__(
        f'stopped by {signal_name} at step {step}; checkpoint saved. Run the '
        'same command again to resume.')


class Interrupted(BaseException):
  """SIGTERM or SIGINT arrived outside the training loop (start-up, final
  evaluation), where there is no new state to save.

  A BaseException, as KeyboardInterrupt is: the signal may land inside
  code that catches Exception (a library probing a backend, a check that
  turns OSError into a usage error), which must not swallow it.
  """

  def __init__(self, signum: int, signal_name: str):
    self.signum = signum
    self.signal_name = signal_name
    super().__init__(
        f'stopped by {signal_name} outside the training loop; nothing new '
        'to save. Run the same command again to resume.')
