"""Micro benchmarks of the kernels after rope_pool_fused, against the MLX path they replace:

- qk_norm_rope_pool_fused vs 2 mx.fast.rms_norm + 2 mx.fast.rope (per-token offsets) + 2 scatters;
- kv_pool_store vs the two scatters.

Same method as the rope_pool_fused benchmark (runner.time_steps): per layer inside a `layers`-layer
step evaluated once, median of `steps` steps, distinct data per layer, agreement checked before timing.
`python -m build_tools bench --kernel qk_norm_rope_pool_fused|kv_pool_store` runs it.
"""

from __future__ import annotations

import gc
import itertools
from dataclasses import asdict, dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from registry.core import backend_of
from registry.kernels.kv_pool_store import KvPoolStoreKernel
from registry.kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel
from registry.manifest import load_manifest
from registry.native import device_indices
from registry.norm import NormConfig

from .cases import AGREEMENT_TOL, DTYPES, FIRST_POSITION, SHAPES, BenchmarkError, Shape, pool_size, rope_for
from .runner import time_steps

KERNELS = ("qk_norm_rope_pool_fused", "kv_pool_store")
MICRO_CASES = ("fused", "mlx")
NORM = NormConfig(1e-6, 0.0)


@dataclass
class MicroCell:
    kernel: str
    shape: str
    tokens: int
    dtype: str
    implementation: str
    us_per_layer: dict[str, float] = field(default_factory=dict)
    eval_us_per_layer: dict[str, float] = field(default_factory=dict)

    def speedup(self, which: str = "step") -> float | None:
        t = self.us_per_layer if which == "step" else self.eval_us_per_layer
        return t["mlx"] / t["fused"] if t.get("fused") and t.get("mlx") else None

    def to_json(self) -> dict:
        return dict(asdict(self), speedup_vs_mlx=self.speedup(), eval_speedup_vs_mlx=self.speedup("eval"))


@dataclass
class Layer:
    q: mx.array
    k: mx.array
    v: mx.array
    k_pool: mx.array
    v_pool: mx.array
    q_weight: mx.array
    k_weight: mx.array


def _layers(shape: Shape, T: int, dtype, n: int, seed: int) -> list[Layer]:
    S = pool_size(T)
    out = []
    for i in range(n):
        ks = mx.random.split(mx.random.key(seed * 1000 + i), 5)
        mk = lambda key, *s: mx.random.normal(s, key=key).astype(dtype)
        H, Hkv, D = shape.n_q_heads, shape.n_kv_heads, shape.head_dim
        layer = Layer(mk(ks[0], T, H, D), mk(ks[1], T, Hkv, D), mk(ks[2], T, Hkv, D),
                      mx.zeros((S, Hkv, D), dtype), mx.zeros((S, Hkv, D), dtype),
                      1 + 0.1 * mk(ks[3], D), 1 + 0.1 * mk(ks[4], D))
        mx.eval(*asdict(layer).values())
        out.append(layer)
    return out


def _mlx_rope(x, positions, rope):
    kw = dict(base=rope.base) if rope.periods is None else dict(base=None, freqs=mx.array(rope.periods_array()))
    return mx.fast.rope(x[:, :, None, :], rope.rotary_dims, traditional=rope.traditional, scale=rope.pos_scale,
                        offset=positions, **kw)[:, :, 0, :]


def _steps(kernel_name: str, kernel, rope, layers: list[Layer], positions, slots) -> dict[str, Callable]:
    launch = kernel.last_bound()          # the hot path an engine uses (no slot check)
    if kernel_name == "kv_pool_store":
        def fused():
            outs = []
            for d in layers:
                d.k_pool, d.v_pool = launch(d.k, d.v, slots, d.k_pool, d.v_pool)
                outs += [d.k_pool, d.v_pool]
            return outs

        def mlx_path():   # the two scatters; `d` is the pools' only owner, so MLX scatters in place
            outs = []
            for d in layers:
                d.k_pool[slots] = d.k
                d.v_pool[slots] = d.v
                outs += [d.k_pool, d.v_pool]
            return outs
    else:
        def fused():
            outs = []
            for d in layers:
                q, k, d.k_pool, d.v_pool = launch(d.q, d.k, d.v, positions, slots, d.k_pool, d.v_pool, d.q_weight,
                                                  d.k_weight)
                outs += [q, k, d.k_pool, d.v_pool]
            return outs

        def mlx_path():   # the model's own path: 2 rms_norm + 2 rope + 2 scatters
            outs = []
            for d in layers:
                q = _mlx_rope(mx.fast.rms_norm(d.q, d.q_weight, NORM.eps), positions, rope)
                k = _mlx_rope(mx.fast.rms_norm(d.k, d.k_weight, NORM.eps), positions, rope)
                d.k_pool[slots] = k
                d.v_pool[slots] = d.v
                outs += [q, k, d.k_pool, d.v_pool]
            return outs
    return {"fused": fused, "mlx": mlx_path}


