"""Steering evaluation on Gemma 3 270M, the registry's pretrained model.

The measures are `train.steering.evaluation`'s, on a real pretrained LM,
with rows in the same format so that `train.steering.study` (matched KL,
hierarchical bootstrap) and `study_report` read them unchanged:

- multiple choice: the same COPA- and StoryCloze-style items as the
  in-project studies (`train.lm.corpus.mc_task`), tokenized by Gemma's
  tokenizer; a choice is scored by its summed and mean log-probability,
  steering from the last context token through the choice (the
  reference's evaluation, as in `evaluation.encode_mc`);
- held-out text (Debian fortunes and Python's documentation, which the
  model may have read in pretraining but the direction never saw), steered
  at every token: KL(unsteered || steered) per token, the steered
  cross-entropy, the norm ratio at the steered block and the last one,
  and the gate's trigger rate;
- open-ended generations after neutral prompts (ActAdd's love/hate
  setting: a sentiment direction, continuations judged by a lexicon
  classifier): the share VADER (vaderSentiment 3.3.2, from the registry)
  rates positive (compound >= 0.05, VADER's own threshold) and its mean
  compound score; fluency as the unsteered model's cross-entropy of the
  generated tokens (`gen_ce`) and distinct-n; the 3-gram repetition rate.

Ours, not the papers': the items and the direction's contrastive pairs
are the in-project template grammar's (so results compare with the
in-project LMs on the same items), the prompts below, and two economies
that change no number:
- a choice's context except its last token is never steered, so it runs
  once, unsteered, into a KV cache; every (method, alpha) then runs only
  the last context token and the choice on that cache (checked against a
  full-sequence pass in tests/test_gemma_steering.py);
- with 262,144 logits per token, only each scored token's log-probability
  (logit minus log-sum-exp) leaves the compiled function, and the KL is
  computed inside it against the unsteered log-probabilities, in chunks.
"""

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

from train import aot
from train import experiment as experiment_lib
from train import metrics as metrics_lib
from train import stats
from train import workdir_lock
from train.errors import ConfigError
from train.lm import corpus as text_corpus
from train.lm import data as lm_data
from train.lm import decoder as decoder_lm
from train.lm import gemma
from train.lm import gemma_gguf
from train.lm import generate as lm_generate
from train.lm import hooks as steering_hooks
from train.lm import models as lm_models
from train.lm import tokenizer as lm_tokenizer
from train.steering import evaluation
from train.steering import vectors as steering_vectors

# Neutral openings for open-ended continuations (ours; ActAdd's own
# "I hate you because" among them). None states a sentiment.
PROMPTS = (
    'I hate you because', 'I went up to my friend and said',
    'Yesterday I went to the market and', 'The weather this morning was',
    'My neighbour told me that the new restaurant', 'When I opened the door,',
    'The meeting on Monday', 'I think the movie', 'Last week my brother',
    'The train was late, so', 'Our teacher said that the exam',
    'After dinner we talked about', 'The book I am reading',
    'When the package arrived,', 'My first day at the new job',
    'The city council decided to', 'On the way home I saw',
    'The coffee at the station', 'She looked at the painting and',
    'The software update', 'At the end of the concert,',
    'The hotel room was', 'My grandmother always says that',
    'The new phone', 'We spent the weekend at the lake and',
    'The interview went', 'He read the letter twice and',
    'The team finished the season', 'I tried the recipe and',
    'The flight to Chicago', 'When I think about school,',
    'The customer service agent')

# Rows of one compiled call: bounded so that the 262,144-wide logits of a
# chunk stay near 1 GB.
CHUNK_TOKENS = 1024


def check_config(config: ml_collections.ConfigDict) -> None:
  """ConfigError naming the field, before the model is loaded."""
  evaluation.check_config(config, require_lm=False)
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
  if config.heldout_windows > 4096:
    raise ConfigError('heldout_windows', config.heldout_windows,
                      'must be at most 4096')
  gen = config.generation
  if gen.prompts > len(PROMPTS):
    raise ConfigError('generation.prompts', gen.prompts,
                      f'there are {len(PROMPTS)} prompts')
  if gen.steps > 256:
    raise ConfigError('generation.steps', gen.steps, 'must be at most 256')


