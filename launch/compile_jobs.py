"""Moved to train.jobs.compile_jobs (this alias goes once every importer is moved)."""
import sys

from train.jobs import compile_jobs as _moved

sys.modules[__name__] = _moved
