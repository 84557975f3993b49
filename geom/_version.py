"""geom's version: the one place it is written.

pyproject.toml reads it (setuptools' dynamic version parses this file
without importing geom), so `geom.__version__` and the installed
distribution's metadata (`importlib.metadata.version('geom')`) agree; the
Makefile reinstalls geom when this file changes.
"""

__version__ = '0.1.0'
