"""Shared case generation for the rope_pool_fused parity tests (CPU native, GPU, Metal emulation)."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np

from registry.rope import RopeConfig

MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# fp32 angles at positions < 5000 carry up to pos * 2^-23 ~ 6e-4 rad of rounding against the float64
# oracle, times |x| <= ~4; f16/bf16 add one rounding of the result to the storage dtype.
TOL = {"float32": 3e-3, "float16": 6e-3, "bfloat16": 3e-2}


def rope_variant(name: str, head_dim: int) -> RopeConfig:
    partial = head_dim // 2 if head_dim % 4 == 0 else head_dim - 2
    if name == "full-base":
        return RopeConfig(head_dim, base=10000.0)
    if name == "full-traditional-freqs":
        return RopeConfig(head_dim, traditional=True, base=None,
                          periods=tuple(float(1.5 ** i) for i in range(head_dim // 2)))
    if name == "partial-base-scaled":
        return RopeConfig(partial, base=1e6, pos_scale=0.25, mscale=1.2)
    if name == "partial-traditional":
        return RopeConfig(partial, traditional=True, base=500.0)
    if name == "partial-freqs-inf":
        half = partial // 2
        return RopeConfig(partial, base=None, periods=tuple([10.0 ** (i / 4) for i in range(half - 2)]
                                                            + [float("inf")] * 2))
    if name == "odd-pairs":  # rotary_dims/2 odd: exercises the narrow-vector paths
        return RopeConfig(head_dim - 2 if (head_dim - 2) % 4 else head_dim - 6, traditional=head_dim % 128 == 0)
    raise KeyError(name)


VARIANTS = ["full-base", "full-traditional-freqs", "partial-base-scaled", "partial-traditional",
            "partial-freqs-inf", "odd-pairs"]
GQA = [1, 4, 7, 8]
HEAD_DIMS = [64, 96, 128, 256]


def matrix():
    """dtype x GQA x head_dim, each with two RoPE variants (cycled) and slot patterns mixing -1 and valid."""
    cases = []
    for n, (dtype, gqa, d) in enumerate(itertools.product(MX_DTYPES, GQA, HEAD_DIMS)):
        for j in range(2):
            cases.append((dtype, gqa, d, VARIANTS[(2 * n + j) % len(VARIANTS)]))
    return cases


def make_case(T, Hq, Hkv, D, S, dtype, slots, seed=0, max_pos=5000, batch=None, pool_dtype=None):
    """q, k, v, positions, slots, k_pool, v_pool; pools slot-major [S, Hkv, D], or head-major
    [batch, Hkv, S, D] (batch * S slots) when `batch` is given; of `pool_dtype` (default: dtype)."""
    rng = np.random.default_rng(seed)
    arr = lambda *shape, dt=dtype: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(MX_DTYPES[dt])
    q, k, v = arr(T, Hq, D), arr(T, Hkv, D), arr(T, Hkv, D)
    pool_shape = (S, Hkv, D) if batch is None else (batch, Hkv, S, D)
    kp, vp = arr(*pool_shape, dt=pool_dtype or dtype), arr(*pool_shape, dt=pool_dtype or dtype)
    pos = mx.array(rng.integers(0, max_pos, size=T).astype(np.int32))
    return q, k, v, pos, mx.array(np.asarray(slots, dtype=np.int32)), kp, vp


# Every (activation, pool) dtype pair with an entry of its own (kernels.yaml `<act>/<pool>` keys).
MIXED = [(a, p) for a in MX_DTYPES for p in MX_DTYPES if a != p]


def to_np(a: mx.array) -> np.ndarray:
    return np.array(a if a.dtype == mx.int32 else a.astype(mx.float32))
