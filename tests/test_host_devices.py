"""Simulated CPU devices: back-to-back model-parallel steps must not deadlock.

Without `host_devices.configure_cpu_devices`, XLA:CPU's default thread pool
(one thread per core) starved on this step's collectives within 300 steps
on a 2-core machine, every time; XLA then aborts the process after 40 s.
"""

import subprocess
import sys

from tests.launch_runs import REPO_ROOT

SCRIPT = r'''
import os, tempfile
os.environ.pop('PJRT_NPROC', None)  # Only what configure_cpu_devices sets.
from train.training import host_devices
host_devices.configure_cpu_devices(8)
assert int(os.environ['PJRT_NPROC']) >= 64
from absl import flags
flags.FLAGS(['bench'])
from bench.training import trainer_overhead
from configs import digits
from train.vision import datasets, experiment
config = digits.get_config()
config.mesh.shape = (4, 2)
# Batches of 32, not 128: the collectives starve the same without the fix
# (XLA aborted the process, as with 128), and the steps take half the time.
config.batch_size = 32
exp = experiment.build(config, tempfile.mkdtemp())
data = datasets.load_split('digits', 'train', None)
batches = trainer_overhead.device_batches(exp, data, 400)
trainer_overhead.minimal_loop(exp, batches)
print('done')
'''


def test_many_back_to_back_model_parallel_steps_finish():
  result = subprocess.run([sys.executable, '-c', SCRIPT], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith('done')
