"""Benchmarks of the AOT kernels against MLX's own path and the hardware floors (docs/benchmarks/)."""
