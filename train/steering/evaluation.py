"""The steering evaluation: methods x alpha on a language model, offline.

One evaluation for both kinds of LM (`train.lm.interface`): the
in-project decoder trained by `launch.train` (configs/steering.py names
its workdir, `lm_workdir`), and Gemma 3 from a GGUF file (configs/gemma.py
names it, `gguf` and `shape`; empty `gguf`: the registry's 270M). A config
names one of the two (`lm_kind`); the rest of its fields are shared.

For each method and strength alpha, with the direction extracted at one
layer from contrastive pairs (positive vs negative reviews that differ
only in sentiment words; or, in-project, read from `vector_file`):

- multiple choice (`text_corpus.mc_item_sets`: the templates 'copa' and
  'cloze', and 'pydoc_polarity', sentences of Python's documentation):
  accuracy of choosing the positive continuation, scoring each choice by its
  summed and by its mean (length-normalised) log-probability; steering
  covers the last context token through the choice tokens, as in the
  reference's evaluation (`scoring.MCScorer`: the contexts run once into a
  KV cache);
- held-out text steered at every token (`scoring.HeldoutScorer`):
  KL(unsteered || steered) per token, the steered cross-entropy, the
  ratio of activation norms steered / unsteered at the steered layer, the
  next one and the last, and the gate's trigger rate. In-project: the
  test split of each source of the LM's own mixture, in columns per source
  (`<source>_kl`, ...; `kl` and `trigger_rate` their means); Gemma:
  `lm_data.heldout_windows` (Python's documentation and template reviews,
  which the direction never saw), one set;
- generations after neutral prompts (KV-cached, sampled with one fixed
  key for all methods; `generations`): the positive share of the texts,
  judged by the template grammar's lexicon (in-project: what those LMs
  write) or by VADER (Gemma: free English), distinct-1/2, the 3-gram
  repetition rate, and the unsteered model's cross-entropy of the
  generated tokens (`gen_ce`). Gemma's `generation.enabled=False` skips
  them (the study's layer sweep).

Methods: 'none', 'addition' (x + alpha c mu, c = mean activation norm at
the layer), 'addition_renorm' (the same, rescaled to |x|),
'addition_gate' (addition by the vMF gate's fraction: the fourth cell of
the gate x geometry ablation), 'spherical' (rotation by alpha, no gate)
and 'spherical_gate' (the vMF gate with kappa and beta).

A config with a `selection` block runs through `train.steering.selection`
instead: the layer, direction method and alphas of each method chosen on
validation items, then this machinery on the test items.

Item sets: `mc_seeds` draws one item set per seed for each task; rows
hold the accuracy over all of them and each item's correctness per set
(`{task}_correct_sum` / `_correct_mean`: one 0/1 list per set), what
the steering studies' bootstrap resamples.
"""

from collections.abc import Callable
import functools
import json
import os
from typing import Any, NamedTuple

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import ml_collections
import numpy as np

from geom import steering as steering_lib
from train.training import aot
from train.training import experiment as experiment_lib
from train.run import metrics as metrics_lib
from train.analysis import stats
from train.run.job import open_job
from train.errors import ConfigError
from train.lm import corpus as text_corpus
from train.lm import data as lm_data
from train.lm import gemma
from train.lm import gemma_gguf
from train.lm import generate as lm_generate
from train.lm import hooks as steering_hooks
from train.lm import interface
from train.lm import models as lm_models
from train.lm import tokenizer as lm_tokenizer
from train.lm import trainer as lm_trainer
from train.steering import generations
from train.steering import pareto
from train.steering import scoring
from train.steering import vectors as steering_vectors

METHODS = ('none', 'addition', 'addition_renorm', 'addition_gate',
           'spherical', 'spherical_gate')


