"""The figures every run draws keep their labels inside the figure.

A run's curves (`plots.plot_curves`) and the RL run's pass@1 figure
(`tally.plot`) are drawn with fixed margins rather than `tight_layout`
(which renders every label to measure it, at each run's end): here each
axes' labels, ticks, title and legend, measured by the renderer on
extreme values, must lie inside the figure and apart from the other axes.
"""

import json

from matplotlib.backends import backend_agg
import ml_collections
import numpy as np
import pytest

from train.analysis import plots
from train.rl import tally


@pytest.fixture
def drawn(monkeypatch):
  """The figures `save_png` is given, after writing them as usual."""
  figures = []
  save = plots.save_png

  def keep(fig, path, **kw):
    save(fig, path, **kw)
    figures.append(fig)
  monkeypatch.setattr(plots, 'save_png', keep)
  return figures


def _check_inside(fig):
  canvas = backend_agg.FigureCanvasAgg(fig)
  canvas.draw()
  renderer = canvas.get_renderer()
  width, height = fig.bbox.width, fig.bbox.height
  boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
  for box in boxes:
    assert box.x0 >= 0 and box.y0 >= 0, box
    assert box.x1 <= width and box.y1 <= height, (box, width, height)
  for a, b in zip(boxes, boxes[1:]):
    assert a.x1 <= b.x0, (a, b)  # Side by side, not overlapping.


@pytest.mark.parametrize('last_step, loss_range, accuracy', [
    (40, (2.3, 0.1), (0.6, 0.97)),
    (1_000_000, (150.0, 1e-5), (0.999971, 0.9999985)),
    (3, (0.5, 0.49), (0.0, 0.0)),
])
def test_a_runs_curves_keep_their_labels_inside(tmp_path, drawn, last_step,
                                                loss_range, accuracy):
  steps = np.linspace(1, last_step, 12).astype(int)
  losses = np.geomspace(*loss_range, len(steps))
  accuracies = np.linspace(*accuracy, len(steps))
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for i, (s, l, a) in enumerate(zip(steps, losses, accuracies)):
      record = {'step': int(s), 'train_loss': float(l),
                'train_accuracy': float(a)}
      if i % 3 == 2:
        record.update(val_loss=float(l) * 1.1, val_accuracy=float(a))
      f.write(json.dumps(record) + '\n')
    f.write(json.dumps({'step': int(steps[-1]),
                        'test_accuracy': float(accuracies[-1])}) + '\n')
  plots.plot_curves(str(tmp_path / 'metrics.jsonl'),
                    str(tmp_path / 'curves.png'))
  assert (tmp_path / 'curves.png').read_bytes()[:4] == b'\x89PNG'
  (fig,) = drawn
  _check_inside(fig)


@pytest.mark.parametrize('difficulties, wall', [((1, 2, 3), 130.0),
                                                ((1, 2, 3, 4, 5), 86_400.0)])
def test_the_rl_runs_figure_keeps_its_labels_inside(tmp_path, drawn,
                                                    difficulties, wall):
  config = ml_collections.ConfigDict(dict(
      difficulties=list(difficulties), runtime=dict(max_staleness=16),
      scheduler='fixed', grpo=dict(correction='tis')))
  curve = [{'wall': w, **{f'eval/pass_at_1_d{d}': min(1.0, w / wall * d / 3)
                          for d in difficulties}}
           for w in np.linspace(0, wall, 6)]
  tally.plot(curve, config, str(tmp_path / 'rl.png'))
  (fig,) = drawn
  _check_inside(fig)
