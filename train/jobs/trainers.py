"""The product trainer for a config's `task`, shared by the launchers.

Flagless, so that any launcher can import it. Trainers are imported on
call: importing one must not fix the devices before the launcher has set
them (`train.jobs.entry.configure_devices`).
"""

TASKS = ('classification', 'lm', 'rl_sft')


def check_config(config) -> None:
  """What needs no device of `config`: its task, the loop's settings, the
  optimizer, and an LM's model. A multi-process job checks it before its
  processes meet (`launch.train --multihost`), so that a mistake is one
  line on every process at once, not after waiting for the others.

  Raises:
    ConfigError: naming the field.
  """
  # pylint: disable=g-import-not-at-top
  from train.training import experiment
  from train.training import optim
  from train.errors import ConfigError
  from train.lm import models
  # pylint: enable=g-import-not-at-top
  task = config.get('task', 'classification')
  if task not in TASKS:
    raise ConfigError('task', task, 'unknown task', TASKS)
  experiment.check_loop_settings(config)
  optim.build(config.optimizer, config.num_steps)
  if task in ('lm', 'rl_sft'):
    models.check_config(config)


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Runs `config.task`'s `train_and_evaluate(config, workdir)`.

  Raises:
    ConfigError: `config.task` names no trainer (the message lists TASKS).
  """
  # pylint: disable=g-import-not-at-top
  from train.errors import ConfigError
  task = config.get('task', 'classification')
  if task == 'classification':
    from train.vision import trainer
  elif task == 'lm':
    from train.lm import trainer
  elif task == 'rl_sft':
    from train.rl import sft as trainer
  else:
    raise ConfigError('task', task, 'unknown task', TASKS)
  return trainer.train_and_evaluate(config, workdir)