def make_steering(method: str, direction, alpha: float, *, kappa: float,
                  beta: float, coefficient: float,
                  center=None) -> steering_lib.Steering:
  """The operator of one table method; `center` (None: uncentred, the
  reference's arithmetic) goes to `Steering(center=)` of a steered one."""
  if method not in METHODS:
    raise ValueError(f'method={method!r}: unknown; valid choices: '
                     f'{", ".join(METHODS)}')
  if method == 'none':
    return steering_lib.Steering('none', direction, alpha=0.0)
  if method.startswith('addition'):
    return steering_lib.Steering('addition', direction, alpha=alpha,
                                 coefficient=coefficient, kappa=kappa,
                                 beta=beta, gate=method == 'addition_gate',
                                 renormalize=method == 'addition_renorm',
                                 center=center)
  return steering_lib.Steering('spherical', direction, alpha=alpha,
                               kappa=kappa, beta=beta,
                               gate=method == 'spherical_gate', center=center)


KINDS = ('decoder', 'gemma')


def lm_kind(config: ml_collections.ConfigDict) -> str:
  """'gemma' for a config that names a GGUF file (configs/gemma.py), else
  'decoder' (configs/steering.py: a trained LM's workdir)."""
  return 'gemma' if 'gguf' in config else 'decoder'


# How the generations' sentiment is judged, by the LM's kind (see the
# module docstring).
JUDGES = {'decoder': 'lexicon', 'gemma': 'vader'}


def _right_pad(seqs: list[np.ndarray], length: int) -> tuple[np.ndarray,
                                                              np.ndarray]:
  tokens = np.zeros((len(seqs), length), np.int32)
  valid = np.zeros((len(seqs), length), bool)
  for i, s in enumerate(seqs):
    if len(s) > length:
      raise ValueError(f'a sequence of {len(s)} bytes exceeds {length}')
    tokens[i, :len(s)] = s
    valid[i, :len(s)] = True
  return tokens, valid


@functools.partial(jax.jit, static_argnames=('model', 'layer_path'))
def _capture(model, params, tokens, valid, layer_path):
  _, _, rec = interface.apply(model, params, tokens, valid,
                              capture=(layer_path,))
  return rec.hidden[layer_path]


POSITIONS = ('last', 'mean')


def extract(model: interface.LanguageModel, params, layer_path: str,
            pairs: list[tuple[str, str]], method: str = 'mean_diff',
            position: str = 'last',
            tokenizer: lm_tokenizer.Tokenizer | None = None
            ) -> tuple[np.ndarray, float]:
  """The unit direction from activations after `layer_path`, and their mean
  norm (the addition coefficient).

  `position`: 'last' takes each text's last token (the reference's choice);
  'mean' averages over its tokens after BOS.
  """
  pos, neg, coefficient = pair_activations(model, params, layer_path, pairs,
                                           position, tokenizer)
  direction = steering_lib.extract_direction(pos, neg, method)
  return np.asarray(direction), coefficient


def pair_activations(model: interface.LanguageModel, params, layer_path: str,
                     pairs: list[tuple[str, str]], position: str = 'last',
                     tokenizer: lm_tokenizer.Tokenizer | None = None
                     ) -> tuple[np.ndarray, np.ndarray, float]:
  """`extract`'s activations (positive, negative: (pairs, dim), one row per
  text at `position`) and the coefficient, for any direction method."""
  acts = contrastive_activations(model, params, layer_path, pairs, position,
                                 tokenizer)
  return acts.positive, acts.negative, acts.coefficient


class PairActivations(NamedTuple):
  """The contrastive pairs' activations after one layer.

  Attributes:
    positive, negative: (pairs, dim), one row per text at the position
      (`pair_activations`' rows).
    coefficient: the mean activation norm over every valid token, BOS
      included (the addition coefficient).
    hidden: each side's (pairs, length, dim) layer outputs, right-padded
      to one length for both sides.
    tokens: each side's (pairs, length) bool: the text's tokens after BOS
      (padding and BOS unset), the tokens a gate is calibrated on.
  """
  positive: np.ndarray
  negative: np.ndarray
  coefficient: float
  hidden: tuple[np.ndarray, np.ndarray]
  tokens: tuple[np.ndarray, np.ndarray]


