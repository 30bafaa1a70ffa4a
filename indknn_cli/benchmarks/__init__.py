"""Benchmarks of `indknn bench` (see experiments.py)."""
