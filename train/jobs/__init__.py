"""What launch's entry points run: a job's exit codes and signals, flag checks
before JAX starts, multi-host start, compile watch and jobs, sweep plans.

launch/ holds only thin absl mains that call into this package.
"""