def contrastive_activations(model: interface.LanguageModel, params,
                            layer_path: str, pairs: list[tuple[str, str]],
                            position: str = 'last',
                            tokenizer: lm_tokenizer.Tokenizer | None = None
                            ) -> PairActivations:
  """`pair_activations` with every token's activation kept (one pass)."""
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  pos, neg = ([lm_tokenizer.encode_document(tokenizer, p[i]) for p in pairs]
              for i in (0, 1))
  length = max(len(s) for s in pos + neg)
  acts, norms, hiddens, texts = [], [], [], []
  for seqs in (pos, neg):
    tokens, valid = _right_pad(seqs, length)
    hidden = np.asarray(_capture(model, params, tokens, valid, layer_path))
    text = valid.copy()
    text[:, 0] = False  # The BOS state is the same for every text.
    if position == 'last':
      picked = hidden[np.arange(len(seqs)), valid.sum(1) - 1]
    else:
      picked = (hidden * text[..., None]).sum(1) / text.sum(1, keepdims=True)
    acts.append(picked)
    norms.append(np.linalg.norm(hidden, axis=-1)[valid])
    hiddens.append(hidden)
    texts.append(text)
  return PairActivations(acts[0], acts[1], float(np.concatenate(norms).mean()),
                         tuple(hiddens), tuple(texts))


# Items per task and item set: one batch holds every set of a task.
MAX_ITEMS = 10_000
# Gemma's bounds: held-out windows, generated tokens.
GEMMA_MAX_WINDOWS = 4096
GEMMA_MAX_STEPS = 256


def check_config(config, require_lm: bool = True) -> None:
  """ConfigError naming the field, before anything is loaded or run;
  `require_lm=False` lets an in-project LM's workdir be unset (compiling
  needs its config only)."""
  if lm_kind(config) == 'decoder' and require_lm and not config.get(
      'lm_workdir'):
    raise ConfigError('lm_workdir', config.get('lm_workdir'),
                      'is required: the workdir of a trained LM '
                      '(python -m launch.train --config=configs/lm.py)')
  bad = [m for m in config.methods if m not in METHODS]
  if bad or not config.methods:
    raise ConfigError('methods', tuple(config.methods),
                      f'unknown method {bad[0]!r}' if bad else 'is empty',
                      METHODS)
  for a in config.alphas:
    if not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
      raise ConfigError('alphas', tuple(config.alphas),
                        f'alpha={a!r} is outside [0, 1]')
  if not config.kappa >= 0:
    raise ConfigError('kappa', config.kappa, 'must be >= 0')
  if not -1.0 <= config.beta < 1.0:
    raise ConfigError('beta', config.beta, 'must be in [-1, 1)')
  if config.direction.method not in steering_lib.DIRECTION_METHODS:
    raise ConfigError('direction.method', config.direction.method,
                      'unknown direction method',
                      steering_lib.DIRECTION_METHODS)
  if config.direction.position not in POSITIONS:
    raise ConfigError('direction.position', config.direction.position,
                      'unknown position', POSITIONS)
  seeds = tuple(config.mc_seeds)
  if (not seeds or not all(isinstance(s, int) for s in seeds)
      or len(set(seeds)) != len(seeds)):
    raise ConfigError('mc_seeds', seeds, 'must be distinct integers, one '
                      'item set per seed (at least one)')
  for task, n in config.tasks.items():
    if task not in text_corpus.MC_TASKS:
      raise ConfigError('tasks', task, 'unknown multiple-choice task',
                        text_corpus.MC_TASKS)
    if not isinstance(n, int) or not 0 < n <= MAX_ITEMS:
      raise ConfigError(f'tasks.{task}', n, f'must be an integer in '
                        f'[1, {MAX_ITEMS}] (items per item set)')
    check_capacity(f'tasks.{task}', task, n, 'test', len(seeds))
  if config.generation.mode not in lm_generate.MODES:
    raise ConfigError('generation.mode', config.generation.mode,
                      'unknown generation mode', lm_generate.MODES)
  for field in ('heldout_windows', 'direction.pairs', 'generation.prompts',
                'generation.steps'):
    value = config[field.split('.')[0]] if '.' not in field else (
        config[field.split('.')[0]][field.split('.')[1]])
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(field, value, 'must be a positive integer')
    if field in ('direction.pairs', 'generation.prompts') and (
        value > MAX_ITEMS):
      raise ConfigError(field, value, f'must be at most {MAX_ITEMS}')
  if lm_kind(config) == 'gemma':
    _check_gemma(config)