# --- Multiple choice on a KV-cached context.
class CachedMC(NamedTuple):
  """Rows (item-major, choice-minor): the context but its last token
  (left-padded), then the last context token and the choice (right-padded)."""
  prefix: np.ndarray        # (rows, P)
  prefix_valid: np.ndarray  # (rows, P)
  tail: np.ndarray          # (rows, T): last context token, choice tokens
  tail_valid: np.ndarray    # (rows, T)
  score: np.ndarray         # (rows, T): tail positions whose NEXT token is
                            # a choice token
  labels: np.ndarray        # (items,)


def encode_cached_mc(items: list[text_corpus.MCItem],
                     tokenizer: lm_tokenizer.Tokenizer) -> CachedMC:
  parts = [lm_tokenizer.split(tokenizer, item.prefix(), choice)
           for item in items for choice in item.choices]
  p_len = max(len(c) - 1 for c, _ in parts)
  t_len = max(1 + len(a) for _, a in parts)
  rows = len(parts)
  prefix = np.zeros((rows, p_len), np.int32)
  prefix_valid = np.zeros((rows, p_len), bool)
  tail = np.zeros((rows, t_len), np.int32)
  tail_valid = np.zeros((rows, t_len), bool)
  score = np.zeros((rows, t_len), bool)
  for i, (ctx, ans) in enumerate(parts):
    if len(ctx) < 2 or not len(ans):
      raise ValueError(f'item row {i}: a context of {len(ctx)} tokens and a '
                       f'choice of {len(ans)}; both must be non-empty')
    head = ctx[:-1]
    prefix[i, p_len - len(head):] = head
    prefix_valid[i, p_len - len(head):] = True
    seq = np.concatenate([ctx[-1:], ans])
    tail[i, :len(seq)] = seq
    tail_valid[i, :len(seq)] = True
    score[i, :len(ans)] = True
  return CachedMC(prefix, prefix_valid, tail, tail_valid, score,
                  np.array([it.label for it in items], np.int32))


@functools.partial(jax.jit, static_argnames=('model', 'slots'))
def _prefill(model, params, tokens, valid, slots):
  cache = decoder_lm.init_cache(model, tokens.shape[0], slots)
  _, cache = model.apply({'params': params}, tokens, valid, cache)
  return cache


def _target_logprobs(logits, tokens):
  """log p(next token) at each position (the last position's is junk)."""
  nxt = jnp.roll(tokens, -1, axis=1)
  picked = jnp.take_along_axis(logits, nxt[..., None], -1)[..., 0]
  return picked - jax.nn.logsumexp(logits, -1)


@functools.partial(jax.jit, static_argnames=('model', 'layer_path'))
def _tail_logprobs(model, params, cache, tokens, valid, steering, layer_path):
  with steering_hooks.steered(steering, layer_path, valid) as rec:
    logits, _ = model.apply({'params': params}, tokens, valid, cache)
  return _target_logprobs(logits, tokens), rec.stats


