"""The gate of the gated methods in a selection (`selection.gate`).

The gated methods ('spherical_gate', 'addition_gate') steer a token only
where the vMF gate fires, delta = -tanh(kappa cos) > beta (the paper's
gate). `selection.gate` says where its numbers come from:

- 'reference': the config's `kappa` and `beta` (the reference's 20 and 0)
  on the uncentred cosine, as `evaluation.evaluate` steers;
- 'calibrated' (ours, `geom.steering`'s centring and calibration): per
  candidate (layer, direction method), the center m is the layer's mean
  over the contrastive set (`geom.steering.layer_mean` of every token
  after BOS of both sides of every pair: the texts the direction came
  from), the cosines are cos(x - m, direction) of those tokens
  (`geom.steering.cosines`), one set per side, and kappa and beta are
  `geom.steering.calibrate_gate`'s (default width 1) on them; the
  operator is `Steering(center=m, kappa=kappa, beta=beta)`. Computed
  from the contrastive pairs alone: no validation or test item, no
  held-out text, goes into it.

The ungated methods are untouched by either (no center, the config's
kappa and beta, which they do not read). Where the contrastive cosines
do not separate the two sides (the target side's median not above the
other's, or no spread: `calibrate_gate` refuses), the candidate gets no
calibrated gate (`Gate.error`) and the gated methods skip it.
"""

from typing import Any, NamedTuple

import numpy as np

from geom import steering as steering_lib
from geom import validation

GATES = ('reference', 'calibrated')
#: The table methods that take the gate.
GATED_METHODS = ('addition_gate', 'spherical_gate')


class Gate(NamedTuple):
  """A gated method's numbers at one candidate.

  Attributes:
    kappa, beta: the gate's (None where `error`).
    center: the (dim,) float32 center, or None (uncentred).
    record: what selection.json records: 'kind' (of GATES) and, for
      'calibrated', 'center_norm', kappa, beta, the threshold, spread and
      medians of `geom.steering.GateCalibration`, 'capped' and the token
      counts per side ('tokens'); or 'error'.
  """
  kappa: float | None
  beta: float | None
  center: np.ndarray | None
  record: dict[str, Any]

  @property
  def error(self) -> str | None:
    """Why there is no calibrated gate here (None: there is one)."""
    return self.record.get('error')


def reference(config) -> Gate:
  """The config's kappa and beta, uncentred."""
  return Gate(float(config.kappa), float(config.beta), None,
              dict(kind='reference', kappa=float(config.kappa),
                   beta=float(config.beta), center_norm=None))


def contrastive_center(hidden: tuple[np.ndarray, np.ndarray],
                       tokens: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
  """`layer_mean` of both sides' tokens (`PairActivations.hidden` and
  `.tokens`: the tokens after BOS of every text)."""
  return np.asarray(steering_lib.layer_mean(np.concatenate(hidden),
                                            np.concatenate(tokens)))


def calibrated(hidden: tuple[np.ndarray, np.ndarray],
               tokens: tuple[np.ndarray, np.ndarray], direction: np.ndarray,
               center: np.ndarray) -> Gate:
  """The calibrated gate of one candidate (see the module docstring):
  the contrastive tokens' centred cosines per side into
  `calibrate_gate`."""
  pos_cos, neg_cos = (
      np.asarray(steering_lib.cosines(h, direction, center))[t]
      for h, t in zip(hidden, tokens))
  counts = [int(pos_cos.size), int(neg_cos.size)]
  try:
    cal = steering_lib.calibrate_gate(pos_cos, neg_cos)
  except validation.ArgumentError as e:
    return Gate(None, None, None, dict(
        kind='calibrated', error=f'{e.argument}: {e.problem}',
        tokens=counts))
  record = dict(kind='calibrated',
                center_norm=float(np.linalg.norm(center.astype(np.float64))),
                kappa=cal.kappa, beta=cal.beta, threshold=cal.threshold,
                spread=cal.spread, positive_median=cal.positive_median,
                negative_median=cal.negative_median, capped=cal.capped,
                tokens=counts)
  return Gate(cal.kappa, cal.beta, np.asarray(center, np.float32), record)