def check_capacity(field: str, task: str, n: int, split: str,
                   sets: int) -> None:
  """ConfigError naming `field` when `sets` disjoint sets of `n` items of
  `task` do not fit in `split` (the real-text task's pool is finite)."""
  capacity = text_corpus.mc_capacity(task, split, sets)
  if capacity is not None and n > capacity:
    raise ConfigError(field, n, f'{sets} {split} item set(s) of {task} hold '
                      f'at most {capacity} items each')


def _check_gemma(config) -> None:
  """The fields of a Gemma evaluation (configs/gemma.py)."""
  if 'lm_workdir' in config:
    raise ConfigError('lm_workdir', config.lm_workdir, 'a config names '
                      'one LM: a trained LM\'s workdir or a Gemma file '
                      '(gguf), not both')
  if config.dtype not in gemma.DTYPES:
    raise ConfigError('dtype', config.dtype, 'not a parameter dtype',
                      gemma.DTYPES)
  if config.shape not in (*gemma.SHAPES, lm_models.FILE_SHAPE):
    raise ConfigError('shape', config.shape, 'not a Gemma 3 shape',
                      (*gemma.SHAPES, lm_models.FILE_SHAPE))
  if config.gguf and not os.path.isfile(config.gguf):
    raise ConfigError('gguf', config.gguf, 'no such file (empty: the '
                      'registry package\'s Gemma 3 270M)')
  if config.shape == lm_models.FILE_SHAPE and not config.gguf:
    raise ConfigError('shape', config.shape,
                      "the file's own shape needs --config.gguf")
  shape = lm_models.shape_named(config.shape, config.gguf)
  for layer in (config.layer, *config.get('sweep_layers', ())):
    if not isinstance(layer, int) or not 0 <= layer < shape.num_layers:
      raise ConfigError('layer' if layer == config.layer else 'sweep_layers',
                        layer, f'Gemma 3 {config.shape} has blocks 0..'
                        f'{shape.num_layers - 1}')
  if not isinstance(config.window_len, int) or not 8 <= config.window_len <= 512:
    raise ConfigError('window_len', config.window_len,
                      'must be an integer in [8, 512] (tokens per held-out '
                      'window)')
  if config.heldout_windows > GEMMA_MAX_WINDOWS:
    raise ConfigError('heldout_windows', config.heldout_windows,
                      f'must be at most {GEMMA_MAX_WINDOWS}')
  gen = config.generation
  if gen.prompts > len(generations.PROMPTS):
    raise ConfigError('generation.prompts', gen.prompts,
                      f'there are {len(generations.PROMPTS)} prompts')
  if gen.steps > GEMMA_MAX_STEPS:
    raise ConfigError('generation.steps', gen.steps,
                      f'must be at most {GEMMA_MAX_STEPS}')


class Subject(NamedTuple):
  """The LM an evaluation steers, and what its kind measures it on.

  Attributes:
    lm: the model, parameters, tokenizer and fingerprint.
    meta: where it came from (results.json's first `meta` fields).
    heldout: held-out windows (N, len + 1) by source name; one set named
      None gives unprefixed columns.
    prompts: the generations' prompts (tokens, valid), left-padded.
    windows: held-out windows of another split, as `heldout` is of
      'test' (`train.steering.selection` reads 'validation').
  """
  lm: interface.Loaded
  meta: dict[str, Any]
  heldout: dict[str | None, np.ndarray]
  prompts: tuple[np.ndarray, np.ndarray]
  windows: Callable[[str], dict[str | None, np.ndarray]]


def load_subject(config) -> Subject:
  """The LM the config names, loaded (its kind's held-out text and
  prompts with it)."""
  return (_gemma if lm_kind(config) == 'gemma' else _trained_lm)(config)


def _trained_lm(config) -> Subject:
  lm = lm_trainer.load_trained(config.lm_workdir)
  params = jax.device_get(lm.params)
  windows = lambda split: {s: lm_data.load_windows(
      lm.config.data, split, lm.config.seed, only=s,
      tokenizer=lm.tokenizer).tokens[:config.heldout_windows]
                           for s in lm_data.source_names(lm.config.data)}
  return Subject(
      interface.Loaded(lm.model, params, lm.tokenizer,
                       steering_vectors.fingerprint(params)),
      dict(lm_workdir=os.path.abspath(config.lm_workdir)), windows('test'),
      generations.template_prompts(config.generation.prompts, lm.tokenizer),
      windows)


