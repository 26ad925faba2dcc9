"""Timing: per layer inside a multi-layer step evaluated once, median of `steps` steps after warm-up."""

from __future__ import annotations

import datetime
import gc
import itertools
import os
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

from .cases import (CASES, DTYPES, SEED_LOOP_MAX_T, SHAPES, bytes_moved, check_agreement, make_layers,
                    rope_for, step_builders)


@dataclass
class Cell:
    shape: str
    tokens: int
    dtype: str
    variant: str
    implementation: str                   # what `fused` ran: native-cuda / native-cpu / reference
    us_per_layer: dict[str, float] = field(default_factory=dict)       # whole step: build + evaluate
    eval_us_per_layer: dict[str, float] = field(default_factory=dict)  # mx.eval alone
    bytes_per_layer: int = 0

    def _times(self, which: str) -> dict[str, float]:
        return self.us_per_layer if which == "step" else self.eval_us_per_layer

    def speedup_vs_mlx(self, which: str = "step") -> float | None:
        t = self._times(which)
        f, m = t.get("fused"), t.get("mlx")
        return m / f if f and m else None

    def ratio_to_trivial(self, which: str = "step") -> float | None:
        t = self._times(which)
        f, triv = t.get("fused"), t.get("trivial")
        return f / triv if f and triv else None

    def bandwidth_gbs(self, case: str = "fused", which: str = "step") -> float | None:
        us = self._times(which).get(case)
        return self.bytes_per_layer / us / 1e3 if us else None

    def bandwidth_share(self, which: str = "step") -> float | None:
        f, c = self.bandwidth_gbs("fused", which), self.bandwidth_gbs("copy", which)
        return f / c if f and c else None

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(speedup_vs_mlx=self.speedup_vs_mlx(), ratio_to_trivial=self.ratio_to_trivial(),
                 fused_gbs=self.bandwidth_gbs("fused"), copy_gbs=self.bandwidth_gbs("copy"),
                 bandwidth_share=self.bandwidth_share(),
                 eval_speedup_vs_mlx=self.speedup_vs_mlx("eval"), eval_ratio_to_trivial=self.ratio_to_trivial("eval"),
                 eval_bandwidth_share=self.bandwidth_share("eval"))
        return d


def time_steps(builders: dict[str, Callable[[], list]], steps: int, warmup: int, rounds: int = 3
               ) -> dict[str, tuple[float, float]]:
    """(median seconds of a whole step, median seconds of its mx.eval) per case. A step is timed from
    the first graph-building call to the end of evaluation, after mx.synchronize() so nothing earlier
    is still running. Cases alternate in `rounds` rounds so that a transient slowdown of the host hits
    every case alike; the garbage collector is paused while timing."""
    for build_step in builders.values():
        for _ in range(warmup):
            mx.eval(build_step())
    mx.synchronize()
    step: dict[str, list[float]] = {name: [] for name in builders}
    evals: dict[str, list[float]] = {name: [] for name in builders}
    per_round = -(-steps // rounds)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, build_step in builders.items():
                for _ in range(per_round):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    outs = build_step()
                    t1 = time.perf_counter()
                    mx.eval(outs)
                    mx.synchronize()
                    t2 = time.perf_counter()
                    del outs
                    step[name].append(t2 - t0)
                    evals[name].append(t2 - t1)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: (statistics.median(step[name]), statistics.median(evals[name])) for name in builders}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def host_info(commit: str | None = None) -> dict:
    """Where and when the numbers come from. `commit` overrides git (a tree copied without .git)."""
    backend = backend_of(None)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host": platform.node(), "platform": platform.platform(), "python": sys.version.split()[0],
            "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "mlx": mx.__version__,
            "device": str(mx.default_device()), "backend": backend, "gpu": None,
            "commit": commit or _git("describe", "--always", "--dirty", "--abbrev=7")}
    if backend == "cuda":
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            info["gpu"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            pass
        info["gpu"] = info["gpu"] or "CUDA device"
    elif backend == "metal":
        info["gpu"] = str(mx.metal.device_info().get("architecture"))
    if hasattr(os, "getloadavg"):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def run(shapes, tokens, dtypes, variants, cases=CASES, layers: int = 32, steps: int = 20, warmup: int = 3,
        progress: Callable[[int, int, Cell], None] | None = None, check: bool = True) -> list[Cell]:
    """Time every (shape, T, dtype, variant) cell; `check` first verifies fused against MLX's path."""
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
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
        if check and ("fused" in cases or "mlx" in cases):
            check_agreement(kernel, rope, data[0], positions, slots, dtype_name)
        builders = step_builders(kernel, rope, data, positions, slots)
        chosen = {c: builders[c] for c in cases if not (c == "seed_loop" and T > SEED_LOOP_MAX_T)}
        cell = Cell(shape_name, T, dtype_name, variant, kernel.implementation,
                    bytes_per_layer=bytes_moved(shape, T, dtype.size))
        for case, (step_s, eval_s) in time_steps(chosen, steps, warmup).items():
            cell.us_per_layer[case] = step_s / layers * 1e6
            cell.eval_us_per_layer[case] = eval_s / layers * 1e6
        cells.append(cell)
        if progress:
            progress(i, len(grid), cell)
        del data, builders, chosen
        gc.collect()
    return cells
