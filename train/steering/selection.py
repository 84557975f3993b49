"""Steering settings chosen on validation items, then test items scored once.

For each steered method of the config (every method gets the same
selection, addition as much as the rotation, so the comparison stays
fair), the selection picks

- the layer, of `selection.layers`;
- the direction method, of `selection.direction_methods` (mean
  difference, repeng's pca_center, steering-vectors' logistic: any of
  `geom.steering.DIRECTION_METHODS`), each extracted from the same
  contrastive pairs as `evaluation.extract` (`config.direction`);
- the strength grid, of `config.alphas`;

reading only the validation split: `selection.items_per_set` items per set, one
set per seed of `selection.mc_seeds` (seeds of its own), of each of the
config's tasks (`text_corpus.mc_item_sets(..., 'validation')`), and
held-out text of the validation split for the KL. Every candidate
(layer, direction method) sweeps every alpha; `selection_rule` holds the
rule that reads the sweeps (accuracy at matched KL over
`selection.targets`, averaged over the tasks; the most targets reached
first, then the best score) and the grid (the alphas whose validation KL
brackets the targets). `selection.score` says which accuracy: on mean
('mean', length-normalised) or summed log-probabilities.

The gated methods (spherical_gate, addition_gate) take the gate of
`selection.gate` (`selection_gate`): 'reference' (the config's kappa and
beta, uncentred) or 'calibrated' (per candidate, centred on the layer's
mean over the contrastive pairs' tokens, kappa and beta from
`geom.steering.calibrate_gate` on those tokens' centred cosines: the
contrastive set only). Their candidates record the gate ('gate': kind,
center norm, kappa, beta, ...), the gate's trigger rate on the
validation held-out tokens ('gate_trigger_rate') and its value's
histogram there ('delta_hist', `geom.steering.SteerStats.delta_hist`);
the test rows the same gate, their trigger rate and 'delta_hist' on the
test held-out tokens, and gate_<method>.png plots the latter at the
chosen layer with beta marked (`pareto.plot_gate`).

Then the test item sets (`config.tasks`, `config.mc_seeds`, split 'test')
and the test held-out text are evaluated once, each method at its chosen
setting, with `evaluation`'s machinery: rows as `evaluation.evaluate`
writes them, with each row's layer and direction method, so the study's
matched-KL bootstrap reads them unchanged. The selection's functions
take the LM and the validation data alone; selection.json (the
validation items, every candidate's sweep and the choice) is written
before any test item is made.
"""

import functools
import json
import math
import os
from typing import Any, Callable, NamedTuple

from absl import logging
import jax
import numpy as np

from geom import steering as steering_lib
from train.analysis import measure_cache
from train.errors import ConfigError
from train.lm import corpus as text_corpus
from train.lm import hooks as steering_hooks
from train.lm import interface
from train.lm import models as lm_models
from train.lm import polarity_sentences
from train.run import metrics as metrics_lib
from train.run.job import open_job
from train.steering import evaluation
from train.steering import scoring
from train.steering import pareto
from train.steering import selection_gate
from train.steering import selection_rule
from train.steering import vectors as steering_vectors
from train.training import experiment as experiment_lib

# The only split the selection reads.
SELECTION_SPLIT = 'validation'
SCORES = ('mean', 'sum')
FILENAME = 'selection.json'
# Below the workdir: one record per validation sweep and per test row, so
# that a rerun after an interruption goes on from them (`Kept`).
SWEEPS, ROWS = 'selection_sweeps', 'test_rows'


def enabled(config) -> bool:
  """Whether the config asks for a selection (its `selection` block, set
  by the configs' `selection` argument)."""
  return 'selection' in config