def _gemma(config) -> Subject:
  if config.shape not in ('270m', lm_models.FILE_SHAPE) and not config.gguf:
    raise ConfigError('shape', config.shape, 'only Gemma 3 270M ships in the '
                      'registry; give --config.gguf for another shape '
                      '(or compile it: python -m launch.compile)')
  path = config.gguf or gemma_gguf.registry_file()
  loaded = gemma_gguf.load(path, config.dtype)
  if not gemma.same_dims(loaded.shape,
                         lm_models.shape_named(config.shape, config.gguf)):
    raise ConfigError('shape', config.shape, f'{path} holds another shape')
  model = gemma.Gemma3(loaded.shape, max_len=1024, dtype=config.dtype)
  tokenizer = loaded.tokenizer
  windows = lambda split: {None: lm_data.heldout_windows(
      tokenizer, config.heldout_windows, config.window_len, split)}
  return Subject(
      interface.Loaded(model, loaded.params, tokenizer,
                       'gguf-sha256:' + loaded.sha256),
      dict(model='gemma-3-270m', gguf=os.path.abspath(path),
           gguf_sha256=loaded.sha256),
      windows('test'),
      generations.open_prompts(config.generation.prompts, tokenizer), windows)


def _direction(config, lm: interface.Loaded, layer_path: str
               ) -> steering_vectors.SteeringVector:
  """The config's vector file (checked against the tokenizer, then the
  model), or a direction extracted from contrastive pairs at `layer_path`."""
  tokenizer, params = lm.tokenizer, lm.params
  if config.get('vector_file'):
    try:
      vec = steering_vectors.load(config.vector_file)
    except (OSError, ValueError) as e:
      raise ConfigError('vector_file', config.vector_file,
                        str(e).splitlines()[0]) from None
    # Files from before tokenizers were recorded came from byte-level LMs.
    lm_tokenizer.check_fingerprint(
        tokenizer, vec.tokenizer_fingerprint or lm_tokenizer.BYTE_FINGERPRINT,
        f'the steering vector {config.vector_file}')
    try:
      steering_vectors.check_matches(vec, params, config.vector_file)
    except ValueError as e:
      raise ConfigError('vector_file', config.vector_file, str(e)) from None
    if vec.layer_path != layer_path:
      raise ConfigError('layer', config.layer,
                        f'the vector file was extracted at {vec.layer_path!r}')
    return vec
  pairs = text_corpus.contrastive_pairs(config.direction.pairs,
                                        config.direction.seed)
  direction, coefficient = extract(lm.model, params, layer_path, pairs,
                                   config.direction.method,
                                   config.direction.position, tokenizer)
  return steering_vectors.SteeringVector(
      direction, config.layer, layer_path, lm.fingerprint,
      dict(method=config.direction.method, pairs=config.direction.pairs,
           position=config.direction.position, coefficient=coefficient),
      tokenizer.fingerprint)


def evaluate(config, workdir: str) -> list[dict[str, Any]]:
  """Runs the method x alpha grid; writes results.json, results.md,
  steering_vector.npz and (with generations) pareto.png into `workdir`;
  returns the rows.

  Raises:
    UsageError: a setting is invalid, or does not fit the LM; nothing is
      written then.
    WorkdirBusy: another run holds the workdir.
  """
  if 'selection' in config:  # Before its fields are checked: not ours.
    raise ConfigError('selection', 'set', 'a config with a selection runs '
                      'through train.steering.selection.evaluate (as '
                      'launch.steer_eval does)')
  check_config(config)
  workdir = experiment_lib.check_workdir(workdir)
  with open_job(workdir):
    return _evaluate(config, workdir)


