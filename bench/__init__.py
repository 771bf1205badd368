"""Benchmarks, the demos and the simulations they run: not installed with blockd."""
