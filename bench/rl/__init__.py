"""Benchmarks of the RL runtime: throughput, GAS scheduling, weight
transfers across processes, memory, and the pod-scale simulator."""