def check_config(config) -> None:
  """`evaluation.check_config`, then the selection's fields: ConfigError
  naming the field (and the valid choices) before anything is loaded."""
  evaluation.check_config(config)
  sel = config.selection
  if config.get('vector_file'):
    raise ConfigError('vector_file', config.vector_file, 'a selection '
                      'extracts its own directions; leave it empty')
  if not [m for m in config.methods if m != 'none']:
    raise ConfigError('methods', tuple(config.methods), 'a selection needs '
                      'a steered method', evaluation.METHODS)
  _check_layers(config)
  methods = tuple(sel.direction_methods)
  bad = [m for m in methods if m not in steering_lib.DIRECTION_METHODS]
  if bad or not methods or len(set(methods)) != len(methods):
    raise ConfigError('selection.direction_methods', methods,
                      f'unknown direction method {bad[0]!r}' if bad else
                      'give distinct methods, at least one',
                      steering_lib.DIRECTION_METHODS)
  seeds = tuple(sel.mc_seeds)
  if (not seeds or not all(type(s) is int for s in seeds)
      or len(set(seeds)) != len(seeds)):
    raise ConfigError('selection.mc_seeds', seeds, 'must be distinct '
                      'integers, one validation item set per seed')
  n = sel.items_per_set
  if type(n) is not int or not 0 < n <= evaluation.MAX_ITEMS:
    raise ConfigError('selection.items_per_set', n, 'must be an integer in '
                      f'[1, {evaluation.MAX_ITEMS}] (items per set)')
  for task in config.tasks:
    evaluation.check_capacity('selection.items_per_set', task, n,
                              SELECTION_SPLIT, len(seeds))
  targets = tuple(sel.targets)
  if (not targets or not all(isinstance(t, (int, float)) and 0 < t < 1e9
                             for t in targets)
      or list(targets) != sorted(set(targets))):
    raise ConfigError('selection.targets', targets, 'give increasing KL '
                      'values > 0 (at least one)')
  if sel.score not in SCORES:
    raise ConfigError('selection.score', sel.score, 'unknown score', SCORES)
  if sel.get('gate') not in selection_gate.GATES:
    raise ConfigError('selection.gate', sel.get('gate'), 'unknown gate of '
                      'the gated methods', selection_gate.GATES)


def _check_layers(config) -> None:
  layers = tuple(config.selection.layers)
  if (not layers or not all(type(l) is int and l >= 0 for l in layers)
      or len(set(layers)) != len(layers)):
    raise ConfigError('selection.layers', layers, 'give distinct block '
                      'indices >= 0, at least one')
  if evaluation.lm_kind(config) == 'gemma':  # The shape is known unloaded.
    blocks = lm_models.shape_named(config.shape, config.gguf).num_layers
    bad = [l for l in layers if l >= blocks]
    if bad:
      raise ConfigError('selection.layers', layers, f'block {bad[0]} is out '
                        f'of range', range(blocks))


def evaluate(config, workdir: str) -> list[dict[str, Any]]:
  """Selects on validation data, writes selection.json, then evaluates
  the test item sets once at the chosen settings: results.json,
  results.md, a steering vector per method and (with generations)
  pareto.png, as `evaluation.evaluate` writes them. Returns the rows.

  Raises:
    UsageError: a setting is invalid, or does not fit the LM; nothing is
      written then.
    WorkdirBusy: another run holds the workdir.
  """
  check_config(config)
  workdir = experiment_lib.check_workdir(workdir)
  with open_job(workdir):
    subject = evaluation.load_subject(config)
    lm = subject.lm
    paths = layer_paths(config, lm.params)
    evaluation.check_generation_fits(config.generation, subject.prompts,
                                     lm.model.max_len)
    data = validation_data(config, lm, subject.windows(SELECTION_SPLIT))
    kept = Kept(workdir, dict(config=json.loads(config.to_json()),
                              model=lm.fingerprint,
                              tokenizer=lm.tokenizer.fingerprint))
    record, settings = select(config, lm, data, paths, kept)
    metrics_lib.write_json_atomic(os.path.join(workdir, FILENAME), record)
    rows, batches = evaluate_selected(config, subject, record, settings,
                                      paths, kept)
    _write(config, workdir, subject, record, settings, paths, rows,
           list(batches))
    return rows


def layer_paths(config, params) -> dict[int, str]:
  """Each candidate layer's parameter path (ConfigError naming
  `selection.layers` for a block the LM does not have)."""
  try:
    return {l: steering_hooks.resolve_layer(params, l)
            for l in config.selection.layers}
  except ValueError as e:
    raise ConfigError('selection.layers', tuple(config.selection.layers),
                      str(e).split(': ', 1)[1]) from None


