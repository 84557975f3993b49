"""Moved to train.jobs.compile_watch (this alias goes once every importer is moved)."""
import sys

from train.jobs import compile_watch as _moved

sys.modules[__name__] = _moved