def _evaluate(config, workdir: str) -> list[dict[str, Any]]:
  kind = lm_kind(config)
  subject = load_subject(config)
  model, params = subject.lm.model, subject.lm.params
  layer_path = _layer_path(config, params)
  paths = steering_hooks.layer_paths(params)
  mc = mc_batches(config.tasks, config.mc_seeds, 'test', subject.lm.tokenizer,
                  model.max_len)
  check_generation_fits(config.generation, subject.prompts, model.max_len)

  vec = _direction(config, subject.lm, layer_path)
  steering_vectors.save(os.path.join(workdir, 'steering_vector.npz'), vec)
  coefficient = float(vec.info['coefficient'])
  steer_at = lambda method, alpha: make_steering(
      method, vec.direction, float(alpha), kappa=config.kappa,
      beta=config.beta, coefficient=coefficient)
  scorers = {t: scoring.MCScorer(model, params, batch, layer_path)
             for t, batch in mc.items()}
  heldout = {s: scoring.HeldoutScorer(model, params, windows, layer_path,
                                      paths, steer_at('none', 0.0))
             for s, windows in subject.heldout.items()}

  rows = []
  for method in config.methods:
    for alpha in ((0.0,) if method == 'none' else tuple(config.alphas)):
      steer = steer_at(method, alpha)
      row = {'method': method, 'alpha': float(alpha)}
      row.update(mc_metrics(config.tasks, scorers, steer))
      row.update(heldout_metrics(heldout, steer))
      if config.generation.get('enabled', True):
        row.update(generation_metrics(config.generation, subject, steer,
                                      layer_path, JUDGES[kind]))
      logging.info('%s alpha=%.2f: %s', method, alpha, {
          k: round(v, 4) for k, v in row.items()
          if isinstance(v, float) and k != 'alpha'})
      rows.append(row)

  meta = dict(**subject.meta, layer=config.layer, layer_path=layer_path,
              mc_seeds=list(config.mc_seeds), tasks=dict(config.tasks),
              config=json.loads(config.to_json()),
              num_layers=len(paths), coefficient=coefficient,
              kappa=config.kappa, beta=config.beta,
              model_fingerprint=vec.model_fingerprint,
              tokenizer_fingerprint=subject.lm.tokenizer.fingerprint)
  write_results(workdir, meta, rows, list(mc))
  return rows


def _layer_path(config, params) -> str:
  """The parameter path of the config's `layer`."""
  try:
    return steering_hooks.resolve_layer(params, config.layer)
  except ValueError as e:
    raise ConfigError('layer', config.layer, str(e).split(': ', 1)[1]) from None


def mc_batches(tasks, seeds, split: str, tokenizer, max_len: int,
               field: str = 'tasks') -> dict[str, scoring.MCBatch]:
  """Each multiple-choice task's item sets of `split` (`tasks[task]` items
  per seed; `text_corpus.mc_item_sets`), encoded; every set of a task in
  one batch (correctness is split per set). ConfigError naming `field`
  when an item is longer than the LM's max_len."""
  mc = {t: scoring.encode_mc(
      [it for items in text_corpus.mc_item_sets(t, n, tuple(seeds), split)
       for it in items], tokenizer) for t, n in tasks.items()}
  length = max(b.longest for b in mc.values())
  if length > max_len:
    raise ConfigError(field, dict(tasks),
                      f'items of {length} tokens exceed the LM\'s max_len')
  return mc


def check_generation_fits(gen_config, prompts: tuple[np.ndarray, np.ndarray],
                           max_len: int) -> None:
  if prompts[0].shape[1] + gen_config.steps > max_len:
    raise ConfigError('generation.steps', gen_config.steps,
                      f'prompts of {prompts[0].shape[1]} tokens and this '
                      f'many steps exceed the LM\'s max_len={max_len}')


def mc_metrics(tasks, scorers: dict[str, scoring.MCScorer], steer
                ) -> dict[str, Any]:
  """Each task's accuracies; its per-item correctness as one list per
  item set (`tasks[task]` items each)."""
  row = {}
  for task, scorer in scorers.items():
    n = tasks[task]
    for k, v in scorer.accuracy(steer).items():
      if k.startswith('correct_'):
        v = [v[i:i + n] for i in range(0, len(v), n)]
      row[f'{task}_{k}'] = v
  return row


