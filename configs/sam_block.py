"""The `config.optimizer.sam` block shared by experiment configs (SAM off).

Fields mirror `geom.sam.sam`'s arguments: `window_stop=-1` means no end;
`m_sharpness` makes each device perturb with its own gradient along the
data axis; `detector` holds the hallucination detector's thresholds
(`enabled=False` drops it; defaults equal `geom.hallucination.DetectorConfig`,
which a test checks). `every`/`alpha` are LookSAM's reuse; `ae` is AE-SAM's
switch, its margin c linear from `margin_start` to `margin_end` over the
run (equal: constant). Turn SAM on with `--config.optimizer.sam.enabled=True`.
"""

import ml_collections


def sam_block() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      enabled=False,
      rho=0.05,
      adaptive=False,
      eta=0.01,
      warmup_steps=0,
      window_start=0,
      window_stop=-1,
      m_sharpness=False,
      fused=False,  # The Pallas perturbation kernels (geom.kernels).
      response='flag',  # flag | warm_restart | shrink_rho
      restart_steps=100,
      shrink_factor=0.5,
      every=1,  # LookSAM: g+ every k steps, its orthogonal part reused.
      alpha=0.7,
      # AE-SAM: g+ only when |g|^2 >= mu + c sigma (geom.sam's ae_margin).
      ae=dict(enabled=False, margin_start=0.0, margin_end=0.0, decay=0.9),
      detector=dict(enabled=True, ema_decay=0.9, ratio_threshold=0.5,
                    min_grad_fraction=0.1, scale_decay=0.99,
                    min_grad_norm=0.0, patience=20, track_cosine=False),
  ))
