"""What the benchmark measures: shapes, RoPE variants and the competing implementations.

Every case runs one layer's worth of work; the runner chains `layers` of them (distinct inputs and
pools per layer) into one step evaluated once, as an engine's decode or prefill step would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from registry.rope import RopeConfig


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


@dataclass
class LayerData:
    q: mx.array
    k: mx.array
    v: mx.array
    k_pool: mx.array
    v_pool: mx.array


def make_layers(shape: Shape, T: int, dtype, layers: int, seed: int = 0) -> tuple[list[LayerData], mx.array, mx.array]:
    """Distinct per-layer inputs and pools (pool size max(4096, 2T)); slots are a permutation so that
    every token writes its own row, positions continue a context of a few thousand tokens."""
    S = max(4096, 2 * T)
    out = []
    for i in range(layers):
        ks = mx.random.split(mx.random.key(seed * 1000 + i), 3)
        mk = lambda k, *s: mx.random.normal(s, key=k).astype(dtype)
        out.append(LayerData(mk(ks[0], T, shape.n_q_heads, shape.head_dim), mk(ks[1], T, shape.n_kv_heads, shape.head_dim),
                             mk(ks[2], T, shape.n_kv_heads, shape.head_dim),
                             mx.zeros((S, shape.n_kv_heads, shape.head_dim), dtype=dtype),
                             mx.zeros((S, shape.n_kv_heads, shape.head_dim), dtype=dtype)))
    rng = np.random.default_rng(seed)
    slots = mx.array(rng.permutation(S)[:T].astype(np.int32))
    positions = mx.array((3000 + np.arange(T)).astype(np.int32))
    mx.eval([[d.q, d.k, d.v, d.k_pool, d.v_pool] for d in out], slots, positions)
    return out, positions, slots


def bytes_moved(shape: Shape, T: int, itemsize: int) -> int:
    """Compulsory traffic of the fused kernel: read q, k, v; write q_out, k_out, and a k and a v pool row
    per token (positions, slots and the frequency table are negligible)."""
    q = T * shape.n_q_heads * shape.head_dim
    kv = T * shape.n_kv_heads * shape.head_dim
    return (2 * q + 3 * kv + 2 * kv) * itemsize


def _mlx_rotate(x: mx.array, positions: mx.array, rope: RopeConfig, periods: mx.array | None) -> mx.array:
    kw = dict(base=rope.base) if periods is None else dict(base=None, freqs=periods)
    return mx.fast.rope(x[:, :, None, :], rope.rotary_dims, traditional=rope.traditional, scale=rope.pos_scale,
                        offset=positions, **kw)[:, :, 0, :]


def step_fns(kernel, rope: RopeConfig, layers: list[LayerData], positions: mx.array, slots: mx.array,
             copy_src: mx.array) -> dict[str, Callable[[], None]]:
    """One callable per case; each builds the whole multi-layer step and evaluates it once."""
    periods = None if rope.periods is None else mx.array(rope.periods_array())
    T = positions.shape[0]

    def fused():
        outs = []
        for d in layers:
            q, k, d.k_pool, d.v_pool = kernel(d.q, d.k, d.v, positions, slots, d.k_pool, d.v_pool, check_slots=False)
            outs += [q, k, d.k_pool, d.v_pool]
        mx.eval(outs)

    def mlx_path():
        # MLX's own path: mx.fast.rope with per-token offsets on q and k, then two scatters. The pools
        # have one owner (each layer's LayerData), so the scatters update them in place.
        outs = []
        for d in layers:
            q = _mlx_rotate(d.q, positions, rope, periods)
            k = _mlx_rotate(d.k, positions, rope, periods)
            d.k_pool[slots] = k
            d.v_pool[slots] = d.v
            outs += [q, k, d.k_pool, d.v_pool]
        mx.eval(outs)

    def seed_loop():
        # The seed's pre-kernel decode path: one rope call and one pool write per request.
        outs = []
        for d in layers:
            for t in range(T):
                pos = positions[t:t + 1]
                q = _mlx_rotate(d.q[t:t + 1], pos, rope, periods)
                k = _mlx_rotate(d.k[t:t + 1], pos, rope, periods)
                d.k_pool[slots[t:t + 1]] = k
                d.v_pool[slots[t:t + 1]] = d.v[t:t + 1]
                outs.append(q)
            outs += [d.k_pool, d.v_pool]
        mx.eval(outs)

    def trivial():
        mx.eval([d.q * 2 for d in layers])

    def copy():
        # The bandwidth floor: a unary op reading and writing as many bytes as the fused kernel moves.
        mx.eval([mx.negative(copy_src) for _ in layers])

    return {"fused": fused, "mlx": mlx_path, "seed_loop": seed_loop, "trivial": trivial, "copy": copy}
