"""What the asynchronous runtime asks of a scheduler: curriculum, dispatch,
admission.

The runtime (`train.rl.runtime`) generates numbered batches k = 0, 1, ...
and trains them in order; a scheduler answers three questions:

- `plan(k, latest)` (actor threads, in slot order): batch k's difficulty
  and the oldest policy version it may be generated from (dispatch and
  curriculum). It is decided once; an actor that failed hands its batch
  back and the next one gets the same plan.
- `admit(k, difficulty, staleness)` (the learner, before training batch
  k): whether the batch may train; a refused batch is generated again
  from the current version (counted as dropped and regenerated).
- `observe(...)` (the learner, after each update): the feedback that the
  next plans and admissions use.

`FixedBound` is the global bound s of AReaL (every batch may lag s
versions; difficulty uniform over the configured ones; nothing dropped).
`Gas` is `geom.gas`: per-difficulty budgets, a bandit curriculum, an
execution-aware dispatch, curvature-driven alpha.

Determinism (`runtime.deterministic`): batch k's plan is a function of k
and the run's seed alone. `Gas` then reads the scheduler's state as it was
at version max(0, k - S) (S the loosest budget; states are kept per
version, like the weights), decides slots strictly in order, draws from
(seed, k), generates from exactly version k - s_max(difficulty), and
takes latencies from a cost model (`gas.latency_source = 'model'`) rather
than the clock. Checkpoints hold the states of the last S + 1 versions
and the dispatcher's state before the next undecided batch, so a resumed
deterministic run plans every later batch as an uninterrupted one.
"""

import dataclasses
import math
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from geom import gas
from train.errors import ConfigError, from_argument_error
from train.rl import gas_curvature
from train.rl import runtime
from train.rl import tasks

SCHEDULERS = ('fixed', 'gas')
LATENCY_SOURCES = ('measured', 'model')
_POLL = 0.05


class Plan(NamedTuple):
  """Batch k's difficulty and the oldest version it may use."""
  difficulty: int
  min_version: int


class FixedBound:
  """Every batch may lag `bound` versions; difficulty uniform by (seed, k)."""

  def __init__(self, bound: int, difficulties: tuple[int, ...], seed: int):
    self.bound = bound
    self._difficulties = tuple(difficulties)
    self._seed = seed

  def plan(self, k: int, latest: int) -> Plan:
    del latest
    rng = np.random.default_rng([self._seed, k, 17])
    return Plan(int(rng.choice(list(self._difficulties))),
                max(0, k - self.bound))

  def admit(self, k: int, difficulty: int, staleness: int) -> bool:
    del k, difficulty
    return staleness <= self.bound

  def observe(self, version: int, **unused) -> dict[str, float]:
    del version, unused
    return {}

  def needs_curvature(self, version: int) -> bool:
    del version
    return False

  def remember(self, difficulty: int, batch: Any) -> None:
    del difficulty, batch

  def curvatures(self, model, params, version: int) -> dict[int, float]:
    del model, params, version
    return {}

  def loss_weight(self, difficulty: int) -> float:
    del difficulty
    return 1.0

  def diagnostics(self) -> dict[str, Any]:
    return {}

  def save(self, version: int) -> dict[str, Any]:
    del version
    return {}

  def restore(self, version: int, saved: dict[str, Any]) -> None:
    del version, saved


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
  """What a scheduler reads from the RL config (`settings(config)`), so that
  neither it nor geom sees a ConfigDict.

  Attributes:
    kind: 'fixed' or 'gas' (config.scheduler).
    bound: runtime.max_staleness, the hard bound on every batch's staleness
      (the runtime keeps that many versions); GAS's budgets stay within it.
    difficulties: the task difficulties batches are drawn from.
    seed: the run's seed.
    family: the task family (for modelled latencies).
    group_size: GRPO's completions per prompt (GAS's learning signal).
    temperature: the sampling temperature (GAS's curvature).
    options: GAS's options (None for 'fixed'): config.gas, with s_base
      gas.s_base, or `bound` when unset.
    loss_weight, curvature, curvature_every, curvature_iters,
      curvature_rows, latency_source, model_seconds_per_token,
      model_step_seconds: config.gas's (see configs/rl.py).
  """
  kind: str
  bound: int
  difficulties: tuple[int, ...]
  seed: int
  family: str = ''
  group_size: int = 1
  temperature: float = 1.0
  options: gas.GasOptions | None = None
  loss_weight: bool = False
  curvature: str = 'power'
  curvature_every: int = 0
  curvature_iters: int = 1
  curvature_rows: int = 1
  latency_source: str = 'measured'
  model_seconds_per_token: float = 0.01
  model_step_seconds: float = 0.05


