r"""Flat minima against forgetting: pretraining variants, then post-training and 4-bit quantisation.

  python -m studies.lm_forgetting --workdir=workdirs/forgetting

The companion paper (ICML 2026; abstract in shared/research/sam.md):
pretraining with SAM, with large learning rates or with a shortened
annealing period biases the model toward flatter minima, and then less is
forgotten after post-training (up to 80% less); a short SAM mid-training
phase on an existing checkpoint reduced forgetting by 31% after
fine-tuning and by 40% after 4-bit quantisation. Only the abstract is
public; the recipe here is ours and says so.

Pretraining (`configs/lm.py:forgetting`: the byte-level decoder, 2 layers,
d_model 64, on Python's documentation, 2,000 AdamW steps at 3e-3 with a
cosine to 5%), one run per variant and seed, each a resumable trainer run
below `--workdir` (a finished run is not trained again; `runs`):

  baseline      as configured;
  sam           SAM (rho `--rho`) on every step;
  sam_mid       the baseline with SAM switched on for its last
                `--mid_steps` steps (`optimizer.sam.window_start`): its
                first steps are the baseline's, bit for bit (same seed,
                same data order), so this is SAM applied to the baseline's
                checkpoint at step N - mid_steps, at the same total steps;
  large_lr      peak learning rate `--large_lr`;
  short_anneal  warmup-stable-decay, the anneal over the last
                `--anneal_fraction` of the steps instead of a cosine over
                all of them.

From each pretrained model:
  (a) post-training: fine-tuning on another distribution
      (`--post_source`, default the templated review corpus 'attribute')
      for `--post_steps` AdamW steps at `--post_lr` (`config.init_from`:
      its own resumable run);
  (b) 4-bit weight quantisation, per-channel symmetric
      (`train.lm.quantization.fake_quantize`).
What is measured on each is `measure`'s. The relative reduction of
forgetting against the baseline is 1 - F_variant / F_baseline per seed
(the seeds pair: same data and initialisation), reported as mean +- std
over seeds (`report`).

Writes `forgetting.md`, `forgetting.json` and `forgetting.png`; each
(variant, seed)'s measures are kept in `measures/` so a rerun only
computes what is missing. A bad flag ends the run before any training
with one line naming it (exit status 2).
"""

import json
import os

from absl import app
from absl import flags

from studies.lm_forgetting import measure
from studies.lm_forgetting import report
from studies.lm_forgetting import runs
from studies.lm_forgetting.settings import Settings
from studies.lm_forgetting.settings import VARIANTS
from train.run import metrics
from train.jobs import entry

_D = Settings()
_WORKDIR = flags.DEFINE_string('workdir', _D.workdir, 'Root dir.')
_CONFIG_ARG = flags.DEFINE_string('config_arg', _D.config_arg,
                                  'Argument of configs/lm.py for pretraining.')
_SEEDS = flags.DEFINE_integer('seeds', _D.seeds, 'Seeds per variant.')
_VARIANTS = flags.DEFINE_list('variants', list(VARIANTS), 'Variants.')
_RHO = flags.DEFINE_float('rho', _D.rho, 'SAM radius (sam, sam_mid).')
_MID_STEPS = flags.DEFINE_integer('mid_steps', _D.mid_steps,
                                  'SAM steps at the end of sam_mid.')
_LARGE_LR = flags.DEFINE_float('large_lr', _D.large_lr,
                               'Peak lr of large_lr.')
_ANNEAL = flags.DEFINE_float('anneal_fraction', _D.anneal_fraction,
                             'Anneal fraction of short_anneal (wsd).')
_POST_SOURCE = flags.DEFINE_string('post_source', _D.post_source,
                                   'Post-training data source.')
_POST_STEPS = flags.DEFINE_integer('post_steps', _D.post_steps,
                                   'Post-training steps.')
_POST_LR = flags.DEFINE_float('post_lr', _D.post_lr, 'Post-training peak lr.')
_BITS = flags.DEFINE_integer('bits', _D.bits, 'Quantisation bits.')
_HESSIAN_WINDOWS = flags.DEFINE_integer(
    'hessian_windows', _D.hessian_windows,
    'Training windows of the sharpness estimates.')
_POWER_ITERS = flags.DEFINE_integer('power_iters', _D.power_iters,
                                    'Power-iteration products (at most).')
_TRACE_SAMPLES = flags.DEFINE_integer('trace_samples', _D.trace_samples,
                                      'Hutchinson probes.')


def main(argv):
  del argv
  entry.quiet_libraries()
  settings = Settings(
      workdir=_WORKDIR.value, config_arg=_CONFIG_ARG.value,
      seeds=_SEEDS.value, variants=tuple(_VARIANTS.value), rho=_RHO.value,
      mid_steps=_MID_STEPS.value, large_lr=_LARGE_LR.value,
      anneal_fraction=_ANNEAL.value, post_source=_POST_SOURCE.value,
      post_steps=_POST_STEPS.value, post_lr=_POST_LR.value, bits=_BITS.value,
      hessian_windows=_HESSIAN_WINDOWS.value, power_iters=_POWER_ITERS.value,
      trace_samples=_TRACE_SAMPLES.value)

  def job():
    pretrain = runs.pretrain_config(settings, 'baseline', 0)
    settings.check(pretrain)
    entry.configure_devices(pretrain)
    records = [measure.measure(settings, v, s) for v in settings.variants
               for s in range(settings.seeds)]
    root = settings.workdir
    text = report.summarize(records)
    # Atomic writes replace what is there (a FIFO would block an open).
    metrics.write_text_atomic(os.path.join(root, 'forgetting.md'), text)
    metrics.write_text_atomic(os.path.join(root, 'forgetting.json'),
                              json.dumps(records, indent=1))
    report.plot(records, os.path.join(root, 'forgetting.png'))
    print(text)

  entry.run_job(job)


if __name__ == '__main__':
  app.run(main)
