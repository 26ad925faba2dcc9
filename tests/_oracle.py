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


def rope_pool_numpy(q, k, v, positions, slots, k_pool, v_pool, rope: RopeConfig):
    """Returns float64 (q_rot, k_rot, k_pool_new, v_pool_new); pools are copies, rows with
    slot < 0 untouched."""
    positions = np.asarray(positions)
    slots = np.asarray(slots)
    q_rot = rotate_numpy(q, positions, rope)
    k_rot = rotate_numpy(k, positions, rope)
    k_pool = np.asarray(k_pool, dtype=np.float64).copy()
    v_pool = np.asarray(v_pool, dtype=np.float64).copy()
    v = np.asarray(v, dtype=np.float64)
    for t, slot in enumerate(slots):
        if 0 <= slot < k_pool.shape[0]:
            k_pool[slot] = k_rot[t]
            v_pool[slot] = v[t]
    return q_rot, k_rot, k_pool, v_pool
