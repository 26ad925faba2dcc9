from .cli import bench

bench(prog_name="python -m benchmarks")
