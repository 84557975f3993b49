"""Knowledge probes: factual prompts and the model's answer to each.

Forgetting as held-out cross-entropy says how much worse a model predicts
text; these say whether it still knows facts it knew. Each probe is a
prompt and its answer (`FACTS`, written for this study: capitals,
chemistry, arithmetic facts, Python's built-ins, language), scored under
teacher forcing in one compiled call per model: the mean log-probability
of the answer's tokens given the prompt (nats per token), and the share
of probes whose every answer token is the model's argmax (greedy decoding
would produce the answer). The answers start with a space, as they
continue the prompt's text.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

FACTS = (
    ('The capital of France is', ' Paris'),
    ('The capital of Japan is', ' Tokyo'),
    ('The capital of Italy is', ' Rome'),
    ('The capital of Germany is', ' Berlin'),
    ('The capital of Spain is', ' Madrid'),
    ('The capital of Egypt is', ' Cairo'),
    ('The capital of Russia is', ' Moscow'),
    ('The capital of the United Kingdom is', ' London'),
    ('The largest planet in the solar system is', ' Jupiter'),
    ('The chemical symbol for gold is', ' Au'),
    ('The chemical symbol for iron is', ' Fe'),
    ('Water is made of hydrogen and', ' oxygen'),
    ('The freezing point of water in degrees Celsius is', ' 0'),
    ('The number of days in a week is', ' seven'),
    ('The opposite of hot is', ' cold'),
    ('The first month of the year is', ' January'),
    ('The color of the clear daytime sky is', ' blue'),
    ('Romeo and Juliet was written by William', ' Shakespeare'),
    ('The theory of relativity was developed by Albert', ' Einstein'),
    ('The Mona Lisa was painted by Leonardo da', ' Vinci'),
    ('In Python, the function that returns the length of a list is',
     ' len'),
    ('In Python, the keyword that defines a function is', ' def'),
    ('In Python, the value of True and False is', ' False'),
    ('The square root of 81 is', ' 9'),
    ('Ten times ten is', ' one hundred'),
    ('The tallest mountain on Earth is Mount', ' Everest'),
    ('The longest river in Africa is the', ' Nile'),
    ('The currency of the United States is the', ' dollar'),
    ('A baby cat is called a', ' kitten'),
    ('The plural of mouse is', ' mice'),
    ('Paris is a city in', ' France'),
    ('The sun rises in the', ' east'),
)


def encode(tokenizer, bos: int, facts=FACTS) -> tuple[np.ndarray, np.ndarray]:
  """(tokens (N, L + 1), answer mask (N, L)): BOS + prompt + answer,
  right-padded with the answer's last token (masked out); the mask marks
  the positions whose next token is an answer token."""
  rows = []
  for prompt, answer in facts:
    head = [bos] + [int(t) for t in tokenizer.encode(prompt)]
    tail = [int(t) for t in tokenizer.encode(answer)]
    if not tail:
      raise ValueError(f'the answer {answer!r} of {prompt!r} has no tokens')
    rows.append((head, tail))
  length = max(len(h) + len(t) for h, t in rows) - 1
  tokens = np.zeros((len(rows), length + 1), np.int32)
  mask = np.zeros((len(rows), length), np.float32)
  for i, (head, tail) in enumerate(rows):
    full = head + tail
    tokens[i, :len(full)] = full
    tokens[i, len(full):] = full[-1]
    mask[i, len(head) - 1:len(full) - 1] = 1.0
  return tokens, mask


@functools.cache
def _scores_fn(model):

  @jax.jit
  def scores(params, tokens, mask):
    logits, _ = model.apply({'params': params}, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    target = tokens[:, 1:]
    picked = jnp.take_along_axis(logp, target[..., None], -1)[..., 0]
    hit = jnp.argmax(logits, -1) == target
    per_probe = (picked * mask).sum(-1) / mask.sum(-1)
    known = jnp.all(hit | (mask == 0), -1)
    return per_probe, known
  return scores


def score(model, params, tokens: np.ndarray, mask: np.ndarray) -> dict:
  """{'logprob': mean over probes of the answer's mean log-probability
  per token, 'known': share of probes answered greedily}."""
  if model.max_len < tokens.shape[1]:
    model = model.clone(max_len=tokens.shape[1])
  per_probe, known = _scores_fn(model)(params, jnp.asarray(tokens),
                                       jnp.asarray(mask))
  return dict(logprob=float(np.mean(np.asarray(per_probe))),
              known=float(np.mean(np.asarray(known))))
