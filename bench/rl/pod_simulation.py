"""A discrete-event simulator of the asynchronous GRPO runtime at pod scale.

`python -m bench.rl.simulator` runs it (calibration, predictions and
checks against real runs).

Why: this machine has 2 CPU cores, on which the rollout and learner
meshes are simulated together, so it cannot measure what asynchrony buys
where they are disjoint chips. The simulator replays the runtime's rules
(train/rl/runtime.py, train/rl/run.py) with per-slot costs measured here,
for synchronous GRPO, a fixed staleness bound s and GAS (geom/gas.py),
and predicts throughput and staleness for a deployment of N rollout and
M learner chips.

The model, as the runtime:
- Slots ("batches") k = 0, 1, ...; the learner trains them in order;
  training slot k publishes version k + 1; version 0 exists at t = 0.
- An actor that is free claims the next slot and may start it only when
  version >= k - s is published (GAS: k - s_max(b)); it generates from
  the newest version v (in `deterministic` mode exactly max(0, k - s)),
  so the slot's staleness k - v is at most its bound.
- A finished slot goes into a buffer of `capacity` (default s +
  num_actors; GAS: max s_max + num_actors) slots besides the one the
  learner waits for; an actor holding a finished slot blocks while the
  buffer is full, unless its slot is the one the learner needs next.
- Buckets: fixed bound and sync draw b iid from the mix p(b); GAS calls
  `gas.dispatch(state, options, u, lead=k - v_now)` when the actor claims
  slot k, and `gas.observe_latency` after each generation (its elapsed
  seconds, verification included) and after each learner step (the
  learner's elapsed seconds for that version, host overhead included:
  the interval between versions that the lag ceil(L / T) is about).

Assumptions (the lead states them with any figure taken from here):
1. Costs. A slot of bucket b takes L(b) + V(b) seconds to generate and
   verify, each lognormal with a per-bucket mean and log-std, independent
   over slots. A learner step takes T (lognormal, mean T), preceded by a
   host overhead o per version (assembly, transfers, publication,
   logging; constant), all serial on the learner. In one process,
   publishing weights to the actors costs nothing beyond o.
   Across processes (`launch.rl --multihost`, `weights_seconds` and
   `batch_seconds` of `simulate`): an actor group is a process of its
   own; when it starts a slot from a version it does not hold, it waits
   `weights_seconds` for the transfer (the learner does not: its weight
   server sends while it trains), and a finished slot reaches the
   learner's buffer `batch_seconds` later. Both are constants, from a
   line fitted to `bench.rl.transfer`'s measurements (`Transfer`).
2. Dedicated compute (a pod): every actor group and the learner run at
   full speed at once. `shared_compute=True` models this machine
   instead: all jobs share one processor equally (processor sharing: k
   running jobs each progress at rate 1/k), since XLA spreads each of
   them over the same 2 cores.
3. Calibration (`calibrate`) measures per-slot costs on 2 shared CPU
   cores, from synchronous runs, where they add up (a slot's interval is
   L + o + T): L per bucket from `generation_seconds` (the verifier runs
   inside it, so V = 0), T from the learner's busy seconds, o the rest.
   It measures no parallel speedup: the runs' 2 actor threads share the
   cores with the learner. One-off costs (compilation, evaluations,
   checkpoints) are `fixed_seconds`; pod predictions leave them out
   (steady state), checks against real runs add them back.
4. Pod scale, weak scaling: a deployment of N rollout and M learner
   chips with c chips per actor group has N // c actor groups; rows per
   slot grow with the learner chips (rows = rows_ref * M / M_ref: fixed
   rows per learner chip), so that a learner step stays as fast, but for
   its gradient all-reduce: T(M) = T_ref + t_comm log2(M / M_ref), t_comm
   the added seconds per doubling of the learner chips (0 by default:
   perfect weak scaling). One actor group generates a whole slot, so
   L(b) = L_ref(b) (rows / c) / (rows_ref / c_ref) (generation time grows
   with the rows per actor chip; V likewise). The overhead o stays
   constant. The reference is the study's deployment: 64 rows per slot,
   4 learner chips, 4 chips per actor group.
5. In this runtime synchronous GRPO (s = 0) generates one slot at a time,
   on one actor group, so at scale it leaves N - c rollout chips idle;
   the row `sync, split` is the usual synchronous system instead, every
   group generating rows / num_groups of each slot (the slot's latency is
   the slowest group's).
6. GAS: a fixed curriculum (bandit 'uniform' by default: the simulator
   has no learning signal) and a fixed alpha (no curvature signal).
"""

import dataclasses
import json
import math
import os
from typing import Any, Sequence

import numpy as np

from geom import gas
from train.run import metrics as metrics_lib
from train.analysis import stats


