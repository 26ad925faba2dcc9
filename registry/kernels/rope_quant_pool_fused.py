"""rope_quant_pool_fused: RoPE on q and k (after the layer's per-head q/k RMSNorm, when it has one) plus
k and v quantized into mlx-lm's quantized KV pools, in place, one dispatch.

Contract (docs/kernel-abi.md):
    kernel(q, k, v, positions, slots, k_pool, k_scales, k_biases, v_pool, v_scales, v_biases)
        -> (q_out, k_out, k_pool, k_scales, k_biases, v_pool, v_scales, v_biases)
    kernel.norm(..., q_weight, k_weight) -> the same, q and k normalised first (the layer's norms)
the kernel object configured by (rope, norm or None, PoolFormat). q, k, v, positions and slots as
rope_pool_fused; per side a quantized pool group (kv_quant_pool_store's). q_out and k_out are what
rope_pool_fused / qk_norm_rope_pool_fused return; slot slots[t] of the pools gets
`mx.quantize(row, group_size, bits)` of k_out's and v's rows of token t, bit for bit MLX's own on the
backend. `kernel.norm` is the q/k-norm form (KernelSet.rope_quant.norm), present when the selection
context has a qk_norm. Always rebind the six pools.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..core import DTYPE_NAMES, SelectionContext
from ..norm import NormConfig
from ..rope import RopeConfig
from ._base import (DerivedArray, PoolFormat, PoolGeometry, PoolKernel, act_scalars, from_rows, group_rows, rows_of,
                    store_group, to_rows)
from ._rope import (check_norm_weights, check_rope_args, inv_freq, norm_rope_table, normed, rope_config,
                    rope_scalars, rotate)
from .kv_quant_pool_store import pool_format, quant_geometry, quant_scalars
from ..errors import KernelArgumentError

KERNEL_NAME = "rope_quant_pool_fused"
POOLS = ("k_pool", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases")


class RopeQuantKernel(PoolKernel):
    """What `KernelSet.rope_quant` holds; `.norm` is the q/k-norm form (or None)."""

    NAME = KERNEL_NAME
    ARGS = ("q", "k", "v", "positions", "slots", *POOLS)
    INPUTS = ("q", "k", "v", *POOLS, "positions", "slots", "table")
    POSITIONS = "positions"

    def __init__(self, config: tuple[RopeConfig, NormConfig | None, PoolFormat], **kw):
        super().__init__(config, **kw)
        self.rope, self.norm_config, self.fmt = config
        self._inv_freq = inv_freq(self.rope)
        self.norm: "QkNormRopeQuantKernel | None" = None

    @classmethod
    def config_from(cls, ctx: SelectionContext):
        return ctx.rope, None, PoolFormat(ctx.kv_bits, ctx.kv_group_size)

    @classmethod
    def context_fields(cls, config) -> dict:
        rope, norm, fmt = config
        return dict(rope=rope, qk_norm=norm, qk_norm_error="" if norm is not None else "no q/k norm",
                    kv_bits=fmt.bits, kv_group_size=fmt.group_size)

    @classmethod
    def build(cls, spec, ctx: SelectionContext) -> "RopeQuantKernel":
        kernel = super().build(spec, ctx)
        if cls is RopeQuantKernel and ctx.qk_norm is not None:     # one artifact serves both forms
            kernel.norm = QkNormRopeQuantKernel(QkNormRopeQuantKernel.config_from(ctx), backend=kernel.backend,
                                                device=kernel.device, launcher=kernel._launcher, reason=kernel.reason)
        return kernel

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rotary_dims={self.rope.rotary_dims}, {self.fmt}, "
                f"implementation={self.implementation})")

    def validate(self, q, k, v, positions, slots, *pools) -> None:
        if not self.fmt.quantized:
            raise KernelArgumentError(f"{KERNEL_NAME}: bits=None: the kernel stores 4- or 8-bit rows")
        check_rope_args(KERNEL_NAME, q, k, v, positions, slots, dict(zip(POOLS, pools[:6])), self.rope, self.fmt)

    def _rotated(self, q, k, positions, weights) -> tuple[mx.array, mx.array]:
        q, k = to_rows(q), to_rows(k)
        if weights:
            q, k = normed(q, weights[0], self.norm_config), normed(k, weights[1], self.norm_config)
        return rotate(q, positions, self.rope), rotate(k, positions, self.rope)

    def reference(self, q, k, v, positions, slots, *pools_and_weights):
        pools, weights = pools_and_weights[:6], pools_and_weights[6:]
        q_out, k_out = self._rotated(q, k, positions, weights)
        return (from_rows(q_out, q), from_rows(k_out, k), *store_group(pools[:3], slots, group_rows(k_out, self.fmt)),
                *store_group(pools[3:], slots, group_rows(to_rows(v), self.fmt)))

    def launch_config(self, q, k, v, positions, slots, *pools_and_weights):
        T, Hq, D = rows_of(q)
        Hkv = k.shape[1]
        norm = self.norm_config or NormConfig(0.0, 0.0)
        scalars = dict(n_tokens=T, n_q_heads=Hq, n_kv_heads=Hkv, head_dim=D, qk_norm=int(self.norm_config is not None),
                       eps=norm.eps, weight_offset=norm.weight_offset, **rope_scalars(self.rope),
                       **quant_scalars(self.fmt), **PoolGeometry(pools_and_weights[0]).scalars, **act_scalars(q))
        grid, group = quant_geometry(self.backend, T * (Hq + 2 * Hkv))
        return DTYPE_NAMES[q.dtype], scalars, grid, group

    def launch_arrays(self, q, k, v, positions, slots, *pools):
        return [q, k, v, *pools, positions, slots, self._inv_freq]


class QkNormRopeQuantKernel(RopeQuantKernel):
    """`KernelSet.rope_quant.norm`: q and k through the layer's per-head RMSNorms (q_weight, k_weight:
    their weights; NormConfig eps and weight_offset) first."""

    ARGS = RopeQuantKernel.ARGS + ("q_weight", "k_weight")

    def __init__(self, config, **kw):
        super().__init__(config, **kw)
        self._table = None if self._launcher is None else DerivedArray(self._make_table)

    @classmethod
    def config_from(cls, ctx: SelectionContext):
        return ctx.rope, ctx.qk_norm, PoolFormat(ctx.kv_bits, ctx.kv_group_size)

    def validate(self, q, k, v, positions, slots, *pools_and_weights) -> None:
        super().validate(q, k, v, positions, slots, *pools_and_weights[:6])
        check_norm_weights(KERNEL_NAME, q, *pools_and_weights[6:])

    def _make_table(self, q_weight, k_weight) -> mx.array:
        return norm_rope_table(q_weight, k_weight, self._inv_freq)

    def launch_arrays(self, q, k, v, positions, slots, *pools_and_weights):
        return [q, k, v, *pools_and_weights[:6], positions, slots, self._table(*pools_and_weights[6:])]


build = RopeQuantKernel.build


def _config(rope: Any, norm: Any, bits, group_size):
    if norm is not None and not isinstance(norm, NormConfig):
        raise KernelArgumentError(f"{KERNEL_NAME}: norm must be a registry.norm.NormConfig or None, "
                                  f"got {type(norm).__name__}")
    return rope_config(KERNEL_NAME, rope), norm, pool_format(KERNEL_NAME, bits, group_size)


def rope_quant_pool_fused_reference(q, k, v, positions, slots, *pools, rope, bits: int, group_size: int,
                                    norm: NormConfig | None = None, q_weight=None, k_weight=None):
    """Pure-MLX rope_quant_pool_fused (with `norm`: the q/k norms first, their weights given)."""
    config = _config(rope, norm, bits, group_size)
    cls = RopeQuantKernel if norm is None else QkNormRopeQuantKernel
    args = (q, k, v, positions, slots, *pools) + (() if norm is None else (q_weight, k_weight))
    kernel = cls(config, backend="cpu")
    kernel.validate(*args)
    return kernel.reference(*args)


def rope_quant_pool_fused(q, k, v, positions, slots, *pools, rope, bits: int, group_size: int,
                          norm: NormConfig | None = None, q_weight=None, k_weight=None, check_slots: bool = True):
    """Functional entry: `rope` a RopeConfig or a supported RoPE module, `norm` a NormConfig (then
    q_weight and k_weight) or None; the native kernel for the default device when its artifact is
    available, else the reference."""
    config = _config(rope, norm, bits, group_size)
    cls = RopeQuantKernel if norm is None else QkNormRopeQuantKernel
    args = (q, k, v, positions, slots, *pools) + (() if norm is None else (q_weight, k_weight))
    return cls.functional(args, config, check_slots=check_slots)
