"""The RL study's runs: a warm start per seed, then GRPO sync and async.

Each seed trains its own warm start (`configs/rl_sft.py`, that seed) into
`<workdir>/sft_<seed>`, then runs GRPO (`configs/rl.py`, that seed) once
synchronously (staleness bound 0), once for each bound with each
correction, and once per GAS variant (`geom.gas`, configs/rl.py's `gas=`
variants) with the GAS bound as the easiest difficulty's budget; every run
in its own workdir below the study's (a finished run is read back, an
interrupted one resumes). `measure` returns every run's results, keyed
`label|seed`, which `studies.rl_staleness.report` tabulates and plots.
"""

import ast
import dataclasses
import os

from absl import logging

from configs import rl
from configs import rl_sft
from train.rl import run
from train.rl import sft

GAS_VARIANTS = ('full', 'no_bandit', 'no_execution', 'no_coupling',
                'fixed_lambda')


@dataclasses.dataclass(frozen=True)
class Study:
  """What `python -m studies.rl_staleness` (or `studies.gas`) measures."""
  workdir: str
  seeds: int = 3
  bounds: tuple[int, ...] = (1, 2, 4)
  corrections: tuple[str, ...] = ('none', 'tis', 'decoupled')
  gas: tuple[str, ...] = ()
  gas_bound: int = 4
  gas_correction: str = 'decoupled'
  num_versions: int = 1000
  # More config fields for every RL run, as field=value (Python literals).
  overrides: tuple[str, ...] = ()
  # Tests: the warm start's and the runs' `runlocal` configs.
  runlocal: bool = False


def set_field(config, field: str, text: str) -> None:
  """`config.<field> = <text as a Python literal>` (dotted fields)."""
  *path, last = field.split('.')
  block = config
  for part in path:
    block = block[part]
  block[last] = ast.literal_eval(text)


def _sft(study: Study, seed: int) -> str:
  workdir = os.path.join(study.workdir, f'sft_{seed}')
  config = rl_sft.get_config('runlocal' if study.runlocal else None)
  config.seed = seed
  final = sft.train_and_evaluate(config, workdir)
  logging.info('warm start %d: %s', seed, {k: v for k, v in final.items()
                                            if k.startswith('pass_at_1')})
  return workdir


def rl_config(study: Study, seed: int, bound: int, correction: str,
              gas: str | None = None):
  """(config, workdir) of one RL run of the study."""
  variant = f',gas={gas}' if gas else ''
  config = rl.get_config(('runlocal,' if study.runlocal else '')
                         + f'staleness={bound},correction={correction}'
                         + variant)
  config.seed = seed
  config.sft_workdir = os.path.join(study.workdir, f'sft_{seed}')
  config.num_versions = study.num_versions
  for item in study.overrides:
    field, _, text = item.partition('=')
    set_field(config, field, text)
  name = (f'gas_{gas}_s{bound}_seed{seed}' if gas
          else f's{bound}_{correction}_seed{seed}')
  return config, os.path.join(study.workdir, name)


def runs(study: Study) -> list[tuple[str, int, str, str | None]]:
  """(label, bound, correction, GAS variant or None) of each run."""
  out = [('sync', 0, 'decoupled', None)]
  for bound in study.bounds:
    for correction in study.corrections:
      out.append((f'async s={bound}, {correction}', bound, correction, None))
  for variant in study.gas:
    out.append((f'GAS {variant}, s_base={study.gas_bound}',
                study.gas_bound, study.gas_correction, variant))
  return out


def check(study: Study) -> None:
  """Every RL run's config as the study builds it (`run.check_config`, the
  SFT warm start aside: the study trains it)."""
  for _, bound, correction, gas in runs(study):
    run.check_config(rl_config(study, 0, bound, correction, gas)[0],
                     require_sft=False)


def measure(study: Study) -> dict[str, dict]:
  """Every run's results (`run.train_and_evaluate`), keyed `label|seed`."""
  raw = {}
  for seed in range(study.seeds):
    _sft(study, seed)
    for label, bound, correction, gas in runs(study):
      raw[f'{label}|{seed}'] = run.train_and_evaluate(
          *rl_config(study, seed, bound, correction, gas))
  return raw
