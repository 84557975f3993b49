"""Offline evaluation of steering methods on the in-project LM.

For each method and strength alpha, with the direction extracted at one
layer from contrastive pairs (positive vs negative reviews that differ
only in sentiment words):

- multiple choice (`text_corpus.mc_task`: 'copa' and 'cloze'): accuracy
  of choosing the positive continuation, scoring each choice by its
  summed and by its mean (length-normalised) log-probability; steering
  covers the last context token through the choice tokens, as in the
  reference's evaluation;
- held-out text of each source of the LM's mixture, steered at every
  token: KL(unsteered || steered) per token, the steered cross-entropy,
  the ratio of activation norms steered / unsteered at the steered layer,
  the next one and the last, and the gate's trigger rate;
- generations after neutral prompts (KV-cached, sampled with one fixed
  key for all methods): the share of sentiment words that are positive
  (the lexicons are the template grammar's words that occur only on one
  side), distinct-1/2, the 3-gram repetition rate, and the cross-entropy
  of the generated tokens under the unsteered model (`gen_ce`, nats per
  token: how far the text strays from what the model itself writes).

Methods: 'none', 'addition' (x + alpha c mu, c = mean activation norm at
the layer), 'addition_renorm' (the same, rescaled to |x|),
'addition_gate' (addition by the vMF gate's fraction: the fourth cell of
the gate x geometry ablation), 'spherical' (rotation by alpha, no gate)
and 'spherical_gate' (the vMF gate with kappa and beta).

Item sets: `mc_seeds` draws one item set per seed for each task; rows
hold the accuracy over all of them and each item's correctness per set
(`{task}_correct_sum` / `_correct_mean`: one 0/1 list per set), what
the steering study's bootstrap resamples.
"""

import functools
import json
import os
import re
from typing import Any, NamedTuple

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import ml_collections
import numpy as np

from geom import steering as steering_lib
from train import aot
from train import experiment as experiment_lib
from train import metrics as metrics_lib
from train import stats
from train import workdir_lock
from train.errors import ConfigError
from train.lm import corpus as text_corpus
from train.lm import data as lm_data
from train.lm import decoder as decoder_lm
from train.lm import generate as lm_generate
from train.lm import tokenizer as lm_tokenizer
from train.lm import trainer as lm_trainer
from train.lm import hooks as steering_hooks
from train.steering import pareto
from train.steering import vectors as steering_vectors

METHODS = ('none', 'addition', 'addition_renorm', 'addition_gate',
           'spherical', 'spherical_gate')


def make_steering(method: str, direction, alpha: float, *, kappa: float,
                  beta: float, coefficient: float) -> steering_lib.Steering:
  """The operator of one table method."""
  if method not in METHODS:
    raise ValueError(f'method={method!r}: unknown; valid choices: '
                     f'{", ".join(METHODS)}')
  if method == 'none':
    return steering_lib.Steering('none', direction, alpha=0.0)
  if method.startswith('addition'):
    return steering_lib.Steering('addition', direction, alpha=alpha,
                                 coefficient=coefficient, kappa=kappa,
                                 beta=beta, gate=method == 'addition_gate',
                                 renormalize=method == 'addition_renorm')
  return steering_lib.Steering('spherical', direction, alpha=alpha,
                               kappa=kappa, beta=beta,
                               gate=method == 'spherical_gate')


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


class MCBatch(NamedTuple):
  """All choices of a task as rows (item-major, choice-minor)."""
  tokens: np.ndarray       # (items * 2, L)
  valid: np.ndarray        # (items * 2, L)
  score_mask: np.ndarray   # (items * 2, L): positions whose NEXT byte is a
                           # choice byte (the logits that score the choice).
  steer_mask: np.ndarray   # (items * 2, L): last context byte .. choice end.
  labels: np.ndarray       # (items,) index of the positive choice.


