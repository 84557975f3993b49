"""The run's metrics log (`train.run.metrics`): what survives a crash or a
damaged block, and what JSON cannot hold."""

import json

from train.run import metrics


def test_a_line_that_is_not_utf8_is_dropped_on_resume(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_bytes(b'{"step": 1, "loss": 0.5}\n'
                   b'{"step": 2, "loss": 0.\xff4}\n'  # A damaged block.
                   b'{"step": 3, "loss": 0.25}\n{"step": 4, "loss": 0.2}\n')
  assert metrics.read_jsonl(str(path)) == [
      {'step': 1, 'loss': 0.5}, {'step': 3, 'loss': 0.25},
      {'step': 4, 'loss': 0.2}]
  writer = metrics.MetricWriter(str(tmp_path), resume_step=3)
  writer.close()
  assert path.read_text() == ('{"step": 1, "loss": 0.5}\n'
                              '{"step": 3, "loss": 0.25}\n')


def _strict(text):
  def refuse(name):
    raise ValueError(f'not JSON: {name}')
  return json.loads(text, parse_constant=refuse)


def test_non_finite_metrics_are_written_as_null(tmp_path):
  path = str(tmp_path / 'final.json')
  metrics.write_json_atomic(path, {'step': 3, 'test_loss': float('nan'),
                                   'val_loss': float('inf'), 'ok': 0.5})
  with open(path) as f:
    assert _strict(f.read()) == {'step': 3, 'test_loss': None,
                                 'val_loss': None, 'ok': 0.5}
  writer = metrics.MetricWriter(str(tmp_path), resume_step=None)
  writer.write(1, {'train_loss': float('nan'), 'grad_norm': -float('inf')})
  writer.close()
  with open(tmp_path / 'metrics.jsonl') as f:
    assert [_strict(l) for l in f] == [
        {'step': 1, 'train_loss': None, 'grad_norm': None}]
  assert metrics.read_jsonl(str(tmp_path / 'metrics.jsonl')) == [
      {'step': 1, 'train_loss': None, 'grad_norm': None}]