def _floats(values: Any) -> tuple[float, ...]:
  return tuple(float(v) for v in values)


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Per-slot costs at one deployment, in seconds (assumption 1).

  Attributes:
    difficulties: d_b of each bucket, increasing.
    latency_mean: mean generation seconds per slot of each bucket.
    latency_sigma: log-std of each bucket's lognormal generation time.
    step_seconds: mean learner step (the update alone).
    step_sigma: its log-std.
    overhead_seconds: host work per version, serial on the learner.
    fixed_seconds: one-off costs of a run (compilation, evaluations).
    verifier_mean: mean verification seconds per slot (zeros: none).
    verifier_sigma: their log-std.
    rows_per_slot: samples per slot.
    learner_chips: chips of the learner (M).
    chips_per_actor: chips per actor group (c).
    sources: the workdirs measured.
  """
  difficulties: tuple[float, ...]
  latency_mean: tuple[float, ...]
  latency_sigma: tuple[float, ...]
  step_seconds: float
  step_sigma: float = 0.0
  overhead_seconds: float = 0.0
  fixed_seconds: float = 0.0
  verifier_mean: tuple[float, ...] | None = None
  verifier_sigma: tuple[float, ...] | None = None
  rows_per_slot: int = 64
  learner_chips: int = 4
  chips_per_actor: int = 4
  sources: tuple[str, ...] = ()

  def __post_init__(self):
    b = len(self.difficulties)
    zeros = (0.0,) * b
    fields = {
        'difficulties': _floats(self.difficulties),
        'latency_mean': _floats(self.latency_mean),
        'latency_sigma': _floats(self.latency_sigma),
        'verifier_mean': _floats(self.verifier_mean or zeros),
        'verifier_sigma': _floats(self.verifier_sigma or zeros),
        'sources': tuple(self.sources)}
    for name, value in fields.items():
      object.__setattr__(self, name, value)
      if name != 'sources' and len(value) != b:
        raise ValueError(f'Calibration.{name} has {len(value)} values for '
                         f'{b} buckets')
    if not b or not self.step_seconds > 0 or min(self.latency_mean) < 0:
      raise ValueError(f'Calibration needs buckets, step_seconds > 0 and '
                       f'latencies >= 0: {self}')

  @property
  def num_buckets(self) -> int:
    return len(self.difficulties)

  def to_json(self, path: str) -> None:
    metrics_lib.write_json_atomic(path, dataclasses.asdict(self))

  @classmethod
  def from_json(cls, path: str) -> 'Calibration':
    return cls(**metrics_lib.read_json(path))


def _run_config(workdir: str) -> dict[str, Any] | None:
  """The run's config from its newest checkpoint's meta (None if absent)."""
  root = os.path.join(workdir, 'checkpoints')
  steps = sorted((int(n) for n in os.listdir(root) if n.isdigit()),
                 reverse=True) if os.path.isdir(root) else []
  for step in steps:
    path = os.path.join(root, str(step), 'meta', 'metadata')
    try:
      config = json.loads(metrics_lib.read_json(path)['config'])
    except (OSError, ValueError, KeyError, TypeError):
      continue
    if isinstance(config, dict):
      return config
  return None


def _run_costs(workdir: str) -> dict[str, Any]:
  """One synchronous run's per-step costs from its metrics and results."""
  results = metrics_lib.read_json(os.path.join(workdir, 'results.json'))
  if set(results['staleness_histogram']) - {'0'}:
    raise ValueError(f'{workdir} is not synchronous (staleness '
                     f'{results["staleness_histogram"]}): its per-slot '
                     'costs do not add up to its wall time')
  records = sorted((r for r in metrics_lib.read_jsonl(
      os.path.join(workdir, 'metrics.jsonl')) if 'generation_seconds' in r),
                   key=lambda r: r['step'])
  versions = int(results['versions'])
  rows = results['samples'] / versions
  busy_total = results['learner_busy_fraction'] * results['wall_seconds']
  # Cumulative wall and busy seconds at each logged update.
  elapsed = [rows * r['step'] / r['samples_per_second'] for r in records]
  busy = [r['learner_busy_fraction'] * e for r, e in zip(records, elapsed)]
  first_busy = busy[0] if records and records[0]['step'] == 1 else 0.0
  warm: dict[int, list[float]] = {}
  overheads, steps = [], []
  for i, r in enumerate(records):
    b, seconds = int(r['difficulty']), r['generation_seconds']
    cold = b not in warm  # A bucket's first slot compiles its program.
    warm.setdefault(b, [])
    if not cold:
      warm[b].append(seconds)
    # An interval counts if it holds exactly one update, none compiling,
    # and no evaluation or checkpoint (both follow an evaluated update).
    if (i and not cold and r['step'] == records[i - 1]['step'] + 1
        and 'eval/pass_at_1' not in records[i - 1]):
      step = busy[i] - busy[i - 1]
      steps.append(step)
      overheads.append(elapsed[i] - elapsed[i - 1] - seconds - step)
  return {'latency': warm, 'overheads': overheads, 'steps': steps,
          'step_seconds': (busy_total - first_busy) / (versions - (
              first_busy > 0)), 'wall': results['wall_seconds'],
          'versions': versions, 'rows': rows,
          'mix': {int(d): n for d, n in results['difficulty_mix'].items()}}