def encode_mc(items: list[text_corpus.MCItem], length: int | None = None,
              tokenizer: lm_tokenizer.Tokenizer | None = None) -> MCBatch:
  """Every choice after its item's context, right-padded to `length`
  (default: the longest). The context is the tokens that lie wholly in
  `prefix()`, a token that straddles the boundary (a subword holding the
  separator's space) is scored with the choice (`lm_tokenizer.split`);
  for bytes that is exactly BOS + prefix bytes, then the choice's."""
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  parts = [lm_tokenizer.split(tokenizer, item.prefix(), choice)
           for item in items for choice in item.choices]
  if length is None:
    length = max(len(c) + len(a) for c, a in parts)
  seqs, score, steer = [], [], []
  for ctx, ans in parts:
    seqs.append(np.concatenate([ctx, ans]))
    m = np.zeros(length, bool)
    m[len(ctx) - 1:len(ctx) - 1 + len(ans)] = True
    score.append(m)
    s = np.zeros(length, bool)
    s[len(ctx) - 1:len(ctx) + len(ans)] = True
    steer.append(s)
  tokens, valid = _right_pad(seqs, length)
  return MCBatch(tokens, valid, np.stack(score), np.stack(steer),
                 np.array([it.label for it in items], np.int32))


@functools.partial(jax.jit, static_argnames=('model', 'layer_path', 'watch'))
def _steered_logprobs(model, params, tokens, valid, steer_mask, steering,
                      layer_path, watch=()):
  logits, rec = lm_generate.score(model, params, tokens, valid, steering,
                                  layer_path, steer_mask, watch)
  return jax.nn.log_softmax(logits), rec.stats, rec.norms


def mc_logprobs(model, params, batch: MCBatch, steering, layer_path: str,
                chunk: int = 128) -> tuple[np.ndarray, np.ndarray,
                                           steering_lib.SteerStats]:
  """Summed and mean log-probabilities of each choice, (items, 2) each, and
  the steering statistics."""
  sums, counts, stats = [], [], []
  n = len(batch.tokens)
  for i in range(0, n, chunk):
    sl = slice(i, min(i + chunk, n))
    logp, st, _ = _steered_logprobs(
        model, params, batch.tokens[sl], batch.valid[sl],
        batch.steer_mask[sl], steering, layer_path)
    nxt = np.roll(batch.tokens[sl], -1, axis=1)
    lp = np.take_along_axis(np.asarray(logp), nxt[..., None], -1)[..., 0]
    sums.append((lp * batch.score_mask[sl]).sum(1))
    counts.append(batch.score_mask[sl].sum(1))
    stats.append(jax.device_get(st))
  total = np.concatenate(sums).reshape(-1, 2)
  mean = total / np.concatenate(counts).reshape(-1, 2)
  return total, mean, jax.tree.map(lambda *x: sum(x), *stats)


def mc_accuracy(model, params, batch: MCBatch, steering,
                layer_path: str) -> dict[str, Any]:
  """Accuracy on summed and on mean log-prob, the trigger rate, and each
  item's correctness (0/1 lists `correct_sum`, `correct_mean`, in item
  order: what a bootstrap over items resamples)."""
  total, mean, stats = mc_logprobs(model, params, batch, steering, layer_path)
  correct_sum = total.argmax(1) == batch.labels
  correct_mean = mean.argmax(1) == batch.labels
  return {'acc_sum': float(np.mean(correct_sum)),
          'acc_mean': float(np.mean(correct_mean)),
          'trigger_rate': float(stats.trigger_rate),
          'correct_sum': correct_sum.astype(int).tolist(),
          'correct_mean': correct_mean.astype(int).tolist()}


def heldout_metrics(model, params, windows: np.ndarray, steering,
                    layer_path: str, layer_paths: list[str],
                    base: dict[str, Any] | None = None) -> dict[str, Any]:
  """KL to the unsteered model, CE and norm ratios on held-out windows.

  `base` caches the unsteered pass (as returned under the 'base' key).
  """
  tokens = np.asarray(windows[:, :-1], np.int32)
  targets = np.asarray(windows[:, 1:], np.int32)
  valid = np.ones_like(tokens, bool)
  k = layer_paths.index(layer_path)
  watch = tuple(layer_paths[k:])
  if base is None:
    logp0, _, norms0 = _steered_logprobs(
        model, params, tokens, valid, valid,
        steering_lib.Steering('none', steering.direction, alpha=0.0),
        layer_path, watch)
    base = {'logp': logp0, 'norms': norms0}
  logp, stats, norms = _steered_logprobs(model, params, tokens, valid, valid,
                                         steering, layer_path, watch)
  p0 = jnp.exp(base['logp'])
  kl = float(jnp.mean(jnp.sum(p0 * (base['logp'] - logp), -1)))
  ce = float(-jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1)))
  ratio = {p: float(jnp.mean(norms[p] / jnp.maximum(base['norms'][p], 1e-12)))
           for p in watch}
  out = {'kl': kl, 'ce': ce,
         'trigger_rate': float(stats.triggered / stats.tokens),
         'norm_ratio_at': ratio[watch[0]],
         'norm_ratio_next': ratio[watch[min(1, len(watch) - 1)]],
         'norm_ratio_last': ratio[watch[-1]], 'base': base}
  return out


