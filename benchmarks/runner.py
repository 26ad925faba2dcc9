"""Timing: per layer inside a multi-layer step evaluated once, median of `steps` steps after warm-up."""

from __future__ import annotations

import gc
import os
import itertools
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx

from registry.core import SelectionContext, backend_of
from registry.kernels.rope_pool_fused import build
from registry.manifest import load_manifest

from .cases import CASES, DTYPES, SEED_LOOP_MAX_T, SHAPES, bytes_moved, make_layers, rope_for, step_fns


@dataclass
class Cell:
    shape: str
    tokens: int
    dtype: str
    variant: str
    implementation: str                   # what `fused` ran: native-cuda / native-cpu / reference
    us_per_layer: dict[str, float] = field(default_factory=dict)
    bytes_per_layer: int = 0

    def speedup_vs_mlx(self) -> float | None:
        f, m = self.us_per_layer.get("fused"), self.us_per_layer.get("mlx")
        return m / f if f and m else None

    def ratio_to_trivial(self) -> float | None:
        f, t = self.us_per_layer.get("fused"), self.us_per_layer.get("trivial")
        return f / t if f and t else None

    def bandwidth_gbs(self, case: str = "fused") -> float | None:
        us = self.us_per_layer.get(case)
        return self.bytes_per_layer / us / 1e3 if us else None

    def bandwidth_share(self) -> float | None:
        f, c = self.bandwidth_gbs("fused"), self.bandwidth_gbs("copy")
        return f / c if f and c else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(speedup_vs_mlx=self.speedup_vs_mlx(), ratio_to_trivial=self.ratio_to_trivial(),
                 fused_gbs=self.bandwidth_gbs("fused"), copy_gbs=self.bandwidth_gbs("copy"),
                 bandwidth_share=self.bandwidth_share())
        return d


def time_steps(fns: dict[str, Callable[[], None]], steps: int, warmup: int, rounds: int = 3) -> dict[str, float]:
    """Median seconds of one step (graph building + evaluation) per case. Cases are timed in
    interleaved rounds so that a transient slowdown of the host hits every case alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    mx.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    per_round = max(1, -(-steps // rounds))
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                mx.synchronize()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def host_info() -> dict:
    info = {"host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
            "mlx": mx.__version__, "device": str(mx.default_device()), "backend": backend_of(None)}
    try:
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        info["gpu"] = None
    if info["backend"] == "metal":
        info["gpu"] = mx.metal.device_info().get("architecture")
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except OSError:
        info["commit"] = None
    # A copy of the tree without .git (e.g. a remote benchmark host) can be told its commit.
    info["commit"] = info["commit"] or os.environ.get("GIT_COMMIT")
    return info


def run(shapes, tokens, dtypes, variants, cases=CASES, layers: int = 32, steps: int = 20, warmup: int = 3,
        progress: Callable[[int, int, Cell], None] | None = None) -> list[Cell]:
    spec = load_manifest().kernel("rope_pool_fused")
    backend = backend_of(None)
    grid = list(itertools.product(shapes, tokens, dtypes, variants))
    cells = []
    for i, (shape_name, T, dtype_name, variant) in enumerate(grid, 1):
        shape = SHAPES[shape_name]
        dtype = DTYPES[dtype_name]
        rope = rope_for(shape, variant)
        ctx = SelectionContext(attention="mha", rope=rope, rope_error="", n_heads=shape.n_q_heads,
                               n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim, dtype=dtype_name,
                               backend=backend)
        kernel = build(spec, ctx)
        data, positions, slots = make_layers(shape, T, dtype, layers, seed=i)
        nbytes = bytes_moved(shape, T, dtype.size)
        copy_src = mx.zeros((max(1, nbytes // (2 * dtype.size)),), dtype=dtype)
        mx.eval(copy_src)
        fns = step_fns(kernel, rope, data, positions, slots, copy_src)
        cell = Cell(shape_name, T, dtype_name, variant, kernel.implementation, bytes_per_layer=nbytes)
        chosen = {c: fns[c] for c in cases if not (c == "seed_loop" and T > SEED_LOOP_MAX_T)}
        for case, seconds in time_steps(chosen, steps, warmup).items():
            cell.us_per_layer[case] = seconds / layers * 1e6
        cells.append(cell)
        if progress:
            progress(i, len(grid), cell)
        del data, fns, copy_src
        gc.collect()
    return cells
