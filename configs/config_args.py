"""Parsing a config argument, `--config=configs/x.py:key=value,flag`."""


def parse(arg: str | None, module: str, valid: dict[str, str]) -> dict[str, str]:
  """{key: value} of a comma-separated argument ('flag' alone means 'true').

  Args:
    arg: the text after ':' (None or '' for none).
    module: the config file, for the message.
    valid: the accepted keys, each with how it is written in the message.

  Raises:
    ValueError: a key not in `valid`, naming it and listing the valid ones.
  """
  out = {}
  for item in filter(None, (arg or '').split(',')):
    key, _, value = item.partition('=')
    out[key] = value or 'true'
  unknown = sorted(set(out) - set(valid))
  if unknown:
    raise ValueError(f'{module}: unknown config argument {unknown[0]!r}; '
                     f'valid: {", ".join(valid.values())}')
  return out
