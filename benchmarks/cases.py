"""What the benchmark measures: shapes, RoPE variants and the competing implementations.

Every case does one layer's worth of work; the runner chains `layers` of them (distinct inputs, pools
and copy sources per layer) into one step that is evaluated once, as an engine's decode or prefill
step would be. Each builder returns the step's outputs without evaluating them, so the runner can
time graph building and evaluation separately.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from registry.rope import RopeConfig


MAX_LAYERS = 256                 # the --layers range of bench and the argparse scripts (graph_count, pool_layout)


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """argparse `type=`: an integer from lo to hi, else a usage error naming the flag."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = lo - 1
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer from {lo} to {hi}")
        return n
    return parse


layer_count = int_in(1, MAX_LAYERS)   # --layers (and other per-step counts) of the argparse scripts


def memory_budget() -> int:
    """Half of this machine's physical memory in bytes: the most the benchmarks' pools may take."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class BenchmarkError(RuntimeError):
    """The benchmark cannot produce a trustworthy number (e.g. the fused kernel disagrees with MLX)."""


@dataclass(frozen=True)
class Shape:
    name: str
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dims: int


SHAPES = {s.name: s for s in (
    Shape("llama-8b", 32, 8, 128, 128),
    Shape("qwen2.5-7b", 28, 4, 128, 128),
    Shape("qwen3-0.6b", 16, 8, 128, 128),
    Shape("gemma-2b", 8, 1, 256, 256),
    Shape("phi-4-mini-partial", 24, 8, 128, 96),
)}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
VARIANTS = ("base", "freqs", "traditional")
CASES = ("fused", "mlx", "seed_loop", "trivial", "copy")
SEED_LOOP_MAX_T = 32   # the per-request loop is only meaningful (and affordable) for small batches
# Agreement of fused vs MLX's path before timing (one rounding of each to the storage dtype, fp32
# angles at positions of a few thousand): as tests/rope_cases.py.
AGREEMENT_TOL = {"float32": 3e-3, "float16": 6e-3, "bfloat16": 3e-2}
FIRST_POSITION = 3000  # positions continue a context of a few thousand tokens


def rope_for(shape: Shape, variant: str) -> RopeConfig:
    r = shape.rotary_dims
    if variant == "base":
        return RopeConfig(r, base=500000.0)
    if variant == "freqs":  # a llama3-style banded table: periods, as mx.fast.rope takes them
        periods = 500000.0 ** (np.arange(0, r, 2) / r)
        periods = np.where(periods * 2 * np.pi > 8192, periods * 8.0, periods)
        return RopeConfig(r, base=None, periods=tuple(float(p) for p in periods))
    if variant == "traditional":
        return RopeConfig(r, traditional=True, base=10000.0)
    raise KeyError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def pool_size(T: int) -> int:
    """Pool rows: room for the step's tokens with headroom, never a toy pool."""
    return max(4096, 2 * T)


def bytes_moved(shape: Shape, T: int, itemsize: int) -> int:
    """Compulsory traffic of the fused kernel: read q, k, v; write q_out, k_out, and a k and a v pool row
    per token (positions, slots and the frequency table are negligible)."""
    q = T * shape.n_q_heads * shape.head_dim
    kv = T * shape.n_kv_heads * shape.head_dim
    return (2 * q + 3 * kv + 2 * kv) * itemsize


def copy_elements(shape: Shape, T: int) -> int:
    """Elements of the copy floor's source: copying it reads and writes bytes_moved() bytes in all."""
    q = T * shape.n_q_heads * shape.head_dim
    kv = T * shape.n_kv_heads * shape.head_dim
    return q + (5 * kv + 1) // 2


@dataclass
class LayerData:
    q: mx.array
    k: mx.array
    v: mx.array
    k_pool: mx.array
    v_pool: mx.array
    copy_src: mx.array


def make_layers(shape: Shape, T: int, dtype, layers: int, seed: int = 0
                ) -> tuple[list[LayerData], mx.array, mx.array]:
    """Distinct per-layer inputs, pools and copy sources, all evaluated (so a step times only its own
    kernels, and no layer reads another layer's data from cache). Slots are a random injection into
    the pool so every token writes its own row; positions start at FIRST_POSITION."""
    S = pool_size(T)
    n_copy = copy_elements(shape, T)
    out = []
    for i in range(layers):
        ks = mx.random.split(mx.random.key(seed * 1000 + i), 4)
        mk = lambda key, *s: mx.random.normal(s, key=key).astype(dtype)
        out.append(LayerData(mk(ks[0], T, shape.n_q_heads, shape.head_dim),
                             mk(ks[1], T, shape.n_kv_heads, shape.head_dim),
                             mk(ks[2], T, shape.n_kv_heads, shape.head_dim),
                             mx.zeros((S, shape.n_kv_heads, shape.head_dim), dtype=dtype),
                             mx.zeros((S, shape.n_kv_heads, shape.head_dim), dtype=dtype),
                             mk(ks[3], n_copy)))
        mx.eval(out[-1].q, out[-1].k, out[-1].v, out[-1].k_pool, out[-1].v_pool, out[-1].copy_src)
    rng = np.random.default_rng(seed)
    slots = mx.array(rng.permutation(S)[:T].astype(np.int32))
    positions = mx.array((FIRST_POSITION + np.arange(T)).astype(np.int32))
    mx.eval(slots, positions)
    return out, positions, slots


