"""Evaluation: tasks, prompt layouts, accuracy sweeps, benchmarks."""