def calibrate(paths: Sequence[str], learner_chips: int = 4,
              chips_per_actor: int = 4) -> Calibration:
  """Per-slot costs from synchronous RL workdirs (assumption 3).

  Latency per bucket: mean and log-std of `generation_seconds`, each
  bucket's first slot in a run left out (it compiles). Step: the learner's
  busy seconds (busy fraction x wall seconds of results.json) over the
  versions, the first update (its compilation) left out. Overhead: the
  mean of (interval between updates - generation - update) over intervals
  without compilation, evaluation or checkpoint. Fixed: what remains of
  each run's wall time, averaged.

  Args:
    paths: workdirs of synchronous runs (results.json, metrics.jsonl).
    learner_chips: the runs' learner devices.
    chips_per_actor: the runs' devices per actor group.

  Returns:
    The calibration at the runs' deployment.
  """
  if not paths:
    raise ValueError('calibrate needs at least one workdir')
  runs = [_run_costs(p) for p in sorted(paths)]
  rows = {r['rows'] for r in runs}
  if len(rows) != 1:
    raise ValueError(f'the runs have different rows per slot: {rows}')
  buckets = sorted(set().union(*(r['latency'] for r in runs)))
  pooled = {b: np.concatenate([r['latency'].get(b, []) for r in runs])
            for b in buckets}
  if any(len(v) < 2 for v in pooled.values()):
    raise ValueError(f'too few warm slots per bucket: '
                     f'{ {b: len(v) for b, v in pooled.items()} }')
  mean = np.array([pooled[b].mean() for b in buckets])
  sigma = np.array([np.log(pooled[b]).std() for b in buckets])
  steps = np.concatenate([r['steps'] for r in runs])
  step = float(np.mean([r['step_seconds'] for r in runs]))
  overhead = max(float(np.mean(np.concatenate(
      [r['overheads'] for r in runs]))), 0.0)
  fixed = []
  for r in runs:
    counts = np.array([r['mix'].get(b, 0) for b in buckets], np.float64)
    per_slot = float(counts @ mean) / counts.sum() + step + overhead
    fixed.append(max(r['wall'] - r['versions'] * per_slot, 0.0))
  return Calibration(
      difficulties=tuple(buckets), latency_mean=tuple(mean),
      latency_sigma=tuple(sigma), step_seconds=step,
      step_sigma=float(np.log(steps[steps > 0]).std()) if len(steps) else 0,
      overhead_seconds=overhead, fixed_seconds=float(np.mean(fixed)),
      rows_per_slot=int(rows.pop()), learner_chips=learner_chips,
      chips_per_actor=chips_per_actor, sources=tuple(sorted(paths)))


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Seconds to move data between processes: a + megabytes * b.

  Attributes:
    latency_seconds: a, the cost of a transfer of nothing.
    seconds_per_mb: b, the inverse of the bandwidth.
    source: where the figures were measured.
  """
  latency_seconds: float = 0.0
  seconds_per_mb: float = 0.0
  source: str = ''

  def __post_init__(self):
    if not (self.latency_seconds >= 0 and self.seconds_per_mb >= 0):
      raise ValueError(f'Transfer needs costs >= 0: {self}')

  def seconds(self, megabytes: float) -> float:
    return self.latency_seconds + megabytes * self.seconds_per_mb

  @classmethod
  def fit(cls, megabytes: Sequence[float], seconds: Sequence[float],
          source: str = '') -> 'Transfer':
    """The least-squares line through (megabytes, seconds), clipped at 0."""
    x = np.asarray(megabytes, np.float64)
    y = np.asarray(seconds, np.float64)
    if x.shape != y.shape or len(set(x.tolist())) < 2:
      raise ValueError(f'Transfer.fit needs seconds at >= 2 sizes: {x}, {y}')
    slope = max(float(np.polyfit(x, y, 1)[0]), 0.0)
    intercept = max(float(np.mean(y - slope * x)), 0.0)
    return cls(intercept, slope, source)

  def to_json(self, path: str) -> None:
    metrics_lib.write_json_atomic(path, dataclasses.asdict(self))

  @classmethod
  def from_json(cls, path: str) -> 'Transfer':
    return cls(**metrics_lib.read_json(path))


@dataclasses.dataclass(frozen=True)
class Deployment:
  """N rollout chips and M learner chips, c chips per actor group."""
  rollout_chips: int
  learner_chips: int
  chips_per_actor: int = 4

  @property
  def num_actors(self) -> int:
    return self.rollout_chips // self.chips_per_actor

  @classmethod
  def split(cls, chips: int, rollout_fraction: float = 0.5,
            chips_per_actor: int = 4) -> 'Deployment':
    rollout = int(round(chips * rollout_fraction))
    out = cls(rollout, chips - rollout, chips_per_actor)
    if out.num_actors < 1 or out.learner_chips < 1:
      raise ValueError(f'{chips} chips at rollout fraction '
                       f'{rollout_fraction} leave {out}: need >= '
                       f'{chips_per_actor} rollout chips and a learner')
    return out


def scale(cal: Calibration, deployment: Deployment,
          t_comm: float = 0.0) -> Calibration:
  """The calibration's costs at `deployment`, by weak scaling (assumption 4)."""
  m = deployment.learner_chips
  rows = cal.rows_per_slot * m / cal.learner_chips
  factor = (rows / deployment.chips_per_actor) / (
      cal.rows_per_slot / cal.chips_per_actor)
  step = cal.step_seconds + t_comm * math.log2(m / cal.learner_chips)
  if step <= 0:
    raise ValueError(f't_comm={t_comm} makes the learner step {step} s')
  return dataclasses.replace(
      cal, latency_mean=tuple(np.multiply(cal.latency_mean, factor)),
      verifier_mean=tuple(np.multiply(cal.verifier_mean, factor)),
      step_seconds=step, rows_per_slot=int(round(rows)), learner_chips=m,
      chips_per_actor=deployment.chips_per_actor)


