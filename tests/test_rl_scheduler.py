"""train.rl.scheduler: GAS's plans are a function of the slot in
deterministic mode and survive a checkpoint; admission reads the learner's
state; bad scheduler settings name their field."""

import json
import math

import numpy as np
import pytest

from configs import rl as rl_config
from geom import gas
from train.errors import ConfigError
from train.rl import scheduler as scheduler_lib
from train.rl import tasks


def _gas(config, deterministic):
  return scheduler_lib.Gas(scheduler_lib.settings(config), deterministic)


def _config(variant='full', **gas_fields):
  config = rl_config.get_config(f'gas={variant},staleness=3')
  config.runtime.deterministic = True
  config.gas.latency_source = 'model'
  config.gas.update(gas_fields)
  return config


def _feedback(config, version):
  """Synthetic learner feedback for the update that makes `version`."""
  rng = np.random.default_rng([version, 5])
  rows = config.prompts_per_batch * config.grpo.group_size
  return dict(rewards=rng.integers(0, 2, rows).astype(np.float32),
              rows=rows, generation_seconds=float(rng.uniform(0.1, 2)),
              step_seconds=float(rng.uniform(0.05, 0.2)))


def _drive(sched, config, start, stop, plans, cut=None):
  """The learner and (ahead of it) the actors, as the runtime orders them:
  at version v every slot up to v + S is planned, slot v is admitted and
  trained, then version v + 1 is observed. Returns the save at `cut`."""
  saved = None
  for v in range(start, stop):
    for k in range(v, v + sched.bound + 1):
      plan = sched.plan(k, latest=v)
      assert plans.setdefault(k, plan) == plan, (k, plans[k], plan)
    plan = plans[v]
    # Generated from exactly its min_version; a refused batch is generated
    # again from version v (staleness 0), as the runtime does.
    admitted = sched.admit(v, plan.difficulty, v - plan.min_version)
    plans[('admitted', v)] = admitted
    curvatures = None
    if sched.needs_curvature(v + 1):
      curvatures = {d: math.exp(0.5 * d + 0.1 * np.sin(v))
                    for d in config.difficulties}
    sched.observe(v + 1, difficulty=plan.difficulty,
                  regenerated=not admitted, curvatures=curvatures,
                  **_feedback(config, v + 1))
    if cut is not None and v + 1 == cut:
      for k in range(cut, cut + sched.bound + 1):  # Actors ran ahead.
        plans.setdefault(k, sched.plan(k, latest=cut))
      # Through JSON, as the checkpoint's meta stores it.
      saved = json.loads(json.dumps(sched.save(cut)))
  return saved


def test_deterministic_plans_repeat_and_survive_a_checkpoint():
  config = _config(curvature_every=7)
  whole = {}
  sched = _gas(config, deterministic=True)
  _drive(sched, config, 0, 60, whole)
  refused = sum(not v for k, v in whole.items() if isinstance(k, tuple))
  rows = config.prompts_per_batch * config.grpo.group_size
  out = sched.diagnostics()
  by = lambda name: sum(out[f'{name}/d{d}'] for d in config.difficulties)
  assert by('dropped') == refused * rows and by('admitted') == 60 * rows
  assert by('dispatched') == 60 + sched.bound  # Planned ahead of training.
  again = {}
  _drive(_gas(config, deterministic=True), config, 0, 60,
         again)
  assert again == whole
  # The budgets and the curriculum did move: not a constant schedule.
  slots = {k: p for k, p in whole.items() if isinstance(k, int)}
  assert len({p.difficulty for p in slots.values()}) > 1
  assert len({k - p.min_version for k, p in slots.items() if k > 3}) > 1
  # Some batches were refused (the budgets tightened after their plan).
  assert not all(v for k, v in whole.items() if isinstance(k, tuple))
  for cut in (1, 23, 35):
    first = {}
    saved = _drive(_gas(config, deterministic=True), config, 0,
                   cut, first, cut=cut)
    resumed = _gas(config, deterministic=True)
    resumed.restore(cut, saved)
    later = {}
    _drive(resumed, config, cut, 60, later)
    assert later == {k: p for k, p in whole.items()
                     if (k if isinstance(k, int) else k[1]) >= cut}, cut


