"""The run core: a workdir's lock, checkpoints (Orbax and the learner's
local back-end), their checks, metrics logs, stop signals and resume."""
