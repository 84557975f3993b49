"""Moved to train.jobs.trainers (this alias goes once every importer is moved)."""
import sys

from train.jobs import trainers as _moved

sys.modules[__name__] = _moved
