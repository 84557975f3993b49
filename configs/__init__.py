"""Experiment configs: each module defines `get_config(arg)`."""
