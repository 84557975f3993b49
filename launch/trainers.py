"""The product trainer for a config's `task`, shared by the launchers.

Flagless, so that any launcher can import it. Trainers are imported on
call: importing one must not fix the devices before the launcher has set
them (`launch.entry.configure_devices`).
"""

TASKS = ('classification', 'lm', 'rl_sft')


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