class ValidationData(NamedTuple):
  """What the selection reads: item sets per task (one list per seed),
  their encoded batches, and held-out windows by source."""
  items: dict[str, list[list[text_corpus.MCItem]]]
  batches: dict[str, scoring.MCBatch]
  windows: dict[str | None, np.ndarray]


def validation_data(config, lm: interface.Loaded,
                    windows: dict[str | None, np.ndarray]) -> ValidationData:
  """The validation item sets of every task of the config, encoded."""
  sel = config.selection
  items = {t: text_corpus.mc_item_sets(t, sel.items_per_set,
                                       tuple(sel.mc_seeds), SELECTION_SPLIT)
           for t in config.tasks}
  batches = {t: scoring.encode_mc([it for s in sets for it in s],
                                  lm.tokenizer) for t, sets in items.items()}
  length = max(b.longest for b in batches.values())
  if length > lm.model.max_len:
    raise ConfigError('selection.items_per_set', sel.items_per_set,
                      f'items of {length} tokens exceed the LM\'s max_len')
  return ValidationData(items, batches, windows)


def _scorers(lm: interface.Loaded, path: str, batches, windows,
             all_paths: list[str], dim: int):
  """The multiple-choice and held-out scorers steering at `path`."""
  none = steering_lib.Steering('none', np.ones(dim, np.float32), alpha=0.0)
  mc = {t: scoring.MCScorer(lm.model, lm.params, b, path)
        for t, b in batches.items()}
  held = {s: scoring.HeldoutScorer(lm.model, lm.params, w, path, all_paths,
                                   none) for s, w in windows.items()}
  return mc, held, none


class Setting(NamedTuple):
  """A candidate's steering numbers: the unit direction, the addition
  coefficient and the gated methods' gate."""
  direction: np.ndarray
  coefficient: float
  gate: selection_gate.Gate


def _operator(config, method: str, setting: Setting,
              alpha: float) -> steering_lib.Steering:
  """The operator of `method` at a candidate's setting: one place for the
  validation sweeps and the test rows alike. The gated methods take the
  setting's gate; the others the config's kappa and beta, uncentred."""
  if method in selection_gate.GATED_METHODS:
    gate = setting.gate
    return evaluation.make_steering(
        method, setting.direction, float(alpha), kappa=gate.kappa,
        beta=gate.beta, coefficient=setting.coefficient, center=gate.center)
  return evaluation.make_steering(method, setting.direction, float(alpha),
                                  kappa=config.kappa, beta=config.beta,
                                  coefficient=setting.coefficient)


def _accuracy(scorers, steer, score: str) -> dict[str, float]:
  return {t: s.accuracy(steer)[f'acc_{score}'] for t, s in scorers.items()}


class Kept:
  """The selection's sweeps and test rows kept in its workdir as they are
  made (`train.analysis.measure_cache`: one JSON record each, written
  atomically with the identity of the config and the model and tokenizer
  files), so that a rerun after an interruption computes only what is
  missing; a record of another identity is refused, naming --workdir.
  `Kept(None)` keeps nothing."""

  def __init__(self, workdir: str | None, identity: dict | None = None):
    self.workdir, self.identity = workdir, identity

  def __call__(self, kind: str, name: str,
               compute: Callable[[], dict]) -> dict:
    if self.workdir is None:
      return compute()
    record = measure_cache.cached(
        os.path.join(self.workdir, kind, f'{name}.json'), self.identity,
        compute, root=self.workdir)
    return {k: v for k, v in record.items() if k != 'identity'}


