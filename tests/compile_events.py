"""The programs XLA compiles while a block runs, from jax.monitoring's
compile events: for tests that a path compiles nothing it should not."""

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def compiled() -> Iterator[list[str]]:
  """Yields a list that fills, inside the block, with the names
  (`jit(<function>)`) of the programs compiled there (a persistent-cache
  hit counts: it is a compile the process asked for)."""
  names = []

  def listener(event: str, duration: float, **kwargs) -> None:
    del duration
    if event.endswith('backend_compile_duration'):
      names.append(kwargs.get('fun_name'))
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