@dataclasses.dataclass(frozen=True)
class Policy:
  """How slots get their bucket and their bound.

  Attributes:
    name: for tables.
    bound: the fixed bound s (0: synchronous); unused with `gas_options`.
    gas_options: schedule by GAS instead.
    split: synchronous with every actor group generating a share of each
      slot (assumption 5); needs bound 0.
    deterministic: generate slot k from exactly version k - bound.
  """
  name: str
  bound: int = 0
  gas_options: gas.GasOptions | None = None
  split: bool = False
  deterministic: bool = False

  def __post_init__(self):
    if self.bound < 0 or (self.split and (self.bound or self.gas_options)):
      raise ValueError(f'invalid policy {self}')


@dataclasses.dataclass(frozen=True)
class Trace:
  """Per slot k: its bucket, budget and version, and the times it passed."""
  bucket: np.ndarray
  budget: np.ndarray  # Its bound when dispatched.
  version: np.ndarray
  claim: np.ndarray
  start: np.ndarray
  finish: np.ndarray
  put: np.ndarray
  train_start: np.ndarray
  publish: np.ndarray  # When version k + 1 was published.

  @property
  def staleness(self) -> np.ndarray:
    return np.arange(len(self.bucket)) - self.version


@dataclasses.dataclass(frozen=True)
class SimResult:
  """One simulated run; the figures are properties."""
  policy: Policy
  num_actors: int
  rows_per_slot: int
  num_buckets: int
  makespan: float
  learner_busy_seconds: float
  learner_stall_seconds: float
  actor_idle_seconds: float
  actor_blocked_seconds: float
  trace: Trace
  drawn: np.ndarray  # Draws of each bucket by the mix (or the curriculum).
  deferrals: np.ndarray  # Dispatches each trained draw waited (GAS).
  pending: tuple[int, ...]  # GAS's deferred buckets left at the end.
  gas_state: gas.GasState | None

  @property
  def num_slots(self) -> int:
    return len(self.trace.bucket)

  @property
  def samples_per_second(self) -> float:
    return self.num_slots * self.rows_per_slot / self.makespan

  @property
  def learner_busy_fraction(self) -> float:
    return self.learner_busy_seconds / self.makespan

  @property
  def actor_idle_fraction(self) -> float:
    """Actor time spent waiting for a version."""
    return self.actor_idle_seconds / (self.num_actors * self.makespan)

  @property
  def actor_blocked_fraction(self) -> float:
    """Actor time spent holding a finished slot while the buffer is full."""
    return self.actor_blocked_seconds / (self.num_actors * self.makespan)

  @property
  def staleness_histogram(self) -> np.ndarray:
    """(buckets, max staleness + 1) counts of trained slots."""
    stale = self.trace.staleness
    out = np.zeros((self.num_buckets, int(stale.max()) + 1), np.int64)
    np.add.at(out, (self.trace.bucket, stale), 1)
    return out

  @property
  def trained_mix(self) -> np.ndarray:
    return np.bincount(self.trace.bucket, minlength=self.num_buckets)

  @property
  def mean_staleness(self) -> np.ndarray:
    """Per bucket (NaN where none trained)."""
    hist = self.staleness_histogram
    with np.errstate(invalid='ignore'):
      return hist @ np.arange(hist.shape[1]) / hist.sum(1)

  @property
  def deferral_mean(self) -> float:
    return float(self.deferrals.mean()) if len(self.deferrals) else 0.0

  @property
  def deferral_max(self) -> int:
    return int(self.deferrals.max()) if len(self.deferrals) else 0


def _lognormal(rng: np.random.Generator, mean: float, sigma: float) -> float:
  """A draw with mean `mean` and log-std `sigma` (exactly `mean` if 0)."""
  if sigma <= 0 or mean <= 0:
    return float(mean)
  return float(mean * math.exp(sigma * rng.standard_normal() - sigma**2 / 2))


class _Draws:
  """Each slot's bucket and bound: drawn from the mix under sync and a
  fixed bound, dispatched by GAS (which also hears the latencies) under
  GAS; counts the draws and GAS's deferrals."""

  def __init__(self, cal: Calibration, policy: Policy, mix: Any,
               rng: np.random.Generator):
    self.policy, self.rng = policy, rng
    b = cal.num_buckets
    p = np.full(b, 1.0 / b) if mix is None else np.asarray(mix, np.float64)
    if p.shape != (b,) or (p < 0).any() or not np.isclose(p.sum(), 1):
      raise ValueError(f'mix must be {b} probabilities: {mix}')
    self.cum = np.cumsum(p)
    self.opts = policy.gas_options
    if self.opts is not None:
      if self.opts.num_buckets != b:
        raise ValueError(f'GasOptions has {self.opts.num_buckets} buckets, '
                         f'the calibration {b}')
      self.gas_state = gas.init(self.opts)
      self.top = int(gas.budgets(self.gas_state, self.opts).max())
    else:
      self.gas_state, self.top = None, policy.bound
    self.drawn = np.zeros(b, np.int64)
    self.deferrals: list[int] = []
    self.pending_draws: list[int] = []  # Dispatch index of each deferral.

  def draw(self, k: int, version: int) -> tuple[int, int]:
    """Slot k's (bucket, bound), claimed at `version`."""
    return (self._gas(k, version) if self.opts is not None
            else self._fixed())

  def _fixed(self) -> tuple[int, int]:
    u = self.rng.random()
    b = int(min(np.searchsorted(self.cum, u, side='right'), len(self.cum) - 1))
    self.drawn[b] += 1
    return b, self.policy.bound

  def _gas(self, k: int, version: int) -> tuple[int, int]:
    before = self.gas_state
    b, after = gas.dispatch(before, self.opts, self.rng.random(),
                            lead=k - version)
    self.gas_state = after
    deferred = after.counts[1] - before.counts[1]
    if deferred.any():  # The draw waits; b substitutes for it.
      self.drawn[int(np.argmax(deferred))] += 1
      self.pending_draws.append(k)
    elif len(after.pending) < len(before.pending):  # A deferral goes.
      # Entries are (bucket, age), ages distinct; the others aged by one.
      kept = list(zip(after.pending, after.pending_age))
      i = next((j for j, (x, a) in enumerate(zip(before.pending,
                                                 before.pending_age))
                if j >= len(kept) or kept[j] != (x, a + 1)))
      self.deferrals.append(k - self.pending_draws.pop(i))
    else:
      self.drawn[b] += 1
      self.deferrals.append(0)
    return b, int(gas.budgets(after, self.opts)[b])

  def observe(self, **latency: Any) -> None:
    """`gas.observe_latency` under GAS (its keyword arguments)."""
    if self.opts is not None:
      self.gas_state = gas.observe_latency(self.gas_state, self.opts,
                                           **latency)