def _check(kernel_name, kernel, rope, d: Layer, positions, slots, dtype_name) -> None:
    """Fused and MLX's path agree on one layer (private pool copies) before anything is timed."""
    fresh = lambda: Layer(d.q, d.k, d.v, mx.array(d.k_pool), mx.array(d.v_pool), d.q_weight, d.k_weight)
    got, want = (_steps(kernel_name, kernel, rope, [fresh()], positions, slots)[c]() for c in MICRO_CASES)
    tol = AGREEMENT_TOL[dtype_name] * 2 + int(mx.max(positions).item()) * 2.0 ** -21
    for i, (g, w) in enumerate(zip(got, want)):
        g32, w32 = g.astype(mx.float32), w.astype(mx.float32)
        err = mx.max(mx.abs(g32 - w32) - tol * mx.abs(w32)).item()
        if g.shape != w.shape or err > tol:
            raise BenchmarkError(f"{kernel_name} ({kernel.implementation}) disagrees with MLX's path on output {i}: "
                                 f"max |fused - mlx| - {tol}*|mlx| = {err:.3g}")


def run(kernel_name: str, shapes, tokens, dtypes, layers: int = 32, steps: int = 20, warmup: int = 3,
        progress: Callable[[int, int, MicroCell], None] | None = None, check: bool = True) -> list[MicroCell]:
    if kernel_name not in KERNELS:
        raise ValueError(f"unknown kernel {kernel_name!r}; choose from {', '.join(KERNELS)}")
    spec = load_manifest().kernel(kernel_name)
    backend = backend_of(None)
    grid = list(itertools.product(shapes, tokens, dtypes))
    cells = []
    for i, (shape_name, T, dtype_name) in enumerate(grid, 1):
        shape = SHAPES[shape_name]
        rope = rope_for(shape, "base")
        cls = KvPoolStoreKernel if kernel_name == "kv_pool_store" else QkNormRopePoolFusedKernel
        kernel = cls.build(spec, cls.context_for(None if cls is KvPoolStoreKernel else (rope, NORM), backend))
        data = _layers(shape, T, DTYPES[dtype_name], layers, seed=i)
        rng = np.random.default_rng(i)
        # In device memory, as the integrations make them (registry.native.device_indices; on CUDA an
        # array made from host data is managed memory, which every kernel of both sides would read
        # across the bus).
        positions, slots = device_indices(backend, FIRST_POSITION + np.arange(T), rng.permutation(pool_size(T))[:T])
        mx.eval(positions, slots)
        if check:
            _check(kernel_name, kernel, rope, data[0], positions, slots, dtype_name)
        cell = MicroCell(kernel_name, shape_name, T, dtype_name, kernel.implementation)
        for case, (step_s, eval_s) in time_steps(_steps(kernel_name, kernel, rope, data, positions, slots),
                                                 steps, warmup).items():
            cell.us_per_layer[case] = step_s / layers * 1e6
            cell.eval_us_per_layer[case] = eval_s / layers * 1e6
        cells.append(cell)
        if progress:
            progress(i, len(grid), cell)
        del data
        gc.collect()
    return cells


HEADER = (f"{'kernel':<24} {'shape':<20} {'T':>5} {'dtype':<9} {'impl':<12} {'fused us':>9} {'mlx us':>9} "
          f"{'speedup':>8} {'eval speedup':>12}")


def row(c: MicroCell) -> str:
    s, e = c.speedup(), c.speedup("eval")
    return (f"{c.kernel:<24} {c.shape:<20} {c.tokens:>5} {c.dtype:<9} {c.implementation:<12} "
            f"{c.us_per_layer['fused']:>9.2f} {c.us_per_layer['mlx']:>9.2f} {s:>7.2f}x {e:>11.2f}x")
