"""The TTA tests' source CNN, trained once per test session and shared by
the xdist workers: studies.tta's BatchNorm source of seed 0 at runlocal
size (`configs/digits.py:runlocal,dataset=mnist5k` with the study's
features), so that test_tta_loop adapts from it and test_tta_study's
study finds it trained. Tests read it or copy it, never write into it."""

import fcntl
import os
import pathlib

from configs import digits
from studies.tta import grids
from train.vision import trainer


def config():
  """The source's config, as studies.tta's grids._source builds it."""
  config = digits.get_config('runlocal,dataset=mnist5k')
  config.seed = 0
  config.model.features = grids.Study.features
  return config


def workdir(tmp_path_factory) -> str:
  """The trained source's workdir: the first worker to ask trains it, under
  a lock (as tests/conftest.py's session runs), and the others wait, then
  find it finished (a finished run returns without training)."""
  root = tmp_path_factory.getbasetemp()
  if 'PYTEST_XDIST_WORKER' in os.environ:
    root = root.parent  # The session's directory, above the workers' own.
  path = pathlib.Path(root, 'tta_source')
  with open(root / 'tta_source.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    trainer.train_and_evaluate(config(), str(path))
  return str(path)