def select(config, lm: interface.Loaded, data: ValidationData,
           paths: dict[int, str], kept: Kept = Kept(None)
           ) -> tuple[dict[str, Any], dict]:
  """Every candidate's validation sweep and each method's choice; a
  sweep `kept` holds is read, not run again (a layer's scorers are built
  only for a sweep it lacks).

  Returns:
    The record (selection.json's contents) and each candidate's `Setting`
    by (layer, direction method).
  """
  sel = config.selection
  steered = [m for m in config.methods if m != 'none']
  all_paths = steering_hooks.layer_paths(lm.params)
  pairs = text_corpus.contrastive_pairs(config.direction.pairs,
                                        config.direction.seed)
  candidates = {m: [] for m in steered}
  settings, unsteered = {}, None
  for layer, path in paths.items():
    acts = evaluation.contrastive_activations(
        lm.model, lm.params, path, pairs, config.direction.position,
        lm.tokenizer)
    scorers = functools.cache(functools.partial(
        _scorers, lm, path, data.batches, data.windows, all_paths,
        acts.positive.shape[1]))
    if unsteered is None:
      unsteered = kept(SWEEPS, 'unsteered', lambda: _accuracy(
          scorers()[0], scorers()[2], sel.score))
    center = (selection_gate.contrastive_center(acts.hidden, acts.tokens)
              if sel.gate == 'calibrated' else None)
    for method_name in sel.direction_methods:
      direction = np.asarray(steering_lib.extract_direction(
          acts.positive, acts.negative, method_name))
      gate = (selection_gate.calibrated(acts.hidden, acts.tokens, direction,
                                        center)
              if sel.gate == 'calibrated' else selection_gate.reference(config))
      setting = Setting(direction, acts.coefficient, gate)
      settings[layer, method_name] = setting
      for method in steered:
        candidate = dict(layer=layer, direction_method=method_name)
        candidates[method].append(kept(
            SWEEPS, f'{method}_block{layer}_{method_name}',
            lambda: _sweep(config, *scorers()[:2], method, setting,
                           candidate)))
    del scorers
    release_layer_programs()
  record = _record(config, data, unsteered, candidates)
  return record, settings


def release_layer_programs() -> None:
  """Drops every compiled program once a layer is done.

  A layer's scoring programs take its path as a static argument, so they
  serve no other layer, and JAX keeps every program it compiled: on Gemma
  3 270M each finished layer left 0.6-1 GB in the process (a selection at
  runlocal sizes over blocks 3, 6 and 9 held 5.1, 6.1 and 6.7 GB after
  each; the full one reached 24 GB over four layers and was killed).
  Released, it held 5.1 GB after each. All of them: releasing only the
  scoring programs (each jitted function's `clear_cache`) still left 5.3,
  5.8 and 6.0 GB; the price is that a selection resumed in the same
  process compiles its programs again (12 s of a test).
  """
  jax.clear_caches()


def _sweep(config, mc, held, method: str, setting: Setting,
           candidate: dict[str, Any]) -> dict[str, Any]:
  """One candidate's sweep over `config.alphas` on the validation data.

  A gated method's candidate also records its gate ('gate') and the
  gate's value on the held-out tokens ('delta_hist', `SteerStats`' bins;
  the gate reads the unsteered activations at the layer, so it is the
  same at every alpha) and its trigger rate there ('gate_trigger_rate':
  the share of those tokens with delta > beta, the trigger rate at any
  alpha > 0). A candidate without a calibrated gate is not swept for it.
  """
  out = dict(candidate, kl=[], trigger_rate=[],
             accuracy={t: [] for t in mc})
  gated = method in selection_gate.GATED_METHODS
  if gated:
    out['gate'] = setting.gate.record
    if setting.gate.error:
      logging.info('%s at block %d, %s: no calibrated gate (%s)', method,
                   candidate['layer'], candidate['direction_method'],
                   setting.gate.error)
      return out
  for alpha in config.alphas:
    steer = _operator(config, method, setting, alpha)
    metrics = evaluation.heldout_metrics(held, steer, delta_hist=gated)
    out['kl'].append(metrics['kl'])
    out['trigger_rate'].append(metrics['trigger_rate'])
    if gated and 'delta_hist' not in out:
      out['delta_hist'] = metrics['delta_hist']
    for task, acc in _accuracy(mc, steer, config.selection.score).items():
      out['accuracy'][task].append(acc)
  if gated:
    out['gate_trigger_rate'] = max(out['trigger_rate'])
  logging.info('%s at block %d, %s: KL %s', method, candidate['layer'],
               candidate['direction_method'],
               [round(k, 4) for k in out['kl']])
  return out