def heldout_metrics(heldout: dict[str | None, scoring.HeldoutScorer], steer,
                    delta_hist: bool = False) -> dict[str, Any]:
  """One unnamed set's metrics as they are; several sources' in columns
  per source, with the mean KL and trigger rate over them (and, with
  `delta_hist`, the gate's histogram summed over them)."""
  if list(heldout) == [None]:
    return heldout[None].metrics(steer, delta_hist)
  row, kls, trig, hists = {}, [], [], []
  for source, scorer in heldout.items():
    out = scorer.metrics(steer, delta_hist)
    row.update({f'{source}_{k}': v for k, v in out.items()})
    kls.append(out['kl'])
    trig.append(out['trigger_rate'])
    hists.append(out.get('delta_hist'))
  row['kl'] = float(np.mean(kls))
  row['trigger_rate'] = float(np.mean(trig))
  if delta_hist:
    row['delta_hist'] = [int(sum(v)) for v in zip(*hists)]
  return row


def generation_metrics(gen_config, subject: Subject, steer, layer_path: str,
                        judge: str) -> dict[str, Any]:
  """The generations' metrics, with the texts under 'samples'."""
  gen = generations.generation_metrics(
      subject.lm.model, subject.lm.params, subject.prompts, steer, layer_path,
      gen_config.steps, gen_config.temperature, gen_config.seed,
      gen_config.mode, subject.lm.tokenizer, judge)
  return {'samples': gen.pop('samples'), **gen}


def write_results(workdir: str, meta: dict[str, Any],
                   rows: list[dict[str, Any]], tasks: list[str]) -> None:
  """results.json, results.md and (with generations) pareto.png."""
  metrics_lib.write_json_atomic(os.path.join(workdir, 'results.json'),
                                {'meta': meta, 'rows': rows})
  metrics_lib.write_text_atomic(os.path.join(workdir, 'results.md'),
                                markdown_table(rows, tasks))
  if 'positive_share' in rows[0]:
    pareto.plot_pareto(rows, tasks, os.path.join(workdir, 'pareto.png'))


def markdown_table(rows: list[dict[str, Any]], tasks: list[str]) -> str:
  """One line per (method, alpha): accuracies, KL, CE, norms, triggers, text.

  An in-project evaluation's rows have a CE column per held-out source
  (each has a `<source>_kl`) and the norm ratios of the first source at,
  after and at the end; Gemma's one held-out CE and the ratios at and at
  the end. The generations' columns come last, with VADER's where it
  judged them."""
  sources = sorted(k.removesuffix('_kl') for k in rows[0]
                   if k.endswith('_kl'))
  f3, f4 = '{:.3f}'.format, '{:.4f}'.format
  if sources:
    held = [(f'{s} CE', f'{s}_ce', f4) for s in sources]
    ratios = [f'{sources[0]}_norm_ratio_{w}' for w in ('at', 'next', 'last')]
    ratio_head = 'norm ratio (at / next / last)'
  else:
    held = [('held-out CE', 'ce', f4)]
    ratios = ['norm_ratio_at', 'norm_ratio_last']
    ratio_head = 'norm ratio (at / last)'
  if 'vader_compound' in rows[0]:
    gen = [('VADER positive', 'positive_share'),
           ('VADER compound', 'vader_compound'), ('distinct-2', 'distinct_2'),
           ('rep-3', 'repetition_3'), ('generations CE (unsteered)', 'gen_ce')]
  elif 'positive_share' in rows[0]:
    gen = [('positive share', 'positive_share'), ('distinct-2', 'distinct_2'),
           ('rep-3', 'repetition_3'),
           ('generations CE (unsteered model)', 'gen_ce')]
  else:
    gen = []
  head = (['method', 'alpha'] + [f'{t} acc (sum / mean)' for t in tasks]
          + ['KL', *(h for h, _, _ in held), ratio_head, 'trigger rate']
          + [h for h, _ in gen])
  table = []
  for r in rows:
    cells = [r['method'], f'{r["alpha"]:.2f}']
    cells += [f'{r[f"{t}_acc_sum"]:.3f} / {r[f"{t}_acc_mean"]:.3f}'
              for t in tasks]
    cells += [f4(r['kl']), *(f(r[k]) for _, k, f in held)]
    cells += [' / '.join(f3(r[k]) for k in ratios), f3(r['trigger_rate'])]
    cells += [f3(r[k]) for _, k in gen]
    table.append(cells)
  return stats.markdown_table(head, table, '-' * len(head)) + '\n'


