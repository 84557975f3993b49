"""Benchmarks of the training loops against minimal loops: the trainer,
Gemma 3 fine-tuning, and test-time adaptation."""
