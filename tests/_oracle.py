"""An independent NumPy implementation of rope_pool_fused (float64 math), written from the
contract in docs/kernel-abi.md without MLX. Every implementation is checked against it."""

from __future__ import annotations

import numpy as np

from registry.rope import RopeConfig


def rotate_numpy(x: np.ndarray, positions: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """x [T, H, D] (any float dtype) -> float64 rotated copy."""
    x = np.asarray(x, dtype=np.float64).copy()
    r = rope.rotary_dims
    half = r // 2
    if rope.periods is None:
        inv = rope.base ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    else:
        p = np.asarray(rope.periods, dtype=np.float64)
        with np.errstate(divide="ignore"):
            inv = np.where(np.isinf(p), 0.0, 1.0 / p)
    angle = positions.astype(np.float64)[:, None] * rope.pos_scale * inv[None, :]   # [T, half]
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    if rope.traditional:
        x1, x2 = x[..., 0:r:2] * rope.mscale, x[..., 1:r:2] * rope.mscale
        x[..., 0:r:2] = x1 * c - x2 * s
        x[..., 1:r:2] = x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half] * rope.mscale, x[..., half:r] * rope.mscale
        x[..., :half] = x1 * c - x2 * s
        x[..., half:r] = x1 * s + x2 * c
    return x


def by_slot(pool: np.ndarray) -> np.ndarray:
    """A pool as [slots, Hkv, D]: slot-major pools as they are, head-major [B, Hkv, S, D] ones with
    slot b * S + s at row b * S + s (a copy)."""
    if pool.ndim == 3:
        return pool
    B, H, S, D = pool.shape
    return pool.transpose(0, 2, 1, 3).reshape(B * S, H, D)


def from_slots(rows: np.ndarray, shape: tuple) -> np.ndarray:
    """by_slot's inverse for a pool of `shape`."""
    if len(shape) == 3:
        return rows
    B, H, S, D = shape
    return rows.reshape(B, S, H, D).transpose(0, 2, 1, 3)


def rope_pool_numpy(q, k, v, positions, slots, k_pool, v_pool, rope: RopeConfig):
    """Returns float64 (q_rot, k_rot, k_pool_new, v_pool_new); pools (slot-major [S, Hkv, D] or
    head-major [B, Hkv, S, D]) are copies, rows with slot < 0 or >= the slot count untouched."""
    positions = np.asarray(positions)
    slots = np.asarray(slots)
    q_rot = rotate_numpy(q, positions, rope)
    k_rot = rotate_numpy(k, positions, rope)
    shape = np.shape(k_pool)
    k_rows = by_slot(np.asarray(k_pool, dtype=np.float64)).copy()
    v_rows = by_slot(np.asarray(v_pool, dtype=np.float64)).copy()
    v = np.asarray(v, dtype=np.float64)
    for t, slot in enumerate(slots):
        if 0 <= slot < k_rows.shape[0]:
            k_rows[slot] = k_rot[t]
            v_rows[slot] = v[t]
    return q_rot, k_rot, from_slots(k_rows, shape), from_slots(v_rows, shape)


def _round(x: np.ndarray, ties_away: bool) -> np.ndarray:
    """Round to nearest: ties to even (np.rint, the CPU's std::rint), or away from zero (CUDA's and
    Metal's round)."""
    if not ties_away:
        return np.rint(x)
    return np.where(np.abs(x - np.trunc(x)) == 0.5, np.trunc(x) + np.sign(x), np.rint(x))


def quantize_numpy(x: np.ndarray, group_size: int, bits: int, gpu: bool = False):
    """mx.quantize's affine mode written from docs/kernel-abi.md ("The quantized format") in float32
    NumPy: (uint32 words [..., D * bits / 32], fp32 scales and biases [..., D / group_size], before
    their rounding to the scales' dtype). gpu=True: MLX's CUDA/Metal rules (ties away from zero, the
    maximum taken from 0)."""
    x = np.asarray(x, np.float32)
    g = x.reshape(-1, group_size)
    n_bins = np.float32((1 << bits) - 1)
    w_max, w_min = g.max(1), g.min(1)
    if gpu:
        w_max = np.maximum(w_max, np.float32(0))
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7)).astype(np.float32)
    scale = np.where(side, scale, -scale).astype(np.float32)
    edge = np.where(side, w_min, w_max).astype(np.float32)
    q0 = _round((edge / scale).astype(np.float32), gpu)
    nonzero = q0 != 0
    scale = np.where(nonzero, edge / np.where(nonzero, q0, 1).astype(np.float32), scale).astype(np.float32)
    bias = np.where(nonzero, edge, 0).astype(np.float32)
    q = _round(((g - bias[:, None]) / scale[:, None]).astype(np.float32), gpu)
    q = np.clip(q, 0, n_bins).astype(np.uint64).reshape(-1, 32 // bits)
    words = np.zeros(q.shape[0], np.uint64)
    for k in range(32 // bits):
        words |= q[:, k] << np.uint64(k * bits)
    lead = x.shape[:-1]
    return (words.astype(np.uint32).reshape(*lead, -1), scale.reshape(*lead, -1), bias.reshape(*lead, -1))