def _lexicon(sentences, others) -> frozenset[str]:
  words = lambda pool: {w for s in pool for w in re.findall(r'[a-z]+', s)}
  return frozenset(words(sentences) - words(others))


POSITIVE_WORDS = _lexicon(text_corpus.POSITIVE_SENTENCES,
                          text_corpus.NEGATIVE_SENTENCES
                          | set(text_corpus.NEUTRAL_SENTENCES))
NEGATIVE_WORDS = _lexicon(text_corpus.NEGATIVE_SENTENCES,
                          text_corpus.POSITIVE_SENTENCES
                          | set(text_corpus.NEUTRAL_SENTENCES))


def positive_share(texts: list[str]) -> float:
  """Positive / (positive + negative) sentiment words in `texts` (nan if none)."""
  pos = neg = 0
  for t in texts:
    for w in re.findall(r'[a-z]+', t.lower()):
      pos += w in POSITIVE_WORDS
      neg += w in NEGATIVE_WORDS
  return pos / (pos + neg) if pos + neg else float('nan')


def generation_prompts(n: int, tokenizer: lm_tokenizer.Tokenizer | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
  """Left-padded BOS + neutral premise + ' ' prompts. With subwords the
  trailing space is left out: it starts the next word's token, which the
  model is to choose, rather than standing alone as a token it rarely saw."""
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  separator = text_corpus.MCItem.SEPARATOR if tokenizer.kind == 'byte' else ''
  premises = [text_corpus.PREMISES[i % len(text_corpus.PREMISES)]
              for i in range(n)]
  seqs = [lm_tokenizer.encode_document(tokenizer, p + separator)
          for p in premises]
  length = max(len(s) for s in seqs)
  tokens = np.zeros((n, length), np.int32)
  valid = np.zeros((n, length), bool)
  for i, s in enumerate(seqs):
    tokens[i, length - len(s):] = s
    valid[i, length - len(s):] = True
  return tokens, valid


@functools.partial(jax.jit, static_argnames=('model', 'layer_path',
                                             'num_steps', 'mode', 'temperature'))
def _generate(model, params, prompt, valid, steering, rng, layer_path,
              num_steps, mode, temperature):
  return lm_generate.generate(model, params, prompt, valid, num_steps,
                              steering=steering, layer_path=layer_path,
                              mode=mode, temperature=temperature, rng=rng)


@functools.partial(jax.jit, static_argnames=('model',))
def _unsteered_ce(model, params, prompt, valid, generated):
  tokens = jnp.concatenate([prompt, generated], axis=1)
  mask = jnp.concatenate([valid, jnp.ones(generated.shape, bool)], axis=1)
  logits, _ = lm_generate.score(model, params, tokens, mask)
  # The logits at the last prompt position onward predict the generation.
  logp = jax.nn.log_softmax(
      logits[:, prompt.shape[1] - 1:-1].astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, generated[..., None], -1))