class MCScorer:
  """A task's contexts prefilled once; `accuracy(steering)` per method."""

  def __init__(self, model, params, batch: CachedMC, layer_path: str):
    self.model, self.params, self.batch = model, params, batch
    self.layer_path = layer_path
    rows, p_len = batch.prefix.shape
    # Row chunks of even size keep an item's two choices together.
    self.step = max(2, (CHUNK_TOKENS // max(p_len, 1)) // 2 * 2)
    slots = p_len + batch.tail.shape[1]
    self.caches = [
        _prefill(model, params, batch.prefix[i:i + self.step],
                 batch.prefix_valid[i:i + self.step], slots)
        for i in range(0, rows, self.step)]

  def logprobs(self, steering) -> tuple[np.ndarray, np.ndarray, Any]:
    """Summed and mean log-probs of each choice (items, 2), and the stats."""
    sums, counts, stats = [], [], []
    b = self.batch
    for k, cache in enumerate(self.caches):
      sl = slice(k * self.step, (k + 1) * self.step)
      lp, st = _tail_logprobs(self.model, self.params, cache, b.tail[sl],
                              b.tail_valid[sl], steering, self.layer_path)
      sums.append((np.asarray(lp) * b.score[sl]).sum(1))
      counts.append(b.score[sl].sum(1))
      stats.append(jax.device_get(st))
    total = np.concatenate(sums).reshape(-1, 2)
    mean = total / np.concatenate(counts).reshape(-1, 2)
    return total, mean, jax.tree.map(lambda *x: sum(x), *stats)

  def accuracy(self, steering) -> dict[str, Any]:
    total, mean, stats = self.logprobs(steering)
    correct_sum = total.argmax(1) == self.batch.labels
    correct_mean = mean.argmax(1) == self.batch.labels
    return {'acc_sum': float(np.mean(correct_sum)),
            'acc_mean': float(np.mean(correct_mean)),
            'trigger_rate': float(stats.trigger_rate),
            'correct_sum': correct_sum.astype(int).tolist(),
            'correct_mean': correct_mean.astype(int).tolist()}


# --- Held-out text: `train.lm.data.heldout_windows`.
@functools.partial(jax.jit, static_argnames=('model', 'layer_path', 'watch'))
def _window_logprobs(model, params, tokens, steering, layer_path, watch):
  valid = jnp.ones(tokens.shape, bool)
  with steering_hooks.steered(steering, layer_path, valid, watch) as rec:
    logits, _ = model.apply({'params': params}, tokens, valid)
  return jax.nn.log_softmax(logits), rec.stats, rec.norms


@functools.partial(jax.jit, static_argnames=('model', 'layer_path', 'watch'))
def _window_kl(model, params, tokens, targets, base_logp, steering,
               layer_path, watch):
  logp, stats, norms = _window_logprobs(model, params, tokens, steering,
                                        layer_path, watch)
  kl = jnp.sum(jnp.exp(base_logp) * (base_logp - logp), -1)
  nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return kl, nll, stats, norms


class HeldoutScorer:
  """The unsteered log-probabilities of the windows, kept per chunk."""

  def __init__(self, model, params, windows: np.ndarray, layer_path: str,
               last_path: str, direction):
    self.model, self.params, self.layer_path = model, params, layer_path
    self.watch = tuple(dict.fromkeys((layer_path, last_path)))
    tokens = windows[:, :-1]
    self.step = max(1, CHUNK_TOKENS // tokens.shape[1])
    self.chunks = [tokens[i:i + self.step]
                   for i in range(0, len(tokens), self.step)]
    self.targets = [windows[i:i + self.step, 1:]
                    for i in range(0, len(tokens), self.step)]
    none = evaluation.make_steering('none', direction, 0.0, kappa=0.0,
                                    beta=0.0, coefficient=1.0)
    self.base = []
    for c in self.chunks:
      logp, _, norms = _window_logprobs(model, params, c, none, layer_path,
                                        self.watch)
      self.base.append((logp, norms))

  def metrics(self, steering) -> dict[str, float]:
    kls, nlls, stats, ratios = [], [], [], {p: [] for p in self.watch}
    for c, y, (logp0, norms0) in zip(self.chunks, self.targets, self.base):
      kl, nll, st, norms = _window_kl(self.model, self.params, c, y, logp0,
                                      steering, self.layer_path, self.watch)
      kls.append(np.asarray(kl).ravel())
      nlls.append(np.asarray(nll).ravel())
      stats.append(jax.device_get(st))
      for p in self.watch:
        ratios[p].append(np.asarray(norms[p] / jnp.maximum(norms0[p], 1e-12)
                                    ).ravel())
    st = jax.tree.map(lambda *x: sum(x), *stats)
    ratio = {p: float(np.mean(np.concatenate(v))) for p, v in ratios.items()}
    # A gate that leaves every token alone gives the unsteered logits; their
    # KL then rounds to +-1e-9, and the matched-KL reading needs KL >= 0.
    return {'kl': max(float(np.mean(np.concatenate(kls))), 0.0),
            'ce': float(np.mean(np.concatenate(nlls))),
            'trigger_rate': float(st.triggered / st.tokens),
            'norm_ratio_at': ratio[self.watch[0]],
            'norm_ratio_last': ratio[self.watch[-1]]}


# --- Generations.
def prompts(tokenizer, n: int) -> tuple[np.ndarray, np.ndarray]:
  """BOS + the first `n` of `PROMPTS`, left-padded."""
  seqs = [lm_tokenizer.encode_document(tokenizer, p) for p in PROMPTS[:n]]
  length = max(len(s) for s in seqs)
  tokens = np.zeros((n, length), np.int32)
  valid = np.zeros((n, length), bool)
  for i, s in enumerate(seqs):
    tokens[i, length - len(s):] = s
    valid[i, length - len(s):] = True
  return tokens, valid


def until_eos(rows: np.ndarray, eos: int) -> np.ndarray:
  """(rows, steps) bool: the generated tokens up to and including the first
  EOS (what the text is; sampling past EOS is not the model's text)."""
  rows = np.asarray(rows)
  after = np.cumsum(rows == eos, axis=1) - (rows == eos)
  return after == 0


@functools.partial(jax.jit, static_argnames=('model',))
def _generated_nll(model, params, prompt, valid, generated, keep):
  tokens = jnp.concatenate([prompt, generated], axis=1)
  mask = jnp.concatenate([valid, keep], axis=1)
  logits, _ = model.apply({'params': params}, tokens, mask)
  logits = logits[:, prompt.shape[1] - 1:-1]
  picked = jnp.take_along_axis(logits, generated[..., None], -1)[..., 0]
  nll = jax.nn.logsumexp(logits, -1) - picked
  return jnp.sum(nll * keep), jnp.sum(keep)


def vader_scores(texts: list[str]) -> np.ndarray:
  """VADER's compound score (-1..1) of each text."""
  from vaderSentiment import vaderSentiment  # pylint: disable=g-import-not-at-top
  analyzer = vaderSentiment.SentimentIntensityAnalyzer()
  return np.array([analyzer.polarity_scores(t)['compound'] for t in texts])


def generation_metrics(model, params, tokenizer, prompt, steering,
                       layer_path: str, gen_config) -> dict[str, Any]:
  tokens, valid = prompt
  out = lm_generate.generate(model, params, tokens, valid, gen_config.steps,
                             steering=steering, layer_path=layer_path,
                             mode=gen_config.mode,
                             temperature=gen_config.temperature,
                             rng=jax.random.key(gen_config.seed))
  generated = np.asarray(out.tokens)
  keep = until_eos(generated, tokenizer.eos_id)
  texts = [tokenizer.decode(row[k]) for row, k in zip(generated, keep)]
  compound = vader_scores(texts)
  nll, count = _generated_nll(model, params, tokens, valid, generated, keep)
  return {'positive_share': float(np.mean(compound >= 0.05)),
          'vader_compound': float(np.mean(compound)),
          'distinct_1': text_corpus.distinct_n(texts, 1),
          'distinct_2': text_corpus.distinct_n(texts, 2),
          'repetition_3': text_corpus.repetition_rate(texts, 3),
          'gen_ce': float(nll / count),
          'samples': texts[:3]}


# --- The grid.
def _load(config) -> tuple[gemma.Gemma3, Any, Any, str, str]:
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
  return model, loaded.params, loaded.tokenizer, loaded.sha256, path


def evaluate(config, workdir: str) -> list[dict[str, Any]]:
  """The method x alpha grid at `config.layer`; writes results.json,
  results.md and steering_vector.npz into `workdir`; returns the rows.

  Raises:
    UsageError: a setting is invalid (nothing loaded or written then).
    WorkdirBusy: another run holds the workdir.
  """
  check_config(config)
  workdir = experiment_lib.check_workdir(workdir)
  with workdir_lock.hold(workdir):
    return _evaluate(config, workdir)


def _evaluate(config, workdir: str) -> list[dict[str, Any]]:
  model, params, tokenizer, sha, path = _load(config)
  layer_path = steering_hooks.resolve_layer(params, config.layer)
  paths = steering_hooks.layer_paths(params)
  pairs = text_corpus.contrastive_pairs(config.direction.pairs,
                                        config.direction.seed)
  direction, coefficient = evaluation.extract(
      model, params, layer_path, pairs, config.direction.method,
      config.direction.position, tokenizer)
  vec = steering_vectors.SteeringVector(
      direction, config.layer, layer_path, 'gguf-sha256:' + sha,
      dict(method=config.direction.method, pairs=config.direction.pairs,
           position=config.direction.position, coefficient=coefficient),
      tokenizer.fingerprint)
  steering_vectors.save(os.path.join(workdir, 'steering_vector.npz'), vec)

  items = {t: [it for seed in config.mc_seeds
               for it in text_corpus.mc_task(t, n, seed)]
           for t, n in config.tasks.items()}
  scorers = {t: MCScorer(model, params, encode_cached_mc(its, tokenizer),
                         layer_path) for t, its in items.items()}
  heldout = HeldoutScorer(model, params,
                          lm_data.heldout_windows(tokenizer, config.heldout_windows,
                                          config.window_len),
                          layer_path, paths[-1], direction)
  prompt = prompts(tokenizer, config.generation.prompts)

  rows = []
  for method in config.methods:
    for alpha in ((0.0,) if method == 'none' else tuple(config.alphas)):
      steer = evaluation.make_steering(method, direction, float(alpha),
                                       kappa=config.kappa, beta=config.beta,
                                       coefficient=coefficient)
      row = {'method': method, 'alpha': float(alpha)}
      for task, scorer in scorers.items():
        n = config.tasks[task]
        for k, v in scorer.accuracy(steer).items():
          if k.startswith('correct_'):
            v = [v[i:i + n] for i in range(0, len(v), n)]
          row[f'{task}_{k}'] = v
      row.update(heldout.metrics(steer))
      if config.generation.enabled:
        gen = generation_metrics(model, params, tokenizer, prompt, steer,
                                 layer_path, config.generation)
        row['samples'] = gen.pop('samples')
        row.update(gen)
      logging.info('%s alpha=%.2f: %s', method, alpha, {
          k: round(v, 4) for k, v in row.items()
          if isinstance(v, float) and k != 'alpha'})
      rows.append(row)

  meta = dict(model='gemma-3-270m', gguf=os.path.abspath(path),
              gguf_sha256=sha, layer=config.layer, layer_path=layer_path,
              mc_seeds=list(config.mc_seeds), tasks=dict(config.tasks),
              config=json.loads(config.to_json()), num_layers=len(paths),
              coefficient=coefficient, kappa=config.kappa, beta=config.beta,
              model_fingerprint=vec.model_fingerprint,
              tokenizer_fingerprint=tokenizer.fingerprint)
  metrics_lib.write_json_atomic(os.path.join(workdir, 'results.json'),
                                {'meta': meta, 'rows': rows})
  metrics_lib.write_text_atomic(os.path.join(workdir, 'results.md'),
                                markdown_table(rows, list(items)))
  return rows


# Prompt length the compile-only programs assume: `PROMPTS` are 5 to 10
# Gemma tokens with BOS, and other shapes have no tokenizer here to count.
COMPILE_PROMPT_LEN = 16


def programs(config: ml_collections.ConfigDict, devices: list
             ) -> tuple[Any, Any, list[Any]]:
  """For `launch.compile`: the steered generation of each of
  `config.methods` on Gemma 3 `config.shape` in `config.dtype`, as the
  evaluation compiles it, and the held-out scoring pass, on shapes only and
  one of `devices` (the evaluation runs on one device). Returns the mesh,
  no rules, and the programs."""
  check_config(config)
  gen = config.generation
  model = gemma.Gemma3(lm_models.shape_named(config.shape, config.gguf),
                       max_len=COMPILE_PROMPT_LEN + gen.steps,
                       dtype=config.dtype)
  dtype = jnp.dtype(config.dtype)
  params = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, dtype),
      nn.meta.unbox(jax.eval_shape(
          lambda k: model.init(k, jnp.zeros((1, 4), jnp.int32)),
          jax.random.key(0)))['params'])
  layer_path = f'block_{config.layer}'
  mesh = Mesh(np.array(devices[:1]), ('data',))
  repl = NamedSharding(mesh, PartitionSpec())
  place = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=repl), tree)
  direction = jax.ShapeDtypeStruct((model.d_model,), np.float32)
  prompt = jax.ShapeDtypeStruct((gen.prompts, COMPILE_PROMPT_LEN), np.int32)
  prompt_valid = jax.ShapeDtypeStruct(prompt.shape, np.bool_)
  out = []
  for method in config.methods:
    steer = jax.eval_shape(lambda d, m=method: evaluation.make_steering(
        m, d, 0.5, kappa=config.kappa, beta=config.beta, coefficient=1.0),
                           direction)
    fn = jax.jit(lambda p, tokens, valid, s, rng: lm_generate.generate(
        model, p, tokens, valid, gen.steps, steering=s,
        layer_path=layer_path, mode=gen.mode, temperature=gen.temperature,
        rng=rng))
    out.append(aot.Program(
        f'generate ({method}, {gen.mode}, {gen.steps} tokens)', fn,
        place((params, prompt, prompt_valid, steer,
               jax.eval_shape(lambda: jax.random.key(0))))))
  windows = jax.ShapeDtypeStruct(
      (max(1, CHUNK_TOKENS // config.window_len), config.window_len),
      np.int32)
  steer = jax.eval_shape(lambda d: evaluation.make_steering(
      config.methods[-1], d, 0.5, kappa=config.kappa, beta=config.beta,
      coefficient=1.0), direction)
  fn = jax.jit(lambda p, tokens, s: _window_logprobs(
      model, p, tokens, s, layer_path, (layer_path,))[0])
  out.append(aot.Program(
      f'held-out log-probs ({config.methods[-1]}, {windows.shape[0]} x '
      f'{windows.shape[1]} tokens)', fn, place((params, windows, steer))))
  return mesh, None, out


def markdown_table(rows: list[dict[str, Any]], tasks: list[str]) -> str:
  """One line per (method, alpha)."""
  gen = 'positive_share' in rows[0]
  head = (['method', 'alpha'] + [f'{t} acc (sum / mean)' for t in tasks]
          + ['KL', 'held-out CE', 'norm ratio (at / last)', 'trigger rate']
          + (['VADER positive', 'VADER compound', 'distinct-2', 'rep-3',
              'generations CE (unsteered)'] if gen else []))
  table = []
  for r in rows:
    cells = [r['method'], f'{r["alpha"]:.2f}']
    cells += [f'{r[f"{t}_acc_sum"]:.3f} / {r[f"{t}_acc_mean"]:.3f}'
              for t in tasks]
    cells += [f'{r["kl"]:.4f}', f'{r["ce"]:.4f}',
              f'{r["norm_ratio_at"]:.3f} / {r["norm_ratio_last"]:.3f}',
              f'{r["trigger_rate"]:.3f}']
    if gen:
      cells += [f'{r["positive_share"]:.3f}', f'{r["vader_compound"]:.3f}',
                f'{r["distinct_2"]:.3f}', f'{r["repetition_3"]:.3f}',
                f'{r["gen_ce"]:.3f}']
    table.append(cells)
  return stats.markdown_table(head, table, '-' * len(head)) + '\n'
