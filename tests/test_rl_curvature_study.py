"""studies.rl_curvature: the stored report rebuilds byte for byte from its
JSON, the loss it measures is the sampled answers' log-likelihood, and
(slow) the README's command runs at smoke size on the suite's SFT warm
start (a subprocess: the studies' absl flags share names)."""

import json
import os

import jax
import numpy as np
import pytest

from studies.rl_curvature import measure
from studies.rl_curvature import report
from tests import host_params
from tests import launch_runs
from train.lm import decoder as decoder_lm
from train.rl import tasks

RESULTS = os.path.join(launch_runs.REPO_ROOT, 'studies', 'rl_curvature',
                       'results')


def test_the_stored_report_rebuilds_from_its_json():
  with open(os.path.join(RESULTS, 'rl_curvature.json')) as f:
    results = json.load(f)
  with open(os.path.join(RESULTS, 'rl_curvature.md')) as f:
    text = f.read()
  assert report.table(results) == text == results['table']


def test_the_measured_loss_is_the_sampled_answers_log_likelihood():
  """`measure.on_policy_batch` and `measure.nll_loss` on a tiny random
  policy: the loss is minus the mean log-probability the sampler recorded
  for the answer tokens it drew (an independent path: the cached decoding
  loop's own log-probs), padding to a longer batch changes nothing, and
  the batch holds `samples` completions of each of `prompts` problems.
  geom's estimators of its curvature are test_curvature's."""
  model = decoder_lm.DecoderLM(vocab_size=256, d_model=32, num_layers=1,
                               num_heads=2, mlp_dim=64, max_len=32)
  params = host_params.draw(model, 0)
  length = tasks.max_prompt_tokens('add', 2) + tasks.max_answer_tokens(
      'add', 2)
  losses = []
  for extra in (0, 3):
    batch, out = measure.on_policy_batch(model, params, 'add', 2, 2, 3,
                                         length + extra, 0,
                                         jax.random.key(4))
    assert len(out.rewards) == 6
    assert [p.expression for p in out.problems[::3]] == [
        p.expression for p in tasks.sample('add', 2, 2, 0)]
    mask = np.asarray(out.completion_mask)
    assert mask.sum() > 0
    want = -float((out.behaviour_logps * mask).sum()) / float(mask.sum())
    losses.append(float(jax.jit(lambda p, b: measure.nll_loss(model, b)(p))(
        params, batch)))
    assert losses[-1] == pytest.approx(want, rel=1e-5, abs=1e-5)
  assert losses[0] == pytest.approx(losses[1], rel=1e-6)


# Slow (`make test-all`): the study's launcher on the session's SFT warm
# start (a policy load and three compiled estimators). The default suite's
# cover: the loss (above), geom's estimators (test_curvature) and the
# report (the stored one rebuilds, above).
@pytest.mark.slow
def test_the_readme_command_runs_at_smoke_size(sft_policy_run, tmp_path):
  out = tmp_path / 'curvature.json'
  result = launch_runs.run_module(
      'studies.rl_curvature', f'--sft_workdirs={sft_policy_run[0]}',
      '--difficulties=1,2', '--prompts=2', '--samples=2', '--num_iters=3',
      '--check_iters=3', f'--out={out}', timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(out) as f:
    results = json.load(f)
  with open(tmp_path / 'curvature.md') as f:
    text = f.read()
  assert report.table(results) == text == results['table']
  assert text in result.stdout
  (run,) = results['runs']
  assert [r['difficulty'] for r in run['rows']] == [1, 2]
  assert all(r['power'] > 0 and r['rayleigh'] >= 0 for r in run['rows'])
