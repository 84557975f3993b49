r"""What one power-iteration step costs: a Hessian-vector product against a gradient.

  python -m bench.curvature.hvp_cost            # writes the BENCHMARKS.md section
  python -m bench.curvature.hvp_cost --steps=10 --repeats=3 --nowrite

`geom.curvature` estimates sharpness (top eigenvalue, trace) with
Hessian-vector products, forward over reverse (`jax.jvp` of `jax.grad`).
One power-iteration step is one product plus a normalisation; this
measures its time against a plain gradient of the same loss on the same
model and batch, both jitted, on the 8-device mesh (simulated CPU devices
here), the batch sharded over 'data' and the parameters replicated, as
the trainer places them. Goal: <= 3x (the forward-over-reverse product
costs a forward, a backward and their tangents; reverse-over-reverse or
finite differences would cost more or lose precision).

Models: the steering LM of `configs/lm.py` (4 layers, d_model 128, byte
vocabulary, batch 32 x 128 tokens) and the CNN of `configs/digits.py`
(32-64 convolutions with BatchNorm in training mode, on a batch of 128
28x28 images). Variants alternate over `--repeats` repeats; the median of
the per-repeat ratios is reported.
"""

import os
import platform
import statistics
import time

from absl import app
from absl import flags
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from bench import report
from configs import digits
from configs import lm
from geom import curvature
from train.training import host_devices
from train.training import sharding
from train.analysis import stats
from train.lm import decoder
from train.vision import models

_STEPS = flags.DEFINE_integer('steps', 20, 'Calls per timed run.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Alternating repeats.')
_WRITE = flags.DEFINE_bool('write', True, 'Update BENCHMARKS.md.')

SECTION = 'hvp_cost'


def problems():
  """name -> (loss(params, batch), params, batch, description)."""
  key = jax.random.key(0)
  lm_config = lm.get_config()
  model = decoder.DecoderLM(**lm_config.model)
  seq = lm_config.data.seq_len
  tokens = jax.random.randint(key, (lm_config.batch_size, seq + 1), 0,
                              lm_config.model.vocab_size)
  lm_params = model.init(key, tokens[:, :-1])['params']

  def lm_loss(p, batch):
    logits, _ = model.apply({'params': p}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]).mean()

  cnn = models.create_model(digits.get_config().model, 10, 1.0)
  images = jax.random.uniform(key, (128, 28, 28, 1))
  labels = jax.random.randint(key, (128,), 0, 10)
  variables = cnn.init(key, images[:2], train=False)

  def cnn_loss(p, batch):
    x, y = batch
    logits, _ = cnn.apply({'params': p,
                           'batch_stats': variables['batch_stats']}, x,
                          train=True, mutable=['batch_stats'])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return {
      'lm': (lm_loss, lm_params, tokens,
             f'decoder LM (configs/lm.py), batch {lm_config.batch_size} x '
             f'{seq} tokens'),
      'cnn': (cnn_loss, variables['params'], (images, labels),
              'CNN (configs/digits.py, BatchNorm in training mode), batch '
              '128 x 28 x 28'),
  }


def main(argv):
  del argv
  host_devices.configure_cpu_devices(8)

  mesh = sharding.make_mesh((-1,), ('data',))
  data = NamedSharding(mesh, P('data'))
  replicated = NamedSharding(mesh, P())
  rows, details = [], []
  for name, (loss, params, batch, what) in problems().items():
    params = jax.device_put(params, replicated)
    batch = jax.device_put(batch, data)
    v = jax.device_put(jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype),
        params), replicated)

    grad = jax.jit(lambda p, b: jax.grad(loss)(p, b))
    # One power-iteration step: H v, its Rayleigh quotient and the next
    # unit vector (geom.curvature.power_iteration's loop body).
    def power_step(p, b, v):
      f = lambda q: loss(q, b)
      hv = curvature.hvp(f, p, v)
      norm = jax.numpy.sqrt(curvature.tree_dot(hv, hv))
      return curvature.tree_dot(v, hv), jax.tree.map(lambda x: x / norm, hv)
    step = jax.jit(power_step)
    calls = {'gradient': lambda: grad(params, batch),
             'power step': lambda: step(params, batch, v)}
    for fn in calls.values():
      jax.block_until_ready(fn())  # Compile and warm up.
    times = {k: [] for k in calls}
    for _ in range(_REPEATS.value):
      for k, fn in calls.items():
        start = time.perf_counter()
        for _ in range(_STEPS.value):
          out = fn()
        jax.block_until_ready(out)
        times[k].append((time.perf_counter() - start) / _STEPS.value)
    ratio = statistics.median(a / b for a, b in zip(times['power step'],
                                                    times['gradient']))
    rows.append([what, f'{1e3 * statistics.median(times["gradient"]):.1f}',
                 f'{1e3 * statistics.median(times["power step"]):.1f}',
                 f'**{ratio:.2f}x**', '<= 3x'])
    details.append((name, ratio))
  lines = [
      '## Hessian-vector product cost (one power-iteration step)',
      '',
      'One step of `geom.curvature.power_iteration` (a forward-over-reverse '
      'Hessian-vector product, its Rayleigh quotient and the normalisation) '
      'against `jax.grad` of the same loss, model and batch; both jitted on '
      f'the {len(jax.devices())}-device mesh, batch sharded over `data`, '
      f'parameters replicated. Median of {_REPEATS.value} alternating '
      f'repeats of {_STEPS.value} calls.',
      f'Machine: {platform.machine()}, {os.cpu_count()} CPU cores '
      f'({len(jax.devices())} simulated devices), jax {jax.__version__}.',
      '',
      stats.markdown_table(['model and batch', 'gradient (ms)',
                            'power step (ms)', 'ratio', 'goal'], rows,
                           '-----'),
      '',
      'Reproduce: `.venv/bin/python -m bench.curvature.hvp_cost '
      f'--steps={_STEPS.value} --repeats={_REPEATS.value}`.',
  ]
  report.publish(SECTION, lines, _WRITE.value)


if __name__ == '__main__':
  app.run(main)