def programs(config: ml_collections.ConfigDict,
             lm_config: ml_collections.ConfigDict, devices: list
             ) -> tuple[Mesh, Any, list[aot.Program]]:
  """For `launch.compile`: the generation of each of `config.methods` as
  the evaluation compiles it (steered at `config.layer`, KV-cached or
  recomputed per `config.generation.mode`), for the LM `lm_config`
  describes, on shapes only and one of `devices` (the evaluation runs on
  one device). Prompts are as long as the byte tokenizer makes them (the
  longest a tokenizer makes them). Returns the mesh, no rules, and the
  programs."""
  check_config(config, require_lm=False)
  model = lm_trainer.create_model(lm_config)
  params = nn.meta.unbox(jax.eval_shape(
      functools.partial(lm_trainer.init_variables, model),
      jax.random.key(0)))['params']
  try:
    layer_path = steering_hooks.resolve_layer(params, config.layer)
  except ValueError as e:
    raise ConfigError('layer', config.layer, str(e).split(': ', 1)[1]) from None
  prompt, _ = generation_prompts(config.generation.prompts)
  gen = config.generation
  if prompt.shape[1] + gen.steps > model.max_len:
    raise ConfigError('generation.steps', gen.steps,
                      f'prompts of {prompt.shape[1]} tokens and this many '
                      f'steps exceed the LM\'s max_len={model.max_len}')
  mesh = Mesh(np.array(devices[:1]), ('data',))
  repl = NamedSharding(mesh, PartitionSpec())
  place = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=repl), tree)
  direction = jax.ShapeDtypeStruct((model.d_model,), np.float32)
  out = []
  for method in config.methods:
    steer = jax.eval_shape(lambda d, m=method: make_steering(
        m, d, 0.5, kappa=config.kappa, beta=config.beta, coefficient=1.0),
                           direction)
    fn = jax.jit(lambda p, tokens, valid, s, rng: lm_generate.generate(
        model, p, tokens, valid, gen.steps, steering=s,
        layer_path=layer_path, mode=gen.mode, temperature=gen.temperature,
        rng=rng))
    out.append(aot.Program(
        f'generate ({method}, {gen.mode}, {gen.steps} tokens)', fn,
        place((params, jax.ShapeDtypeStruct(prompt.shape, np.int32),
               jax.ShapeDtypeStruct(prompt.shape, np.bool_), steer,
               jax.eval_shape(lambda: jax.random.key(0))))))
  return mesh, None, out


def generation_metrics(model, params, prompts, steering, layer_path: str,
                       num_steps: int, temperature: float, seed: int,
                       mode: str = 'cached',
                       tokenizer: lm_tokenizer.Tokenizer | None = None
                       ) -> dict[str, Any]:
  """Measures of the texts generated after `prompts` (tokens, valid)."""
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  gen = _generate(model, params, prompts[0], prompts[1], steering,
                  jax.random.key(seed), layer_path, num_steps, mode,
                  temperature)
  texts = [tokenizer.decode(row) for row in np.asarray(gen.tokens)]
  return {'positive_share': positive_share(texts),
          'distinct_1': text_corpus.distinct_n(texts, 1),
          'distinct_2': text_corpus.distinct_n(texts, 2),
          'repetition_3': text_corpus.repetition_rate(texts, 3),
          'gen_ce': float(_unsteered_ce(model, params, prompts[0], prompts[1],
                                        gen.tokens)),
          'samples': texts[:3]}


@functools.partial(jax.jit, static_argnames=('model', 'layer_path'))
def _capture(model, params, tokens, valid, layer_path):
  with steering_hooks.steered(None, None, capture=(layer_path,)) as rec:
    model.apply({'params': params}, tokens, valid)
  return rec.hidden[layer_path]


POSITIONS = ('last', 'mean')


def extract(model: decoder_lm.DecoderLM, params, layer_path: str,
            pairs: list[tuple[str, str]], method: str = 'mean_diff',
            position: str = 'last',
            tokenizer: lm_tokenizer.Tokenizer | None = None
            ) -> tuple[np.ndarray, float]:
  """The unit direction from activations after `layer_path`, and their mean
  norm (the addition coefficient).

  `position`: 'last' takes each text's last token (the reference's choice);
  'mean' averages over its tokens after BOS.
  """
  tokenizer = tokenizer or lm_tokenizer.ByteTokenizer()
  pos, neg = ([lm_tokenizer.encode_document(tokenizer, p[i]) for p in pairs]
              for i in (0, 1))
  length = max(len(s) for s in pos + neg)
  acts, norms = [], []
  for seqs in (pos, neg):
    tokens, valid = _right_pad(seqs, length)
    hidden = np.asarray(_capture(model, params, tokens, valid, layer_path))
    if position == 'last':
      picked = hidden[np.arange(len(seqs)), valid.sum(1) - 1]
    else:
      weights = valid.copy()
      weights[:, 0] = False  # The BOS state is the same for every text.
      picked = (hidden * weights[..., None]).sum(1) / weights.sum(1,
                                                                 keepdims=True)
    acts.append(picked)
    norms.append(np.linalg.norm(hidden, axis=-1)[valid])
  direction = steering_lib.extract_direction(acts[0], acts[1], method)
  return np.asarray(direction), float(np.concatenate(norms).mean())