def _gas_options(config) -> gas.GasOptions:
  g = config.gas
  s_base = g.get('s_base')
  return gas.GasOptions(
      difficulties=tuple(float(d) for d in config.difficulties),
      s_base=config.runtime.max_staleness if s_base is None else s_base,
      alpha=g.alpha, estimate_alpha=g.estimate_alpha,
      alpha_decay=g.alpha_decay, curvature_decay=g.curvature_decay,
      bandit=g.bandit, signal=g.signal, discount=g.discount,
      temperature=g.temperature, exploration=g.exploration, floor=g.floor,
      coupling=g.coupling, execution_aware=g.execution_aware,
      max_defer=g.max_defer, latency_decay=g.latency_decay)


def settings(config) -> SchedulerSettings:
  """The scheduler's settings from a config that passed `check_config`."""
  common = dict(kind=config.scheduler, bound=config.runtime.max_staleness,
                difficulties=tuple(int(d) for d in config.difficulties),
                seed=config.seed)
  if config.scheduler != 'gas':
    return SchedulerSettings(**common)
  g = config.gas
  return SchedulerSettings(
      **common, family=config.family, group_size=config.grpo.group_size,
      temperature=config.temperature, options=_gas_options(config),
      loss_weight=g.loss_weight, curvature=g.curvature,
      curvature_every=g.curvature_every, curvature_iters=g.curvature_iters,
      curvature_rows=g.curvature_rows, latency_source=g.latency_source,
      model_seconds_per_token=g.model_seconds_per_token,
      model_step_seconds=g.model_step_seconds)


def check_config(config) -> None:
  """ConfigError naming the field (config.scheduler and config.gas)."""
  if config.scheduler not in SCHEDULERS:
    raise ConfigError('scheduler', config.scheduler,
                      f'valid choices: {", ".join(SCHEDULERS)}')
  if config.scheduler != 'gas':
    return
  s_base = config.gas.get('s_base')
  if s_base is not None and (
      isinstance(s_base, bool) or not isinstance(s_base, int)
      or not 0 <= s_base <= config.runtime.max_staleness):
    raise ConfigError('gas.s_base', s_base,
                      'must be an integer in [0, runtime.max_staleness='
                      f'{config.runtime.max_staleness}] (unset: '
                      'runtime.max_staleness)')
  renames = {'difficulties': 'difficulties'}
  if s_base is None:
    renames['s_base'] = 'runtime.max_staleness'
  try:
    _gas_options(config)
  except gas.validation.ArgumentError as e:
    raise from_argument_error(e, 'gas', renames) from e
  g = config.gas
  if g.curvature not in gas.CURVATURE_METHODS:
    raise ConfigError('gas.curvature', g.curvature, 'valid choices: '
                      + ', '.join(gas.CURVATURE_METHODS))
  for field in ('curvature_every', 'curvature_iters', 'curvature_rows'):
    if not isinstance(g[field], int) or g[field] < (
        0 if field == 'curvature_every' else 1):
      raise ConfigError(f'gas.{field}', g[field], 'must be an integer >= '
                        + ('0 (0: never)' if field == 'curvature_every'
                           else '1'))
  if g.latency_source not in LATENCY_SOURCES:
    raise ConfigError('gas.latency_source', g.latency_source,
                      'valid choices: ' + ', '.join(LATENCY_SOURCES))
  if config.runtime.deterministic and g.latency_source != 'model':
    raise ConfigError('gas.latency_source', g.latency_source,
                      "must be 'model' with runtime.deterministic=True "
                      '(measured latencies depend on timing)')
  for field in ('model_seconds_per_token', 'model_step_seconds'):
    if not g[field] > 0:
      raise ConfigError(f'gas.{field}', g[field], 'must be > 0')