class _Costs:
  """Each job's seconds, drawn (assumption 1): a slot's generation and
  verification (under `split` the slowest of the groups' shares) and a
  learner step."""

  def __init__(self, cal: Calibration, rng: np.random.Generator,
               shares: int):
    self.cal, self.rng, self.shares = cal, rng, shares

  def slot_seconds(self, b: int) -> float:
    cal, draws = self.cal, self.shares
    return max(
        _lognormal(self.rng, cal.latency_mean[b] / draws,
                   cal.latency_sigma[b]) +
        _lognormal(self.rng, cal.verifier_mean[b] / draws,
                   cal.verifier_sigma[b]) for _ in range(draws))

  def step_seconds(self) -> float:
    return _lognormal(self.rng, self.cal.step_seconds, self.cal.step_sigma)


class _Jobs:
  """What runs, each job's [remaining, total] work; on dedicated compute
  all at full speed, on shared compute at 1/len(jobs) each."""

  def __init__(self, shared: bool):
    self.shared = shared
    self.work: dict[Any, list[float]] = {}

  def start(self, job: Any, work: float) -> None:
    self.work[job] = [work, work]

  def rate(self) -> float:
    return 1.0 / len(self.work) if self.shared else 1.0

  def until_next(self) -> float:
    """Seconds until the next job ends."""
    return min(r for r, _ in self.work.values()) / self.rate()

  def advance(self, dt: float) -> list[Any]:
    """Runs `dt` seconds; returns the jobs that ended (still listed)."""
    rate, done = self.rate(), []
    for job, entry in self.work.items():
      entry[0] -= dt * rate
      if entry[0] <= 1e-12 * max(1.0, entry[1]):
        done.append(job)
    return done

  def end(self, job: Any) -> float:
    """Removes `job`; returns its total work."""
    return self.work.pop(job)[1]