# Items per task and item set: one batch holds every set of a task.
MAX_ITEMS = 10_000


def check_config(config, require_lm: bool = True) -> None:
  """ConfigError naming the field, before anything is loaded or run;
  `require_lm=False` lets the LM's workdir be unset (compiling needs its
  config only)."""
  if require_lm and not config.get('lm_workdir'):
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


def _direction(config, model, params, layer_path: str,
               tokenizer: lm_tokenizer.Tokenizer
               ) -> steering_vectors.SteeringVector:
  """The config's vector file (checked against the tokenizer, then the
  model), or a direction extracted from contrastive pairs at `layer_path`."""
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
  direction, coefficient = extract(model, params, layer_path, pairs,
                                   config.direction.method,
                                   config.direction.position, tokenizer)
  return steering_vectors.SteeringVector(
      direction, config.layer, layer_path,
      steering_vectors.fingerprint(params),
      dict(method=config.direction.method, pairs=config.direction.pairs,
           position=config.direction.position, coefficient=coefficient),
      tokenizer.fingerprint)


def evaluate(config, workdir: str) -> list[dict[str, Any]]:
  """Runs the method x alpha grid; writes results.json, results.md,
  pareto.png and steering_vector.npz into `workdir`; returns the rows.

  Raises:
    UsageError: a setting is invalid, or does not fit the LM; nothing is
      written then.
    WorkdirBusy: another run holds the workdir.
  """
  check_config(config)
  workdir = experiment_lib.check_workdir(workdir)
  with workdir_lock.hold(workdir):
    return _evaluate(config, workdir)