def _encode(state: gas.GasState) -> dict[str, Any]:
  def plain(x):
    if isinstance(x, np.ndarray):
      return [plain(v) for v in x.tolist()]
    if isinstance(x, list):
      return [plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
      return None
    return x
  return {name: plain(getattr(state, name) if not isinstance(
      getattr(state, name), tuple) else list(getattr(state, name)))
          for name in gas.GasState._fields}


def _decode(saved: dict[str, Any]) -> gas.GasState:
  def arr(x, dtype):
    return np.array([[np.nan if v is None else v for v in row]
                     if isinstance(row, list) else
                     (np.nan if row is None else row) for row in x], dtype)
  return gas.GasState(
      pulls=arr(saved['pulls'], np.float64),
      gains=arr(saved['gains'], np.float64),
      log_curvature=arr(saved['log_curvature'], np.float64),
      alpha=float(saved['alpha']),
      slope=float('nan') if saved['slope'] is None else float(saved['slope']),
      latency=arr(saved['latency'], np.float64),
      step_time=(float('nan') if saved['step_time'] is None
                 else float(saved['step_time'])),
      pending=tuple(int(b) for b in saved['pending']),
      pending_age=tuple(int(a) for a in saved['pending_age']),
      credit=arr(saved['credit'], np.int64),
      counts=arr(saved['counts'], np.int64))


def latency_of(settings: SchedulerSettings, difficulty: int,
               measured: float) -> float:
  """The generation seconds GAS hears: `measured`, or the cost model's
  (seconds per token x the difficulty's longest answer)."""
  if settings.latency_source == 'measured':
    return measured
  return (settings.model_seconds_per_token
          * tasks.max_answer_tokens(settings.family, difficulty))


def step_time_of(settings: SchedulerSettings, measured: float) -> float:
  """The learner step seconds GAS hears: `measured` or the cost model's."""
  return (measured if settings.latency_source == 'measured'
          else settings.model_step_seconds)


def _observed(state: gas.GasState, settings: SchedulerSettings, b: int,
              difficulty: int, rewards: np.ndarray, rows: int,
              generation_seconds: float, step_seconds: float,
              regenerated: bool, curvatures: dict[int, float]
              ) -> tuple[gas.GasState, float]:
  """The learner's state after the update that trained bucket `b`, and its
  learning signal."""
  options = settings.options
  if regenerated:
    state = gas.record_admission(state, b, False, rows)
  state = gas.record_admission(state, b, True, rows)
  signal = gas.learning_signal(rewards, settings.group_size, options.signal)
  state = gas.observe_signal(state, options, b, signal)
  state = gas.observe_latency(
      state, options, b, latency_of(settings, difficulty, generation_seconds),
      step_time_of(settings, step_seconds))
  for d, eigenvalue in curvatures.items():
    state = gas.observe_curvature(state, options,
                                  settings.difficulties.index(d), eigenvalue)
  return state, signal


class Gas:
  """`geom.gas` as the runtime's scheduler (see the module docstring)."""

  def __init__(self, settings: SchedulerSettings, deterministic: bool,
               stopped: Callable[[], bool] = lambda: False):
    self.options = settings.options
    self.bound = settings.bound
    self._s = settings
    self._deterministic = deterministic
    self._stopped = stopped
    self._difficulties = settings.difficulties
    self._cond = threading.Condition()
    initial = gas.init(self.options)
    # The learner's state at each version (bandit, curvature, latencies,
    # admissions); the dispatcher's pending queue and dispatch counters
    # live in `_dispatch`, advanced slot by slot.
    self._states: dict[int, gas.GasState] = {0: initial}
    self._dispatch = initial
    self._before: dict[int, gas.GasState] = {}  # Dispatcher before slot k.
    self._plans: dict[int, Plan] = {}
    self._next = 0  # The next slot to decide.
    self._version = 0
    self.curvature = gas_curvature.Curvature(
        settings.curvature_every, settings.curvature_rows,
        settings.curvature_iters, settings.curvature, settings.temperature,
        settings.seed)

  # --- the actors' side -------------------------------------------------

  def _bucket(self, difficulty: int) -> int:
    return self._difficulties.index(difficulty)

  def _merged(self, state: gas.GasState) -> gas.GasState:
    counts = state.counts.copy()
    counts[:2] = self._dispatch.counts[:2]
    return state._replace(pending=self._dispatch.pending,
                          pending_age=self._dispatch.pending_age,
                          credit=self._dispatch.credit,
                          counts=counts)

  def plan(self, k: int, latest: int) -> Plan:
    with self._cond:
      while k not in self._plans:
        if self._stopped():
          raise runtime.Stopped()
        if k == self._next:
          source = max(0, k - self.bound) if self._deterministic else None
          if source is None or source in self._states:
            self._decide(k, latest, source)
            break
        self._cond.wait(_POLL)
      return self._plans[k]

  def _decide(self, k: int, latest: int, source: int | None) -> None:
    if source is None:
      source = max(self._states)
      lead = max(0, k - latest)
    else:
      lead = None
    state = self._merged(self._states[source])
    u = float(np.random.default_rng([self._s.seed, k, 29]).random())
    self._before[k] = self._dispatch
    bucket, after = gas.dispatch(state, self.options, u, lead=lead)
    budget = int(gas.budgets(state, self.options)[bucket])
    self._dispatch = after
    self._plans[k] = Plan(self._difficulties[bucket], max(0, k - budget))
    self._next = k + 1
    self._cond.notify_all()

  # --- the learner's side ------------------------------------------------

  def _current(self) -> gas.GasState:
    return self._states[self._version]

  def admit(self, k: int, difficulty: int, staleness: int) -> bool:
    with self._cond:
      return gas.admit(self._current(), self.options,
                       self._bucket(difficulty), staleness)

  def loss_weight(self, difficulty: int) -> float:
    if not self._s.loss_weight:
      return 1.0
    with self._cond:
      return gas.loss_weight(self._current(), self.options,
                             self._bucket(difficulty))

  def observe(self, version: int, *, difficulty: int, rewards: np.ndarray,
              rows: int, generation_seconds: float, step_seconds: float,
              regenerated: bool,
              curvatures: dict[int, float] | None = None
              ) -> dict[str, float]:
    """Folds in the update that made `version`; returns its scalars."""
    b = self._bucket(difficulty)
    with self._cond:
      state, signal = _observed(
          self._states[version - 1], self._s, b, difficulty, rewards, rows,
          generation_seconds, step_seconds, regenerated, curvatures or {})
      self._states[version] = state
      self._version = version
      for old in [v for v in self._states if v < version - self.bound - 1]:
        del self._states[old]
      for old in [s for s in self._plans if s < version - 1]:
        self._plans.pop(old)
        self._before.pop(old, None)
      self._cond.notify_all()
      # Unmeasured entries are NaN: left out of the metrics, not logged.
      scalars = {f'gas/{key}': float(value) for key, value in
                 gas.diagnostics(self._merged(state), self.options).items()
                 if math.isfinite(value)}
    scalars['gas/signal'] = signal
    return scalars

  # The runtime's curvature calls, answered by the probe.

  def needs_curvature(self, version: int) -> bool:
    return self.curvature.needed(version)

  def remember(self, difficulty: int, batch: Any) -> None:
    self.curvature.remember(difficulty, batch)

  def curvatures(self, model, params, version: int) -> dict[int, float]:
    return self.curvature.estimate(model, params, version)

  def save(self, version: int) -> dict[str, Any]:
    with self._cond:
      before = self._before.get(version, self._dispatch
                                if self._next <= version else None)
      if before is None:
        raise RuntimeError(f'no dispatcher state before slot {version}')
      return {'states': {str(v): _encode(s) for v, s in self._states.items()
                         if v >= version - self.bound},
              'dispatch': _encode(before)}

  def restore(self, version: int, saved: dict[str, Any]) -> None:
    with self._cond:
      self._states = {int(v): _decode(s)
                      for v, s in saved['states'].items()}
      self._dispatch = _decode(saved['dispatch'])
      self._version = version
      self._next = version
      self._plans.clear()
      self._before.clear()

  def diagnostics(self) -> dict[str, Any]:
    """`geom.gas.diagnostics` of the learner's current state."""
    with self._cond:
      return gas.diagnostics(self._merged(self._current()), self.options)


def make(settings: SchedulerSettings, deterministic: bool,
         stopped: Callable[[], bool] = lambda: False):
  """The scheduler `settings.kind` names."""
  if settings.kind == 'gas':
    return Gas(settings, deterministic, stopped)
  return FixedBound(settings.bound, settings.difficulties, settings.seed)
