"""What the RL benchmarks set up first: the devices and the SFT warm start."""

import os

import ml_collections

from configs import rl_sft
from train.jobs import entry
from train.rl import sft


def prepare(sft_workdir: str) -> None:
  """Quiets the libraries, simulates 8 CPU devices (before JAX's backends
  start) and trains the SFT policy into `sft_workdir` unless it holds
  checkpoints already."""
  entry.quiet_libraries()
  entry.configure_devices(ml_collections.ConfigDict({'cpu_devices': 8}))
  if not os.path.isdir(os.path.join(sft_workdir, 'checkpoints')):
    sft.train_and_evaluate(rl_sft.get_config(), sft_workdir)