def test_deterministic_plans_use_the_state_at_version_k_minus_s():
  config = _config(curvature_every=5)
  sched = _gas(config, deterministic=True)
  plans = {}
  _drive(sched, config, 0, 30, plans)
  # Replay the dispatcher by hand from a twin that records its states.
  twin = _gas(config, deterministic=True)
  states = {0: twin._states[0]}  # pylint: disable=protected-access
  dispatch = gas.init(twin.options)
  for v in range(30):
    for k in range(v, v + 4):
      if k not in states.get('done', set()):
        source = states[max(0, k - 3)]
        merged = source._replace(pending=dispatch.pending,
                                 pending_age=dispatch.pending_age,
                                 credit=dispatch.credit,
                                 counts=np.concatenate(
                                     [dispatch.counts[:2],
                                      source.counts[2:]]))
        u = float(np.random.default_rng([config.seed, k, 29]).random())
        bucket, dispatch = gas.dispatch(merged, twin.options, u)
        budget = int(gas.budgets(merged, twin.options)[bucket])
        assert plans[k] == scheduler_lib.Plan(
            int(config.difficulties[bucket]), max(0, k - budget)), k
        states.setdefault('done', set()).add(k)
    plan = plans[v]
    admitted = plans[('admitted', v)]
    curv = ({d: math.exp(0.5 * d + 0.1 * np.sin(v))
             for d in config.difficulties} if (v + 1) % 5 == 0 else None)
    twin.observe(v + 1, difficulty=plan.difficulty,
                 regenerated=not admitted, curvatures=curv,
                 **_feedback(config, v + 1))
    states[v + 1] = twin._states[v + 1]  # pylint: disable=protected-access


def test_admission_reads_the_learners_current_budgets():
  config = _config(coupling=0.0, alpha=2.0, estimate_alpha=False,
                   curvature_every=0)
  sched = _gas(config, deterministic=True)
  limits = gas.budgets(gas.init(sched.options), sched.options)
  assert limits.tolist() == [3, 1, 0, 0, 0]
  for b, d in enumerate(config.difficulties):
    assert sched.admit(0, d, int(limits[b]))
    assert not sched.admit(0, d, int(limits[b]) + 1)


def test_the_model_latency_is_tokens_times_seconds_per_token():
  config = _config()
  settings = scheduler_lib.settings(config)
  for d in config.difficulties:
    assert scheduler_lib.latency_of(settings, d, 123.0) == pytest.approx(
        config.gas.model_seconds_per_token
        * tasks.max_answer_tokens(config.family, d))
  config.gas.latency_source = 'measured'
  assert scheduler_lib.latency_of(scheduler_lib.settings(config), 3,
                                  1.5) == 1.5


def test_the_fixed_bound_plans_uniform_difficulties_at_k_minus_s():
  config = rl_config.get_config('staleness=2')
  sched = scheduler_lib.make(scheduler_lib.settings(config),
                             deterministic=False)
  plans = [sched.plan(k, latest=0) for k in range(300)]
  assert [p.min_version for p in plans[:4]] == [0, 0, 0, 1]
  counts = np.bincount([p.difficulty for p in plans], minlength=6)[1:]
  assert counts.min() > 40  # Each of 5 difficulties about 60 of 300.
  assert all(sched.admit(k, 1, 2) and not sched.admit(k, 1, 3)
             for k in range(3))


@pytest.mark.parametrize('field,value,named', [
    ('scheduler', 'lottery', 'scheduler'),
    ('gas.bandit', 'thompson', 'gas.bandit'),
    ('gas.alpha', -1.0, 'gas.alpha'),
    ('gas.curvature', 'lanczos', 'gas.curvature'),
    ('gas.curvature_every', -1, 'gas.curvature_every'),
    ('gas.latency_source', 'measured', 'gas.latency_source'),
    ('gas.model_step_seconds', 0.0, 'gas.model_step_seconds'),
    ('runtime.max_staleness', -1, 'runtime.max_staleness'),
    ('gas.s_base', 99, 'gas.s_base'),  # Above runtime.max_staleness.
    ('gas.s_base', -1, 'gas.s_base'),
])
def test_bad_settings_name_their_field(field, value, named):
  config = _config()
  block, _, last = field.rpartition('.')
  (config[block] if block else config)[last] = value
  with pytest.raises(ConfigError, match=named.replace('.', r'\.')):
    scheduler_lib.check_config(config)


def test_s_base_is_its_own_field_below_the_hard_bound():
  config = _config()
  bound = config.runtime.max_staleness
  assert bound >= 2
  assert scheduler_lib.settings(config).options.s_base == bound  # Unset.
  config.gas.s_base = bound - 1
  scheduler_lib.check_config(config)
  settings = scheduler_lib.settings(config)
  assert (settings.options.s_base, settings.bound) == (bound - 1, bound)
  sched = scheduler_lib.Gas(settings, deterministic=True)
  # The easiest difficulty's budget is s_base, not the hard bound.
  easiest = min(config.difficulties)
  assert sched.admit(0, easiest, bound - 1)
  assert not sched.admit(0, easiest, bound)
