"""Asynchronous GRPO: verifiable arithmetic tasks, the GRPO objective and its off-policy corrections."""