# Prompt length Gemma's compile-only programs assume: `PROMPTS` are 5 to
# 10 Gemma tokens with BOS, and other shapes have no tokenizer here to
# count.
COMPILE_PROMPT_LEN = 16


def programs(config: ml_collections.ConfigDict,
             lm_config: ml_collections.ConfigDict | None, devices: list
             ) -> tuple[Mesh, Any, list[aot.Program]]:
  """For `launch.compile`: the generation of each of `config.methods` as
  the evaluation compiles it (steered at `config.layer`, KV-cached or
  recomputed per `config.generation.mode`), on shapes only and one of
  `devices` (the evaluation runs on one device); for Gemma also the
  held-out scoring pass (the in-project LM's held-out windows are its
  training windows, whose forward pass its training job compiles). The
  in-project LM is the one `lm_config` describes, with prompts as long as
  the byte tokenizer makes them; Gemma's is `config.shape` in
  `config.dtype` (`lm_config` unused). Returns the mesh, no rules, and the
  programs."""
  check_config(config, require_lm=False)
  gen = config.generation
  if lm_kind(config) == 'gemma':
    model = gemma.Gemma3(lm_models.shape_named(config.shape, config.gguf),
                         max_len=COMPILE_PROMPT_LEN + gen.steps,
                         dtype=config.dtype)
    dtype = jnp.dtype(config.dtype)
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype),
        nn.meta.unbox(jax.eval_shape(
            lambda k: model.init(k, jnp.zeros((1, 4), jnp.int32)),
            jax.random.key(0)))['params'])
    prompt_len = COMPILE_PROMPT_LEN
  else:
    model = lm_trainer.create_model(lm_config)
    params = nn.meta.unbox(lm_trainer.abstract_variables(model))['params']
    prompt_len = generations.template_prompts(gen.prompts)[0].shape[1]
    if prompt_len + gen.steps > model.max_len:
      raise ConfigError('generation.steps', gen.steps,
                        f'prompts of {prompt_len} tokens and this many '
                        f'steps exceed the LM\'s max_len={model.max_len}')
  try:
    layer_path = steering_hooks.resolve_layer(params, config.layer)
  except ValueError as e:
    raise ConfigError('layer', config.layer, str(e).split(': ', 1)[1]) from None
  mesh = Mesh(np.array(devices[:1]), ('data',))
  repl = NamedSharding(mesh, PartitionSpec())
  place = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=repl), tree)
  direction = jax.ShapeDtypeStruct((model.d_model,), np.float32)
  steering = lambda method: jax.eval_shape(lambda d: make_steering(
      method, d, 0.5, kappa=config.kappa, beta=config.beta, coefficient=1.0),
                                           direction)
  prompt = jax.ShapeDtypeStruct((gen.prompts, prompt_len), np.int32)
  prompt_valid = jax.ShapeDtypeStruct(prompt.shape, np.bool_)
  out = []
  for method in config.methods:
    fn = jax.jit(lambda p, tokens, valid, s, rng: lm_generate.generate(
        model, p, tokens, valid, gen.steps, steering=s,
        layer_path=layer_path, mode=gen.mode, temperature=gen.temperature,
        rng=rng))
    out.append(aot.Program(
        f'generate ({method}, {gen.mode}, {gen.steps} tokens)', fn,
        place((params, prompt, prompt_valid, steering(method),
               jax.eval_shape(lambda: jax.random.key(0))))))
  if lm_kind(config) == 'gemma':
    windows = jax.ShapeDtypeStruct(
        (max(1, scoring.CHUNK_TOKENS // config.window_len),
         config.window_len), np.int32)
    fn = jax.jit(lambda p, tokens, s: scoring.window_logprobs(
        model, p, tokens, s, layer_path, (layer_path,))[0])
    out.append(aot.Program(
        f'held-out log-probs ({config.methods[-1]}, {windows.shape[0]} x '
        f'{windows.shape[1]} tokens)', fn,
        place((params, windows, steering(config.methods[-1])))))
  return mesh, None, out