def _record(config, data: ValidationData, unsteered: dict[str, float],
            candidates: dict[str, list[dict]]) -> dict[str, Any]:
  """selection.json: what was read, every sweep and its score, the choice."""
  sel = config.selection
  targets = [float(t) for t in sel.targets]
  choice = {m: _choose(config, m, cands, unsteered, targets)
            for m, cands in candidates.items()}
  items = {t: [[[it.context, *it.choices, it.label] for it in s]
               for s in sets] for t, sets in data.items.items()}
  out = dict(split=SELECTION_SPLIT, tasks=list(data.items),
             items_per_set=sel.items_per_set, mc_seeds=list(sel.mc_seeds),
             targets=targets, score=sel.score, gate=sel.gate,
             alphas=[float(a) for a in config.alphas],
             unsteered=unsteered, candidates=candidates, choice=choice,
             items=items)
  if 'pydoc_polarity' in data.items:
    out['pydoc_polarity_pool'] = polarity_sentences.fingerprint()
  return out


def _choose(config, method: str, cands: list[dict],
            unsteered: dict[str, float], targets: list[float]
            ) -> dict[str, Any]:
  """One method's choice among its swept candidates (`selection_rule`;
  a candidate left unswept for want of a calibrated gate scores
  (0, NaN) and is never chosen). Raises ConfigError naming
  `selection.gate` when no candidate was swept."""
  swept = [k for k, c in enumerate(cands) if c['kl']]
  if not swept:
    raise ConfigError('selection.gate', config.selection.gate, f'{method}: '
                      'no candidate has a calibrated gate (the contrastive '
                      'cosines separate the sides at no candidate layer)',
                      selection_gate.GATES)
  scores = [selection_rule.candidate_score(c, unsteered, targets)
            if c['kl'] else selection_rule.Score(0, math.nan) for c in cands]
  for c, s in zip(cands, scores):
    c.update(reached=s.reached, score=s.score)
  k = swept[selection_rule.best([scores[i] for i in swept])]
  out = dict(candidate=k, layer=cands[k]['layer'],
             direction_method=cands[k]['direction_method'],
             reached=scores[k].reached, score=scores[k].score,
             alphas=selection_rule.alpha_grid(
                 [float(a) for a in config.alphas], cands[k]['kl'], targets))
  if method in selection_gate.GATED_METHODS:
    out.update({f: cands[k][f] for f in ('gate', 'gate_trigger_rate',
                                         'delta_hist')})
  logging.info('%s: block %d, %s, alphas %s (validation score %.4f, %d '
               'targets reached)', method, out['layer'],
               out['direction_method'], out['alphas'], scores[k].score,
               scores[k].reached)
  return out


def evaluate_selected(config, subject: evaluation.Subject,
                      record: dict[str, Any], settings: dict,
                      paths: dict[int, str], kept: Kept = Kept(None)
                      ) -> tuple[list[dict], dict]:
  """The test rows of every method at its choice ('none' once, at the
  first steered method's layer), and the test batches. A gated method
  steers with its candidate's gate, the one the selection computed from
  the contrastive set, and its rows add the gate's 'delta_hist' on the
  test held-out tokens. A row `kept` holds is read, not run again."""
  lm = subject.lm
  batches = evaluation.mc_batches(config.tasks, config.mc_seeds, 'test',
                                  lm.tokenizer, lm.model.max_len)
  all_paths = steering_hooks.layer_paths(lm.params)
  choice = record['choice']
  first = next(iter(choice.values()))
  # One layer at a time (its scorers, then its programs released), the
  # rows in the config's order of methods.
  by_layer: dict[int, list[str]] = {}
  for method in config.methods:
    at = first if method == 'none' else choice[method]
    by_layer.setdefault(at['layer'], []).append(method)
  dim = next(iter(settings.values())).direction.shape[0]
  rows_of = {}
  for layer, methods in by_layer.items():
    scorers = functools.cache(functools.partial(
        _scorers, lm, paths[layer], batches, subject.heldout, all_paths, dim))
    for method in methods:
      at = first if method == 'none' else choice[method]
      name = at['direction_method']
      setting = settings[layer, name]
      rows_of[method] = []
      for alpha in ((0.0,) if method == 'none' else at['alphas']):
        key = dict(method=method, alpha=float(alpha), layer=layer,
                   direction_method=name)
        rows_of[method].append(kept(
            ROWS, f'{method}_block{layer}_{name}_alpha{float(alpha)!r}',
            lambda: _test_row(config, subject, setting, key,
                              *scorers()[:2], paths[layer])))
    del scorers
    release_layer_programs()
  return [r for m in config.methods for r in rows_of[m]], batches


