"""The whole study into one workdir: every model measured (what is
missing), then the report from the stored measures."""

import os

import ml_collections

from studies.gemma_forgetting import measure
from studies.gemma_forgetting import report
from studies.gemma_forgetting.settings import Settings
from studies.gemma_forgetting.settings import check_config
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
    measure.measure_pretrained(settings, base, root)
    for v in settings.variants:
      for s in range(settings.seeds):
        measure.measure_run(settings, base, root, v, s)
    if settings.sharpness_iters:
      measure.measure_sharpness(settings, base, root, None, 0)
      for v in settings.variants:
        for s in range(settings.seeds):
          measure.measure_sharpness(settings, base, root, v, s)
    pretrained, runs = report.records(
        os.path.join(root, 'measures'), settings.variants, settings.seeds,
        bool(settings.sharpness_iters))
    return report.write(root, pretrained, runs)
