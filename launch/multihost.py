"""Moved to train.jobs.multihost (this alias goes once every importer is moved)."""
import sys

from train.jobs import multihost as _moved

sys.modules[__name__] = _moved
