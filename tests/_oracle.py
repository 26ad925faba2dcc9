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
