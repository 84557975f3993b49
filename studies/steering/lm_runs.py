"""The study's LMs and their evaluations, each reused when already finished.

`python -m studies.steering` calls these: `train_lm` pretrains one LM seed
through `launch.train` (resumable; a finished run returns at once) in
`lm_seed<S>/` below the study's workdir, and `evaluate` runs
`train.steering.evaluation` on it in a named directory, or reuses the
evaluation found there when it was made with the same config (one made
with another config is refused: a workdir holds one study).
"""

import json
import os
import subprocess
import sys

from absl import logging

from configs import steering
from train import fileio
from train.errors import RunError
from train.errors import UsageError
from train.steering import evaluation

# `launch.train` runs from the repository root, whatever the caller's cwd.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def lm_workdir(root: str, seed: int) -> str:
  return os.path.join(root, f'lm_seed{seed}')


def eval_config(root: str, steering_config_arg: str, seed: int, item_seeds,
                beta: float | None = None):
  """configs/steering.py's config for the LM of `seed` over `item_seeds`;
  with `beta`, the gated rotation alone at that gate threshold."""
  config = steering.get_config(steering_config_arg or None)
  config.lm_workdir = lm_workdir(root, seed)
  config.mc_seeds = tuple(item_seeds)
  if beta is not None:
    config.methods = ('none', 'spherical_gate')
    config.beta = beta
  return config


def train_lm(root: str, lm_config_arg: str, seed: int) -> None:
  """`launch.train` for one LM seed (resumes; a finished run returns at once)."""
  workdir = lm_workdir(root, seed)
  os.makedirs(root, exist_ok=True)
  cmd = [sys.executable, '-m', 'launch.train',
         '--config=configs/lm.py' + (f':{lm_config_arg}'
                                     if lm_config_arg else ''),
         f'--config.seed={seed}', f'--workdir={workdir}']
  log = os.path.join(root, f'lm_seed{seed}.log')
  logging.info('LM seed %d: %s (log %s)', seed, ' '.join(cmd), log)
  # The study's own files are opened through fileio: a FIFO put in their
  # place would block an open.
  with fileio.open_local(log, 'a', root=root) as f:
    proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=_ROOT)
  if proc.returncode:
    with fileio.open_local(log, root=root) as f:
      errors = [l.strip() for l in f if l.startswith('error:')]
    raise RunError(f'training LM seed {seed} failed (exit {proc.returncode}): '
                   f'{errors[-1] if errors else "see " + log}')


def finished(root: str, config, name: str) -> dict | None:
  """The finished evaluation in `name/` if its config is `config`; None if
  there is none; UsageError if it was made with another config."""
  path = os.path.join(root, name, 'results.json')
  if not os.path.exists(path):
    return None
  results = json.loads(fileio.read_text(path, root))
  wanted = json.loads(config.to_json())
  have = results['meta'].get('config') or {}
  if have == wanted:
    return results
  diff = sorted(k for k in set(wanted) | set(have)
                if have.get(k) != wanted.get(k))
  raise UsageError('--workdir', root,
                   f'{name}/ holds an evaluation with another config '
                   f'({", ".join(diff)}); give a new --workdir')


def evaluate(root: str, config, name: str) -> dict:
  """The evaluation in `name/` (reused when its config is this one)."""
  results = finished(root, config, name)
  if results is not None:
    logging.info('%s: reusing the finished evaluation', name)
    return results
  workdir = os.path.join(root, name)
  evaluation.evaluate(config, workdir)
  return json.loads(fileio.read_text(os.path.join(workdir, 'results.json'),
                                     workdir))