class _Simulation:
  """The event loop; `simulate` is its interface."""

  def __init__(self, cal: Calibration, policy: Policy, num_actors: int,
               num_slots: int, seed: int, mix: Any, shared_compute: bool,
               capacity: int | None, weights_seconds: float = 0.0,
               batch_seconds: float = 0.0):
    self.cal, self.policy, self.k_total = cal, policy, num_slots
    self.weights_seconds, self.batch_seconds = weights_seconds, batch_seconds
    self.waits: dict[int, float] = {}  # Slot -> its transfer seconds.
    self.groups = num_actors  # Actor groups sharing a split slot.
    self.n = 1 if policy.split else num_actors
    self.rng = np.random.default_rng(seed)
    self.draws = _Draws(cal, policy, mix, self.rng)
    self.costs = _Costs(cal, self.rng, num_actors if policy.split else 1)
    self.capacity = (self.draws.top + self.n if capacity is None
                     else capacity)
    self.now, self.version = 0.0, 0
    self.next_claim, self.next_needed = 0, 0
    self.buffer: set[int] = set()
    self.learner_job: int | None = None  # The slot in training.
    # 'held': the version the actor's process has (none at first).
    self.actors = [{'state': 'free', 'k': -1, 'held': -1}
                   for _ in range(self.n)]
    self.jobs = _Jobs(shared_compute)
    self.trace = {f.name: np.full(num_slots, np.nan) for f in
                  dataclasses.fields(Trace)}
    self.step_of: dict[int, float] = {}
    self.sums = dict(busy=0.0, stall=0.0, idle=0.0, blocked=0.0)

  # Instant transitions.

  def _claims(self) -> bool:
    changed = False
    for actor in self.actors:
      if actor['state'] != 'free':
        continue
      changed = True
      if self.next_claim >= self.k_total:
        actor['state'] = 'done'
        continue
      k = self.next_claim
      self.next_claim += 1
      b, budget = self.draws.draw(k, self.version)
      actor.update(state='waiting', k=k)
      for name, value in (('bucket', b), ('budget', budget),
                          ('claim', self.now)):
        self.trace[name][k] = value
    return changed

  def _starts(self) -> bool:
    changed = False
    for a, actor in enumerate(self.actors):
      k = actor['k']
      if actor['state'] != 'waiting':
        continue
      budget = int(self.trace['budget'][k])
      if self.version < k - budget:
        continue
      changed = True
      v = max(0, k - budget) if self.policy.deterministic else self.version
      b = int(self.trace['bucket'][k])
      self.trace['version'][k], self.trace['start'][k] = v, self.now
      fetch = self.weights_seconds if v != actor['held'] else 0.0
      actor['held'] = v
      self.waits[k] = fetch + self.batch_seconds
      self.jobs.start(('actor', a),
                      fetch + self.costs.slot_seconds(b) + self.batch_seconds)
      actor['state'] = 'generating'
    return changed

  def _puts(self) -> bool:
    changed = False
    for actor in sorted((x for x in self.actors if x['state'] == 'blocked'),
                        key=lambda x: x['k']):
      k = actor['k']
      if len(self.buffer) < self.capacity or k == self.next_needed:
        self.buffer.add(k)
        self.trace['put'][k] = self.now
        actor.update(state='free', k=-1)
        changed = True
    return changed

  def _take(self) -> bool:
    k = self.next_needed
    if self.learner_job is not None or k not in self.buffer:
      return False
    self.buffer.remove(k)
    self.next_needed += 1
    self.learner_job = k
    self.trace['train_start'][k] = self.now
    step = self.costs.step_seconds()
    self.step_of[k] = step
    self.jobs.start('learner', self.cal.overhead_seconds + step)
    return True

  def _settle(self) -> None:
    while self._take() | self._puts() | self._claims() | self._starts():
      pass

  # Time.

  def _advance(self) -> None:
    if not self.jobs.work:
      raise RuntimeError(
          f'the simulation stalled at t={self.now} (version {self.version}, '
          f'buffer {sorted(self.buffer)}, actors {self.actors})')
    dt = self.jobs.until_next()
    waiting = sum(a['state'] == 'waiting' for a in self.actors)
    blocked = sum(a['state'] == 'blocked' for a in self.actors)
    self.sums['idle'] += dt * waiting
    self.sums['blocked'] += dt * blocked
    if self.learner_job is None:
      self.sums['stall'] += dt
    self.now += dt
    done = self.jobs.advance(dt)
    # The learner first: a version published now is seen by every actor.
    for job in sorted(done, key=lambda j: j != 'learner'):
      self._finish(job)

  def _finish(self, job: Any) -> None:
    work = self.jobs.end(job)
    if job == 'learner':
      k, self.learner_job = self.learner_job, None
      elapsed = self.now - self.trace['train_start'][k]
      self.sums['busy'] += elapsed * self.step_of[k] / work
      self.version = k + 1
      self.trace['publish'][k] = self.now
      self.draws.observe(step_seconds=elapsed)
      return
    actor = self.actors[job[1]]
    k = actor['k']
    self.trace['finish'][k] = self.now
    self.draws.observe(
        bucket=int(self.trace['bucket'][k]),
        # Generation alone, as the runtime's actors time it.
        seconds=self.now - self.trace['start'][k] - self.waits[k])
    actor['state'] = 'blocked'

  def run(self) -> None:
    """Simulates until the last slot's version is published."""
    self._settle()
    while self.version < self.k_total:
      self._advance()
      self._settle()


def _result(sim: _Simulation) -> SimResult:
  """The figures of a simulation that ran."""
  t, draws = sim.trace, sim.draws
  trace = Trace(**{name: (t[name].astype(np.int64) if name in (
      'bucket', 'budget', 'version') else t[name]) for name in t})
  return SimResult(
      policy=sim.policy, num_actors=sim.groups,
      rows_per_slot=sim.cal.rows_per_slot,
      num_buckets=sim.cal.num_buckets, makespan=sim.now,
      learner_busy_seconds=sim.sums['busy'],
      learner_stall_seconds=sim.sums['stall'],
      actor_idle_seconds=sim.sums['idle'] * sim.groups / sim.n,
      actor_blocked_seconds=sim.sums['blocked'] * sim.groups / sim.n,
      trace=trace, drawn=draws.drawn,
      deferrals=np.array(draws.deferrals, np.int64),
      pending=() if draws.gas_state is None else draws.gas_state.pending,
      gas_state=draws.gas_state)


def simulate(cal: Calibration, policy: Policy, num_actors: int,
             num_slots: int, seed: int = 0, mix: Any = None,
             shared_compute: bool = False,
             capacity: int | None = None, weights_seconds: float = 0.0,
             batch_seconds: float = 0.0) -> SimResult:
  """Runs the runtime's rules over `num_slots` slots.

  Args:
    cal: the per-slot costs (at the deployment simulated: see `scale`).
    policy: sync, a fixed bound, or GAS.
    num_actors: actor groups.
    num_slots: slots to train (the run ends at the last publication).
    seed: draws of buckets, GAS's u and the latencies.
    mix: p(b) for sync and fixed bounds (default uniform).
    shared_compute: all jobs share one processor (this machine) instead
      of each running on its own chips (assumption 2).
    capacity: the buffer's (default: max bound + num_actors).
    weights_seconds: an actor group's wait for a version it does not
      hold (a process of its own; assumption 1).
    batch_seconds: a finished slot's way to the learner's buffer.

  Returns:
    The run's figures and its per-slot trace.
  """
  if num_actors < 1 or num_slots < 1:
    raise ValueError(f'need actors and slots: {num_actors}, {num_slots}')
  if not (weights_seconds >= 0 and batch_seconds >= 0):
    raise ValueError(f'transfer seconds must be >= 0: {weights_seconds}, '
                     f'{batch_seconds}')
  sim = _Simulation(cal, policy, num_actors, num_slots, seed, mix,
                    shared_compute, capacity, weights_seconds, batch_seconds)
  sim.run()
  return _result(sim)