def _test_row(config, subject: evaluation.Subject, setting: Setting,
              key: dict[str, Any], mc, held, path: str) -> dict[str, Any]:
  """One test row: `key` (method, alpha, layer, direction method), then
  the accuracies, the held-out metrics and the generations' at it."""
  method = key['method']
  steer = _operator(config, method, setting, key['alpha'])
  row = dict(key)
  row.update(evaluation.mc_metrics(config.tasks, mc, steer))
  row.update(evaluation.heldout_metrics(
      held, steer, delta_hist=method in selection_gate.GATED_METHODS))
  if config.generation.get('enabled', True):
    row.update(evaluation.generation_metrics(
        config.generation, subject, steer, path,
        evaluation.JUDGES[evaluation.lm_kind(config)]))
  return row


def _write(config, workdir: str, subject: evaluation.Subject,
           record: dict[str, Any], settings: dict, paths: dict[int, str],
           rows: list[dict], tasks: list[str]) -> None:
  """A steering vector per steered method (a gated method's with its
  gate, the center in full), gate_<method>.png per gated method, then
  the results."""
  lm = subject.lm
  chosen = {}
  for method, at in record['choice'].items():
    layer, name = at['layer'], at['direction_method']
    setting = settings[layer, name]
    info = dict(method=name, pairs=config.direction.pairs,
                position=config.direction.position,
                coefficient=setting.coefficient)
    chosen[method] = dict(layer=layer, direction_method=name,
                          alphas=at['alphas'],
                          coefficient=setting.coefficient)
    if method in selection_gate.GATED_METHODS:
      gate = setting.gate
      chosen[method]['gate'] = gate.record
      info['gate'] = dict(gate.record, center=None if gate.center is None
                          else [float(v) for v in gate.center])
      plot_gate(workdir, method, at, rows)
    steering_vectors.save(
        os.path.join(workdir, f'steering_vector_{method}.npz'),
        steering_vectors.SteeringVector(
            setting.direction, layer, paths[layer], lm.fingerprint, info,
            lm.tokenizer.fingerprint))
  meta = dict(**subject.meta, selection=chosen,
              mc_seeds=list(config.mc_seeds), tasks=dict(config.tasks),
              config=json.loads(config.to_json()),
              num_layers=len(steering_hooks.layer_paths(lm.params)),
              kappa=config.kappa, beta=config.beta,
              model_fingerprint=lm.fingerprint,
              tokenizer_fingerprint=lm.tokenizer.fingerprint)
  evaluation.write_results(workdir, meta, rows, tasks)


def plot_gate(workdir: str, method: str, at: dict[str, Any],
               rows: list[dict]) -> None:
  """gate_<method>.png: the gate's value on the test held-out tokens at
  the chosen layer (the row of the largest alpha; the gate reads the
  unsteered activations, so every alpha > 0 has the same), with the
  validation held-out tokens' for comparison."""
  row = max((r for r in rows if r['method'] == method),
            key=lambda r: r['alpha'])
  pareto.plot_gate(
      row['delta_hist'], at['gate']['beta'], row['trigger_rate'],
      f'{method}, block {at["layer"]} ({at["direction_method"]}), '
      f'{at["gate"]["kind"]} gate',
      os.path.join(workdir, f'gate_{method}.png'),
      validation=(at['delta_hist'], at['gate_trigger_rate']),
      beta_label=f'{at["gate"]["kind"]} beta')
