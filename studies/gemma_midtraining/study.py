"""The whole study into one workdir, seed by seed (every model of seed 0
first, so an interrupted study has whole seeds) and model by model: each
mid-trained model is measured, its sharpness taken and its post-training
run before the next is trained, so that the records of `measures/`
alone, without the runs, let a fresh workdir resume (a record whose run
is gone is not redone; a run a missing record needs is retrained); then
the report from the stored measures."""

import os

import ml_collections

from studies.gemma_midtraining import measure
from studies.gemma_midtraining import report
from studies.gemma_midtraining.settings import CHECKPOINT
from studies.gemma_midtraining.settings import Settings
from studies.gemma_midtraining.settings import check_config
from train.run.job import open_job


def run(settings: Settings, base: ml_collections.ConfigDict,
        workdir: str) -> str:
  """The whole study into `workdir` (reusing what is measured); returns
  the report's text.

  Raises:
    UsageError: a setting is invalid (before anything is loaded).
    WorkdirBusy: another study holds `workdir`.
  """
  settings.check()
  check_config(base)
  root = os.path.abspath(workdir)
  os.makedirs(root, exist_ok=True)
  with open_job(root):
    measure.measure_mid(settings, base, root, CHECKPOINT, 0)
    for s in range(settings.seeds):
      for v in settings.variants:
        if v != CHECKPOINT:
          measure.measure_mid(settings, base, root, v, s)
          measure.ensure_midtrained(settings, base, root, v, s)
          measure.measure_sharpness(settings, base, root, v, s)
        measure.measure_post(settings, base, root, v, s)
      if s == 0:
        measure.measure_sharpness(settings, base, root, CHECKPOINT, 0)
    mids, posts = report.records(os.path.join(root, 'measures'), settings)
    return report.write(root, mids, posts)