def gas_options(cal: Calibration, s_base: int = 4, alpha: float = 0.5,
                execution_aware: bool = True, max_defer: int = 8,
                **kw) -> gas.GasOptions:
  """GAS over the calibration's buckets, fixed curriculum and alpha."""
  kw.setdefault('bandit', 'uniform')
  return gas.GasOptions(difficulties=cal.difficulties, s_base=s_base,
                        alpha=alpha, estimate_alpha=False,
                        execution_aware=execution_aware,
                        max_defer=max_defer, **kw)


def _staleness_cell(result: SimResult) -> str:
  return ' / '.join('-' if math.isnan(x) else f'{x:.2f}'
                    for x in result.mean_staleness)


def predict(cal: Calibration, chips: Sequence[int],
            options: gas.GasOptions, bounds: Sequence[int] = (1, 2, 4, 8),
            rollout_fraction: float = 0.5, chips_per_actor: int = 4,
            t_comm: float = 0.0, num_slots: int = 2000,
            seed: int = 0) -> str:
  """The markdown table of predictions at each total chip count."""
  names = '/'.join(f'd{d:g}' for d in cal.difficulties)
  head = ['chips (rollout+learner)', 'actor groups', 'rows/slot', 'policy',
          'samples/s', 'x sync', 'learner busy', 'actors idle',
          f'mean staleness {names}', f'trained mix {names} (%)',
          'deferred mean/max']
  table = []
  for total in chips:
    dep = Deployment.split(total, rollout_fraction, chips_per_actor)
    at = scale(cal, dep, t_comm)
    n = dep.num_actors

    def run(policy, at=at, n=n):
      return simulate(at, policy, n, num_slots, seed)

    sync = run(Policy('sync'))
    fixed = [run(Policy(f's={s}', bound=s)) for s in bounds]
    best = max(fixed, key=lambda r: r.samples_per_second)
    rows = [('sync', sync), ('sync, split', run(Policy('split', split=True))),
            (f'best fixed ({best.policy.name})', best)]
    if best.policy.bound != options.s_base:  # GAS's own global bound.
      rows.append((f'fixed s={options.s_base} (= s_base)', next(
          (r for r in fixed if r.policy.bound == options.s_base), None)
                   or run(Policy('s_base', bound=options.s_base))))
    rows.append((f'GAS (s_base={options.s_base}, alpha={options.alpha:g}'
                 f'{"" if options.execution_aware else ", not exec-aware"})',
                 run(Policy('gas', gas_options=options))))
    for name, r in rows:
      deferred = (f'{r.deferral_mean:.2f} / {r.deferral_max}'
                  if r.policy.gas_options is not None else '-')
      mix = ' / '.join(f'{100 * x:.0f}' for x in r.trained_mix / r.num_slots)
      table.append([
          f'{total} ({dep.rollout_chips}+{dep.learner_chips})', n,
          at.rows_per_slot, name, f'{r.samples_per_second:,.0f}',
          f'{r.samples_per_second / sync.samples_per_second:.2f}x',
          f'{r.learner_busy_fraction:.2f}', f'{r.actor_idle_fraction:.2f}',
          _staleness_cell(r), mix, deferred])
  return stats.markdown_table(head, table, '-' * len(head))


def _histogram_fractions(hist: dict[int, int], size: int) -> np.ndarray:
  out = np.zeros(size)
  for tau, count in hist.items():
    out[tau] += count
  return out / out.sum()


def _fractions_cell(fractions: np.ndarray) -> str:
  return ' '.join(f'{x:.3f}' for x in fractions)


def check(cal: Calibration, paths: Sequence[str], bound: int = 0,
          num_actors: int = 2, seed: int = 0) -> str:
  """Predicted against measured samples/s and staleness, per real run.

  Each run is simulated at the calibration's deployment over its
  versions, on shared compute (this machine) and on dedicated compute
  (what disjoint chips would give), with the calibration's fixed seconds
  added to the predicted wall time. Its s, num_actors and deterministic
  mode come from its checkpoint meta, else from `bound`, `num_actors`.
  """
  head = ['run', 's', 'actors', 'measured samples/s', 'predicted, shared',
          'ratio', 'predicted, dedicated', 'ratio', 'staleness measured',
          'predicted (shared)', 'TV distance']
  table = []
  for path in sorted(paths):
    results = metrics_lib.read_json(os.path.join(path, 'results.json'))
    runtime = (_run_config(path) or {}).get('runtime', {})
    s = int(runtime.get('max_staleness', bound))
    n = int(runtime.get('num_actors', num_actors))
    policy = Policy(f's={s}', bound=s,
                    deterministic=bool(runtime.get('deterministic', False)))
    versions = int(results['versions'])
    rows = results['samples'] / versions
    if rows != cal.rows_per_slot:
      raise ValueError(f'{path} has {rows} rows per slot, the calibration '
                       f'{cal.rows_per_slot}')
    measured = {int(t): c for t, c in results['staleness_histogram'].items()}
    predicted = {}
    for shared in (True, False):
      r = simulate(cal, policy, n, versions, seed, shared_compute=shared,
                   capacity=runtime.get('buffer_capacity'))
      predicted[shared] = (results['samples'] / (r.makespan +
                                                 cal.fixed_seconds), r)
    hist = predicted[True][1].staleness_histogram.sum(0)
    size = max(len(hist), max(measured) + 1)
    p = _histogram_fractions(measured, size)
    q = _histogram_fractions(dict(enumerate(hist)), size)
    sps = results['samples_per_second']
    table.append([
        os.path.basename(path), s, n, f'{sps:,.0f}',
        f'{predicted[True][0]:,.0f}', f'{predicted[True][0] / sps:.2f}',
        f'{predicted[False][0]:,.0f}', f'{predicted[False][0] / sps:.2f}',
        _fractions_cell(p), _fractions_cell(q),
        f'{0.5 * np.abs(p - q).sum():.3f}'])
  return stats.markdown_table(head, table, '-' * len(head))


