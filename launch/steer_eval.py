r"""Evaluate steering methods on a trained LM, or on Gemma 3.

  python -m launch.steer_eval --config=configs/steering.py \
    --config.lm_workdir=workdirs/lm --workdir=workdirs/steer
  python -m launch.steer_eval --config=configs/gemma.py \
    --workdir=workdirs/gemma_steer

One evaluation (`train.steering.evaluation`) for both: the config names
the LM, a trained LM's workdir or a Gemma 3 GGUF file.

With a config's `selection` block (the configs' `selection` argument),
each method's layer, direction method and alpha grid are chosen on
validation items first (`train.steering.selection`, selection.json), then
the test items are evaluated once at those settings; the gated methods
take `selection.gate` ('calibrated' by default: centred, kappa and beta
from the contrastive set; gate_<method>.png plots its value on the
held-out tokens):

  python -m launch.steer_eval --config=configs/gemma.py:selection \
    --workdir=workdirs/gemma_select

On Gemma, `--export_gguf=PATH` also writes the evaluation's addition (its
direction at `config.layer`, its coefficient) as a llama.cpp control
vector at strength `--export_alpha` (default: the largest of
`config.alphas`), which llama.cpp adds after the same block
(`train.steering.gguf_export`: the format, the layer numbers, the
strength):

  python -m launch.steer_eval --config=configs/gemma.py \
    --workdir=workdirs/gemma_steer --export_gguf=workdirs/gemma_steer.gguf \
    --export_alpha=0.1
  llama-cli -m ~/.cache/geom/gemma3-270m/gemma-3-270m-q4_k_m.gguf \
    --control-vector workdirs/gemma_steer.gguf

A mistake in the config or flags ends the run before any compute with one
line naming the setting and the valid choices (exit status 2); a workdir
held by another evaluation is one line and exit status 75; an LM with no
checkpoint that loads and verifies, exit status 4.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from train.jobs import entry

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Evaluation config file (get_config(arg)).',
    lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None,
                               'Directory for the table, plot and vector.')
_EXPORT = flags.DEFINE_string(
    'export_gguf', None, 'Also write the addition direction here as a '
    'llama.cpp control vector (GGUF; Gemma configs only).')
_EXPORT_ALPHA = flags.DEFINE_float(
    'export_alpha', None, 'Addition strength of the exported vector, in '
    '(0, 1] (default: the largest of config.alphas).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  config = _CONFIG.value
  entry.quiet_libraries()

  def job():
    entry.configure_devices(config)
    # pylint: disable=g-import-not-at-top
    from train.errors import UsageError
    from train.steering import evaluation as steering_eval
    from train.steering import gguf_export
    from train.steering import selection
    # pylint: enable=g-import-not-at-top
    if selection.enabled(config):
      if _EXPORT.value is not None:
        raise UsageError('--export_gguf', _EXPORT.value, 'a selection picks '
                         'a layer per method; export from an evaluation at '
                         'one layer (a config without selection)')
      # --export_alpha alone is refused as without a selection.
      gguf_export.check_export_flags(config, None, _EXPORT_ALPHA.value)
      return selection.evaluate(config, _WORKDIR.value), None
    alpha = gguf_export.check_export_flags(config, _EXPORT.value,
                                           _EXPORT_ALPHA.value)
    rows = steering_eval.evaluate(config, _WORKDIR.value)
    if alpha is None:
      return rows, None
    return rows, gguf_export.export_evaluation(_WORKDIR.value, _EXPORT.value,
                                               alpha)

  rows, exported = entry.run_job(job)
  print(f'{len(rows)} settings evaluated; table: {_WORKDIR.value}/results.md')
  if exported is not None:
    print(f'control vector: {_EXPORT.value} (direction.'
          f'{", direction.".join(map(str, exported.vectors))}); llama.cpp: '
          f'--control-vector {_EXPORT.value}')


if __name__ == '__main__':
  app.run(main, flags_parser=lambda argv: entry.parse_flags(
      argv, _CONFIG))
