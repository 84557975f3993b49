"""The TTA tests' source CNN: studies.tta's BatchNorm source of seed 0 at
runlocal size (`configs/digits.py:runlocal,dataset=mnist5k` with the
study's features). tests/conftest.py's `tta_source_run` trains it once per
test session, so that test_tta_loop adapts from it and test_tta_study's
study finds it trained."""

from configs import digits
from studies.tta import grids


def config():
  """The source's config, as studies.tta's grids._source builds it."""
  config = digits.get_config('runlocal,dataset=mnist5k')
  config.seed = 0
  config.model.features = grids.Study.features
  return config