def _mlx_rotate(x: mx.array, positions: mx.array, rope: RopeConfig, periods: mx.array | None) -> mx.array:
    kw = dict(base=rope.base) if periods is None else dict(base=None, freqs=periods)
    return mx.fast.rope(x[:, :, None, :], rope.rotary_dims, traditional=rope.traditional, scale=rope.pos_scale,
                        offset=positions, **kw)[:, :, 0, :]


def mlx_layer(d: LayerData, positions, slots, rope: RopeConfig, periods) -> list[mx.array]:
    """MLX's own path for one layer: mx.fast.rope on q and k with per-token offsets, then the two
    scatters. `d` is the pools' only owner, so MLX donates the pool buffers and scatters in place."""
    q = _mlx_rotate(d.q, positions, rope, periods)
    k = _mlx_rotate(d.k, positions, rope, periods)
    d.k_pool[slots] = k
    d.v_pool[slots] = d.v
    return [q, k, d.k_pool, d.v_pool]


def fused_layer(launch, d: LayerData, positions, slots) -> list[mx.array]:
    """`launch`: the kernel's `last_bound()` stream, the hot path an engine uses (no slot check)."""
    q, k, d.k_pool, d.v_pool = launch(d.q, d.k, d.v, positions, slots, d.k_pool, d.v_pool)
    return [q, k, d.k_pool, d.v_pool]


def step_builders(kernel, rope: RopeConfig, layers: list[LayerData], positions: mx.array, slots: mx.array
                  ) -> dict[str, Callable[[], list[mx.array]]]:
    """One callable per case; each builds the whole multi-layer step lazily and returns what to evaluate."""
    periods = None if rope.periods is None else mx.array(rope.periods_array())
    host_slots = [int(s) for s in np.array(slots)]  # the seed looked slots up on the host

    launch = kernel.last_bound()

    def fused():
        return [a for d in layers for a in fused_layer(launch, d, positions, slots)]

    def mlx_path():
        return [a for d in layers for a in mlx_layer(d, positions, slots, rope, periods)]

    def seed_loop():
        # The seed design's decode path: vectorised mx.fast.rope on q and k, then a Python loop over
        # the requests writing each one's K and V row at its (host-known) slot: 2 + 2T ops per layer.
        outs = []
        for d in layers:
            q = _mlx_rotate(d.q, positions, rope, periods)
            k = _mlx_rotate(d.k, positions, rope, periods)
            for t, s in enumerate(host_slots):
                d.k_pool[s] = k[t]
                d.v_pool[s] = d.v[t]
            outs += [q, k, d.k_pool, d.v_pool]
        return outs

    def trivial():
        # The per-op floor: the cheapest element-wise MLX op on the layer's q.
        return [d.q * 2 for d in layers]

    def copy():
        # The bandwidth floor: MLX's device copy (AsType to the same dtype, which runs the copy
        # kernel: the source is held by `d`, so it cannot be donated) of a per-layer source whose
        # read + write equals the bytes the fused kernel must move.
        return [mx.array(d.copy_src) for d in layers]

    return {"fused": fused, "mlx": mlx_path, "seed_loop": seed_loop, "trivial": trivial, "copy": copy}


def check_agreement(kernel, rope: RopeConfig, d: LayerData, positions: mx.array, slots: mx.array,
                    dtype_name: str) -> None:
    """Raise BenchmarkError unless the fused kernel and MLX's path agree on one layer (q, k and both
    whole pools), on private copies of the pools: a fast wrong kernel must never be reported."""
    def fresh():
        pools = [mx.array(d.k_pool), mx.array(d.v_pool)]   # copies: the fused kernel updates in place
        mx.eval(pools)
        return LayerData(d.q, d.k, d.v, pools[0], pools[1], d.copy_src)

    periods = None if rope.periods is None else mx.array(rope.periods_array())
    got = fused_layer(kernel, fresh(), positions, slots)
    want = mlx_layer(fresh(), positions, slots, rope, periods)
    # fp32 angles lose about pos * 2^-23 rad each, in both implementations: widen with the largest position.
    tol = AGREEMENT_TOL[dtype_name] + int(mx.max(positions).item()) * 2.0 ** -21
    for name, g, w in zip(("q", "k", "k_pool", "v_pool"), got, want):
        g32, w32 = g.astype(mx.float32), w.astype(mx.float32)
        err = mx.max(mx.abs(g32 - w32) - tol * mx.abs(w32))
        if g.shape != w.shape or err.item() > tol:
            raise BenchmarkError(
                f"fused kernel ({getattr(kernel, 'implementation', '?')}) disagrees with MLX's path on {name}: "
                f"shape {g.shape} vs {w.shape}, max |fused - mlx| - {tol}*|mlx| = {err.item():.3g} > {tol}")