def _evaluate(config, workdir: str) -> list[dict[str, Any]]:
  lm = lm_trainer.load_trained(config.lm_workdir)
  lm_config, model, tokenizer = lm.config, lm.model, lm.tokenizer
  params = jax.device_get(lm.params)
  try:
    layer_path = steering_hooks.resolve_layer(params, config.layer)
  except ValueError as e:
    raise ConfigError('layer', config.layer, str(e).split(': ', 1)[1]) from None
  paths = steering_hooks.layer_paths(params)

  # Every item set of a task in one batch; correctness is split per set.
  items = {t: [it for seed in config.mc_seeds
               for it in text_corpus.mc_task(t, n, seed)]
           for t, n in config.tasks.items()}
  mc = {t: encode_mc(its, tokenizer=tokenizer) for t, its in items.items()}
  length = max(b.tokens.shape[1] for b in mc.values())
  if length > model.max_len:
    raise ConfigError('tasks', dict(config.tasks),
                      f'items of {length} tokens exceed the LM\'s max_len')
  prompts = generation_prompts(config.generation.prompts, tokenizer)
  if prompts[0].shape[1] + config.generation.steps > model.max_len:
    raise ConfigError('generation.steps', config.generation.steps,
                      f'prompts of {prompts[0].shape[1]} tokens and this '
                      f'many steps exceed the LM\'s max_len={model.max_len}')

  vec = _direction(config, model, params, layer_path, tokenizer)
  steering_vectors.save(os.path.join(workdir, 'steering_vector.npz'), vec)
  coefficient = float(vec.info['coefficient'])
  heldout = {s: lm_data.load_windows(
      lm_config.data, 'test', lm_config.seed, only=s,
      tokenizer=tokenizer).tokens[:config.heldout_windows]
             for s in lm_data.source_names(lm_config.data)}

  rows, bases = [], {}
  for method in config.methods:
    for alpha in ((0.0,) if method == 'none' else tuple(config.alphas)):
      steer = make_steering(method, vec.direction, float(alpha),
                            kappa=config.kappa, beta=config.beta,
                            coefficient=coefficient)
      row = {'method': method, 'alpha': float(alpha)}
      for task, batch in mc.items():
        n = config.tasks[task]
        for k, v in mc_accuracy(model, params, batch, steer,
                                layer_path).items():
          if k.startswith('correct_'):
            v = [v[i:i + n] for i in range(0, len(v), n)]
          row[f'{task}_{k}'] = v
      kls, trig = [], []
      for source, windows in heldout.items():
        out = heldout_metrics(model, params, windows, steer, layer_path,
                              paths, bases.get(source))
        bases[source] = out.pop('base')
        for k, v in out.items():
          row[f'{source}_{k}'] = v
        kls.append(out['kl'])
        trig.append(out['trigger_rate'])
      row['kl'] = float(np.mean(kls))
      row['trigger_rate'] = float(np.mean(trig))
      gen = generation_metrics(model, params, prompts, steer, layer_path,
                               config.generation.steps,
                               config.generation.temperature,
                               config.generation.seed, config.generation.mode,
                               tokenizer)
      row['samples'] = gen.pop('samples')
      row.update(gen)
      logging.info('%s alpha=%.2f: %s', method, alpha, {
          k: round(v, 4) for k, v in row.items()
          if isinstance(v, float) and k != 'alpha'})
      rows.append(row)

  meta = dict(lm_workdir=os.path.abspath(config.lm_workdir),
              layer=config.layer, layer_path=layer_path,
              mc_seeds=list(config.mc_seeds), tasks=dict(config.tasks),
              config=json.loads(config.to_json()),
              num_layers=len(paths), coefficient=coefficient,
              kappa=config.kappa, beta=config.beta,
              model_fingerprint=vec.model_fingerprint,
              tokenizer_fingerprint=tokenizer.fingerprint)
  metrics_lib.write_json_atomic(os.path.join(workdir, 'results.json'),
                                {'meta': meta, 'rows': rows})
  table = markdown_table(rows, list(mc))
  metrics_lib.write_text_atomic(os.path.join(workdir, 'results.md'), table)
  pareto.plot_pareto(rows, list(mc), os.path.join(workdir, 'pareto.png'))
  return rows


def markdown_table(rows: list[dict[str, Any]], tasks: list[str]) -> str:
  """One line per (method, alpha): accuracies, KL, CE, norms, triggers, text."""
  # One CE column per held-out source (each has a `<source>_kl`); the
  # generations' CE (`gen_ce`) has its own column at the end.
  sources = sorted(k.removesuffix('_kl') for k in rows[0]
                   if k.endswith('_kl'))
  ce_cols = [f'{s}_ce' for s in sources]
  head = (['method', 'alpha']
          + [f'{t} acc (sum / mean)' for t in tasks]
          + ['KL', *[c.replace('_ce', ' CE') for c in ce_cols],
             'norm ratio (at / next / last)', 'trigger rate',
             'positive share', 'distinct-2', 'rep-3',
             'generations CE (unsteered model)'])
  src = ce_cols[0].removesuffix('_ce')
  table = []
  for r in rows:
    cells = [r['method'], f'{r["alpha"]:.2f}']
    cells += [f'{r[f"{t}_acc_sum"]:.3f} / {r[f"{t}_acc_mean"]:.3f}'
              for t in tasks]
    cells += [f'{r["kl"]:.4f}', *[f'{r[c]:.4f}' for c in ce_cols]]
    cells += [f'{r[f"{src}_norm_ratio_at"]:.3f} / '
              f'{r[f"{src}_norm_ratio_next"]:.3f} / '
              f'{r[f"{src}_norm_ratio_last"]:.3f}',
              f'{r["trigger_rate"]:.3f}', f'{r["positive_share"]:.3f}',
              f'{r["distinct_2"]:.3f}', f'{r["repetition_3"]:.3f}',
              f'{r["gen_ce"]:.3f}']
    table.append(cells)
  return stats.markdown_table(head, table, '-' * len(head)) + '\n'
