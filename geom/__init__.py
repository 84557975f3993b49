"""geom: optimization-geometry methods as Optax-style transformations.

Methods live one per module and depend only on jax, optax and numpy (see
the repository's docs/lab/index.md, "Layout"); nothing here knows about
Flax, data sets or files. Each module lists its public names in `__all__`; this
package re-exports the classes, and the modules themselves, because a
method's factory shares its module's name:

  >>> import optax
  >>> import geom
  >>> tx = geom.sam.sam(optax.sgd(0.1), rho=0.05)
  >>> geom.sam.hooks(geom.SAMOptions(rho=0.05)).update_arguments
  ('grad_fn',)

Modules::

  sam            SAM, ASAM, m-sharpness, warm-start, step windows.
  conga          CONGA, a learning rate for test-time adaptation.
  curvature      the Hessian's top eigenvalue and trace (sharpness).
  gas            GAS: staleness budgets by difficulty, a bandit curriculum
                 and execution-aware dispatch for asynchronous RL.
  hallucination  the detector of SAM's hallucinated minimizers.
  kernels        Pallas kernels (the fused SAM perturbation).
  steering       spherical steering and addition baselines.
  landscapes     2-D objectives on which SAM's behaviour can be seen.
  method_hooks   what a method needs from a training loop (`MethodHooks`).
  tree_norm      a pytree's L2 norm in float32, safe from over/underflow.
  validation     argument checks; `ArgumentError`.

`geom.__version__` is the installed distribution's version
(`importlib.metadata.version('geom')`; both come from geom/_version.py).
"""

from geom import conga
from geom import curvature
from geom import gas
from geom import hallucination
from geom import kernels
from geom import landscapes
from geom import method_hooks
from geom import sam
from geom import steering
from geom import tree_norm
from geom import validation
from geom._version import __version__
from geom.conga import CongaState
from geom.gas import GasOptions
from geom.gas import GasState
from geom.hallucination import DetectorConfig
from geom.hallucination import DetectorState
from geom.kernels.sam_perturb import BlockSizes
from geom.method_hooks import MethodHooks
from geom.method_hooks import StepVariants
from geom.sam import SAMOptions
from geom.sam import SAMState
from geom.steering import Steering
from geom.steering import SteerStats
from geom.validation import ArgumentError

__all__ = [
    'ArgumentError', 'BlockSizes', 'CongaState', 'DetectorConfig',
    'DetectorState', 'GasOptions', 'GasState', 'MethodHooks', 'SAMOptions',
    'SAMState', 'StepVariants',
    'SteerStats', 'Steering', 'conga', 'curvature', 'gas', 'hallucination', 'kernels',
    'landscapes', 'method_hooks', 'sam', 'steering', 'tree_norm',
    'validation',
]
