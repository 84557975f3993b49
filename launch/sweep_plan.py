"""Moved to train.jobs.sweep_plan (this alias goes once every importer is moved)."""
import sys

from train.jobs import sweep_plan as _moved

sys.modules[__name__] = _moved