def summary(cal: Calibration) -> str:
  lat = ', '.join(f'd{d:g} {m * 1e3:.1f} ms (log-std {s:.2f})' for d, m, s in
                  zip(cal.difficulties, cal.latency_mean, cal.latency_sigma))
  return (f'Calibration ({len(cal.sources)} runs, {cal.rows_per_slot} rows '
          f'per slot, {cal.learner_chips} learner chips, '
          f'{cal.chips_per_actor} chips per actor group): generation {lat}; '
          f'learner step {cal.step_seconds * 1e3:.1f} ms (log-std '
          f'{cal.step_sigma:.2f}); host overhead '
          f'{cal.overhead_seconds * 1e3:.1f} ms per version; fixed '
          f'{cal.fixed_seconds:.1f} s per run.')


def _feed_limit(at: Calibration, num_actors: int, mix: np.ndarray) -> float:
  """The longest weight transfer at which the actor groups still produce a
  slot per learner step: n (o + T) - (L + V), L + V averaged over `mix`."""
  generate = float(mix @ (np.add(at.latency_mean, at.verifier_mean)))
  return num_actors * (at.overhead_seconds + at.step_seconds) - generate


def across_processes(cal: Calibration, chips: Sequence[int],
                     options: gas.GasOptions, transfer: Transfer,
                     version_mb: float, batch_mb: float,
                     bounds: Sequence[int] = (1, 2, 4, 8),
                     rollout_fractions: Sequence[float] = (0.25, 0.5, 0.75),
                     chips_per_actor: int = 4, t_comm: float = 0.0,
                     num_slots: int = 2000, seed: int = 0) -> str:
  """Predictions with every actor group a process of its own (markdown).

  For each total chip count, policy (sync split, the best fixed bound,
  GAS) and rollout share of the chips, the run is simulated with the
  weight and batch transfers of `transfer` and without them (one
  process); the row is the share with the most samples/s across
  processes. "Transfer budget" is `_feed_limit`: the weight transfer at
  which the actor groups stop keeping the learner busy ("none": they do
  not even without transfers; generation bounds the run), and the
  bandwidth a version of `version_mb` needs to arrive within it at the
  measured latency.
  """
  head = ['chips', 'rollout+learner', 'policy', 'learner step (ms)',
          'weights (ms)', 'weights / step', 'transfer budget (ms)',
          'GB/s to fit it', 'samples/s, one process',
          'across processes', 'ratio', 'mean staleness, one / across']
  table = []
  weights = transfer.seconds(version_mb)
  batch = transfer.seconds(batch_mb)
  mix = np.full(cal.num_buckets, 1.0 / cal.num_buckets)
  for total in chips:
    best: dict[str, tuple] = {}
    for fraction in rollout_fractions:
      try:
        dep = Deployment.split(total, fraction, chips_per_actor)
      except ValueError:
        continue
      at = scale(cal, dep, t_comm)
      n = dep.num_actors

      def run(policy, cost, at=at, n=n):
        return simulate(at, policy, n, num_slots, seed,
                        weights_seconds=cost * weights,
                        batch_seconds=cost * batch)

      candidates = {'sync, split': [Policy('split', split=True)],
                    'best fixed': [Policy(f's={s}', bound=s) for s in bounds],
                    'GAS': [Policy('gas', gas_options=options)]}
      for name, policies in candidates.items():
        across = max((run(p, 1.0) for p in policies),
                     key=lambda r: r.samples_per_second)
        if (name not in best or across.samples_per_second >
            best[name][1].samples_per_second):
          one = run(across.policy, 0.0)
          best[name] = (dep, across, one, at, _feed_limit(at, n, mix))
    for name, (dep, across, one, at, limit) in best.items():
      label = name if name != 'best fixed' else (
          f'best fixed ({across.policy.name})')
      stale = [float(r.trace.staleness.mean()) for r in (one, across)]
      table.append([
          total, f'{dep.rollout_chips}+{dep.learner_chips}', label,
          f'{1e3 * at.step_seconds:.1f}', f'{1e3 * weights:.1f}',
          f'{weights / at.step_seconds:.2f}',
          f'{1e3 * limit:.0f}' if limit > 0 else 'none',
          (f'{version_mb / 2**10 / (limit - transfer.latency_seconds):.3f}'
           if limit > transfer.latency_seconds else '-'),
          f'{one.samples_per_second:,.0f}',
          f'{across.samples_per_second:,.0f}',
          f'{across.samples_per_second / one.samples_per_second:.2f}x',
          f'{stale[0]:.2f} / {stale[1]:.2f}'])
  return stats.markdown_table(head, table, '-' * len(head))
