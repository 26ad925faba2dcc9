"""qk_norm_rope_pool_fused: per-head RMSNorm of q and k, RoPE, and the K/V pool store, one dispatch.

Contract (docs/kernel-abi.md):
    kernel(q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight) -> (q_out, k_out, k_pool, v_pool)
with the kernel object configured by (rope, norm): `norm` a NormConfig (eps, weight_offset: 0 for
y = n(x) * w, 1 for Gemma's y = n(x) * (1 + w)). q [T, Hq, D], k and v [T, Hkv, D], q_weight and
k_weight [D] (the layer's q_norm / k_norm weights), positions and slots int32 [T], pools slot-major
[S, Hkv, D] or head-major [B, Hkv, S, D]. q_out = rope(norm_q(q)), k_out = rope(norm_k(k)); k_out and
v go to the pools at valid slots. For the attention code that runs norm -> RoPE -> cache (qwen3,
gemma3, ...); mlx_lm.trace_attention checks that order per layer. Always rebind the pools.
The native kernels take the weights and the RoPE table as one fp32 buffer, norm_rope_table, which the
kernel object makes once per pair of weight arrays (DerivedArray) and reuses while they are passed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..core import SelectionContext
from ..errors import KernelArgumentError
from ..norm import NormConfig
from ..rope import RopeConfig
from ._base import DerivedArray, PoolGeometry, PoolKernel, act_scalars, from_rows, pool_dtype_key, rows_of, store_rows, to_rows
from ._rope import (check_norm_weights, check_rope_args, inv_freq, norm_rope_table, normed, rope_config,
                    rope_scalars, rotate)

KERNEL_NAME = "qk_norm_rope_pool_fused"
ROWS_PER_GROUP = 8    # rows (one head of one token) per threadgroup; the Metal source's partial[256] = 8 x 32


def _norm_config(norm: Any) -> NormConfig:
    if not isinstance(norm, NormConfig):
        raise KernelArgumentError(f"{KERNEL_NAME}: norm must be a registry.norm.NormConfig, got {type(norm).__name__}")
    return norm


class QkNormRopePoolFusedKernel(PoolKernel):
    NAME = KERNEL_NAME
    ARGS = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool", "q_weight", "k_weight")
    INPUTS = ("q", "k", "v", "k_pool", "v_pool", "positions", "slots", "norm_rope_table")
    POSITIONS = "positions"

    def __init__(self, config: tuple[RopeConfig, NormConfig], **kw):
        super().__init__(config, **kw)
        self.rope, self.norm = config
        self._inv_freq = inv_freq(self.rope)
        # One buffer per layer for its norm weights and the RoPE table, made once per weight pair.
        self._table = None if self._launcher is None else DerivedArray(self._make_table)

    @classmethod
    def config_from(cls, ctx: SelectionContext):
        return ctx.rope, ctx.qk_norm

    @classmethod
    def context_fields(cls, config) -> dict:
        return dict(rope=config[0], qk_norm=config[1], qk_norm_error="")

    def validate(self, q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight) -> None:
        check_rope_args(KERNEL_NAME, q, k, v, positions, slots, dict(k_pool=k_pool, v_pool=v_pool), self.rope)
        check_norm_weights(KERNEL_NAME, q, q_weight, k_weight)

    def reference(self, q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight):
        q_out = rotate(normed(to_rows(q), q_weight, self.norm), positions, self.rope)
        k_out = rotate(normed(to_rows(k), k_weight, self.norm), positions, self.rope)
        return (from_rows(q_out, q), from_rows(k_out, k), store_rows(k_pool, slots, k_out),
                store_rows(v_pool, slots, to_rows(v)))

    def launch_config(self, q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight):
        T, Hq, D = rows_of(q)
        Hkv = k.shape[1]
        rows = T * (Hq + Hkv)
        scalars = dict(n_tokens=T, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D, eps=self.norm.eps,
                       weight_offset=self.norm.weight_offset, **rope_scalars(self.rope),
                       **PoolGeometry(k_pool).scalars, **act_scalars(q))
        if self.backend == "cuda":        # one warp per row, 1-D
            grid, group = (rows * 32, 1, 1), (32 * ROWS_PER_GROUP, 1, 1)
        elif self.backend == "metal":     # 32 threads per row along x, rows along y
            grid, group = (32, rows, 1), (32, max(1, min(rows, ROWS_PER_GROUP)), 1)
        else:
            grid, group = (1, 1, 1), (1, 1, 1)
        return pool_dtype_key(q.dtype, k_pool.dtype), scalars, grid, group

    def _make_table(self, q_weight, k_weight) -> mx.array:
        return norm_rope_table(q_weight, k_weight, self._inv_freq)

    def launch_arrays(self, q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight):
        return [q, k, v, k_pool, v_pool, positions, slots, self._table(q_weight, k_weight)]


build = QkNormRopePoolFusedKernel.build


def qk_norm_rope_pool_fused_reference(q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight, *, rope, norm):
    """Pure-MLX qk_norm_rope_pool_fused: 2 mx.fast.rms_norm + 2 mx.fast.rope + 2 scatters."""
    kernel = QkNormRopePoolFusedKernel((rope_config(KERNEL_NAME, rope), _norm_config(norm)), backend="cpu")
    args = (q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight)
    kernel.validate(*args)
    return kernel.reference(*args)


def qk_norm_rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight, *, rope, norm,
                            check_slots: bool = True):
    """Functional entry: `rope` a RopeConfig or a supported RoPE module, `norm` a NormConfig; the native
    kernel for the default device when its artifact is available, else the reference."""
    config = (rope_config(KERNEL_NAME, rope), _norm_config(norm))
    return QkNormRopePoolFusedKernel.functional((q, k, v, positions, slots, k_pool, v_pool, q_weight, k_weight),
                                                config, check_slots=check_slots)
