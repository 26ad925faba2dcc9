"""What the RoPE kernels' wrappers share (rope_pool_fused, qk_norm_rope_pool_fused, rope_quant_pool_fused):
the argument contract of q, k, v, positions, slots, the pools and the norm weights, and the pure-MLX
norm and rotation of their references."""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx

from ..errors import KernelArgumentError
from ..norm import NormConfig
from ..rope import RopeConfig, UnsupportedRope, normalize_rope
from ._base import (FLOAT_POOLS, PoolFormat, PoolGeometry, check_activations, check_arrays, check_index,
                    check_pool_ranks, check_pools, rows_of, shape_str)


def rope_config(kernel: str, rope: Any) -> RopeConfig:
    """A RopeConfig from a RopeConfig or any supported RoPE module, else KernelArgumentError."""
    try:
        return normalize_rope(rope)
    except UnsupportedRope as e:
        raise KernelArgumentError(f"{kernel}: rope: {e}") from None


def check_rope_args(kernel: str, q, k, v, positions, slots, pools: dict[str, mx.array], rope: RopeConfig,
                    fmt: PoolFormat = FLOAT_POOLS) -> PoolGeometry:
    """q [T, Hq, D], k and v [T, Hkv, D] (or all [B, H, L, D], T = B * L) of one float dtype, Hq a
    multiple of Hkv, D even and at least rope.rotary_dims, int32 positions and slots [T], the pool
    groups of `fmt` (by name) of either layout; returns the pools' geometry."""
    check_arrays(kernel, dict(q=q, k=k, v=v, positions=positions, slots=slots, **pools))
    check_activations(kernel, dict(q=q, k=k, v=v))
    check_pool_ranks(kernel, pools, fmt)
    T, Hq, D = rows_of(q)
    if k.shape != v.shape:
        raise KernelArgumentError(f"{kernel}: k {shape_str(k)} and v {shape_str(v)} must have the same shape")
    Tk, Hkv, Dk = rows_of(k)
    if Tk != T or Dk != D:
        want = f"[tokens={T}, n_kv_heads, head_dim={D}]" if q.ndim == 3 else f"[batch, n_kv_heads, seq_len, head_dim={D}]"
        raise KernelArgumentError(f"{kernel}: k {shape_str(k)} must be {want} to match q {shape_str(q)}")
    if Hkv == 0 or Hq % Hkv:
        raise KernelArgumentError(f"{kernel}: q has {Hq} heads, not a multiple of k's {Hkv} heads")
    if D % 2:
        raise KernelArgumentError(f"{kernel}: head_dim={D} must be even")
    for name, a in (("positions", positions), ("slots", slots)):
        check_index(kernel, name, a, T)
    if rope.rotary_dims > D:
        raise KernelArgumentError(f"{kernel}: rope.rotary_dims={rope.rotary_dims} exceeds head_dim={D}")
    return check_pools(kernel, pools, Hkv, D, fmt, act_dtype=q.dtype if fmt.quantized else None)


def check_norm_weights(kernel: str, q: mx.array, q_weight, k_weight) -> None:
    """The q/k norms' weights: float [head_dim] arrays."""
    check_arrays(kernel, dict(q_weight=q_weight, k_weight=k_weight))
    D = q.shape[-1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (D,) or not mx.issubdtype(w.dtype, mx.floating):
            raise KernelArgumentError(f"{kernel}: {name} must be a float [head_dim={D}] array (the "
                                      f"norm's weight), got {w.dtype} {shape_str(w)}")


def normed(x: mx.array, w: mx.array, norm: NormConfig) -> mx.array:
    """The model's per-head RMSNorm: fp32 math, one rounding to x.dtype."""
    x32 = x.astype(mx.float32)
    return mx.fast.rms_norm(x32, w.astype(mx.float32) + norm.weight_offset, norm.eps).astype(x.dtype)


def norm_rope_table(q_weight: mx.array, k_weight: mx.array, freqs: mx.array) -> mx.array:
    """[q_weight | k_weight | inv_freq] in fp32 (the weights exactly, as the reference's fp32 math takes
    them): the norm kernels' one table buffer."""
    return mx.concatenate([q_weight.astype(mx.float32), k_weight.astype(mx.float32), freqs])


def rope_scalars(rope: RopeConfig) -> dict[str, Any]:
    return dict(rotary_dims=rope.rotary_dims, traditional=int(rope.traditional), pos_scale=rope.pos_scale,
                mscale=rope.mscale)


def rotate(x: mx.array, positions: mx.array, rope: RopeConfig) -> mx.array:
    """x [T, H, D] -> rotated, fp32 math, rounded once to x.dtype; the features past rotary_dims pass
    through exactly. The angles are the kernels' own (docs/kernel-abi.md): float32(position) *
    pos_scale * inv_freq[i] in fp32 with the float32 inv_freq the kernels get, so every path agrees
    at any int32 position, negative ones included."""
    r, half = rope.rotary_dims, rope.rotary_dims // 2
    x32 = x.astype(mx.float32)
    angle = (positions.astype(mx.float32) * rope.pos_scale)[:, None] * inv_freq(rope)[None]   # [T, r/2]
    c, s = mx.cos(angle)[:, None, :], mx.sin(angle)[:, None, :]
    if rope.traditional:
        x1, x2 = x32[..., 0:r:2] * rope.mscale, x32[..., 1:r:2] * rope.mscale
        rot = mx.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(*x.shape[:-1], r)
    else:
        x1, x2 = x32[..., :half] * rope.mscale, x32[..., half:r] * rope.mscale
        rot = mx.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    if r < x.shape[-1]:
        rot = mx.concatenate([rot, x32[..., r:]], axis=-1)
    return rot.astype(x.dtype)


@functools.lru_cache(maxsize=64)
def inv_freq(rope: RopeConfig) -> mx.array:
    """The float32 frequency table the kernels take (buffer inv_freq)."""
    return mx.array(rope.inv_freq())
