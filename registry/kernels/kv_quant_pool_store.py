"""kv_quant_pool_store: K and V rows quantized into mlx-lm's quantized KV pools, in place, one dispatch.

Contract (docs/kernel-abi.md):
    kernel(k, v, slots, k_pool, k_scales, k_biases, v_pool, v_scales, v_biases)
        -> (k_pool, k_scales, k_biases, v_pool, v_scales, v_biases)
the kernel object configured by a PoolFormat (bits 4 or 8, group size 32, 64 or 128). k and v
[T, Hkv, D] (or [B, Hkv, L, D]) of one float dtype, slots int32 [T]; per side a pool group of one
layout (slot-major [S, Hkv, W] or head-major [B, Hkv, S, W], mlx-lm's QuantizedKVCache buffers):
uint32 words W = D * bits / 32 wide, scales and biases D / group_size wide in k's dtype. Slot
slots[t] of each gets `mx.quantize(row, group_size, bits)` of token t's rows, bit for bit MLX's own
on the backend. slots[t] < 0 skips the token; >= the slot count is never written (an error with
check_slots=True, as is a valid slot given twice). Always rebind the six pools.
"""

from __future__ import annotations

from ..core import DTYPE_NAMES
from ..errors import KernelArgumentError
from ._base import (FormatConfig, PoolFormat, PoolGeometry, PoolKernel, act_scalars, check_activations, check_arrays, check_index,
                    check_pools, group_rows, rows_of, shape_str, store_group, to_rows)

KERNEL_NAME = "kv_quant_pool_store"
ROWS_PER_GROUP = 8    # rows (one head of one token, k or v) per threadgroup: 32 threads each


def quant_geometry(backend: str, rows: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, threadgroup) of the quantized store kernels: 32 threads per row (a warp on CUDA), rows
    along CUDA's x (whole warps, 1-D: prefill sizes never meet the 65535-block limit) or Metal's y."""
    if backend == "cuda":
        return (rows * 32, 1, 1), (32 * ROWS_PER_GROUP, 1, 1)
    if backend == "metal":
        return (32, rows, 1), (32, max(1, min(rows, ROWS_PER_GROUP)), 1)
    return (1, 1, 1), (1, 1, 1)


def quant_scalars(fmt: PoolFormat) -> dict[str, int]:
    return dict(bits=fmt.bits, group_size=fmt.group_size)


def pool_format(kernel: str, bits, group_size) -> PoolFormat:
    """The PoolFormat of a functional call's bits and group_size (checked when the pools are)."""
    for name, value in (("bits", bits), ("group_size", group_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise KernelArgumentError(f"{kernel}: {name} must be an int, got {type(value).__name__} {value!r}")
    return PoolFormat(bits, group_size)


class KvQuantPoolStoreKernel(FormatConfig, PoolKernel):
    NAME = KERNEL_NAME
    ARGS = ("k", "v", "slots", "k_pool", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases")
    INPUTS = ("k", "v", "k_pool", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases", "slots")

    def validate(self, k, v, slots, *pools) -> None:
        named = dict(zip(self.ARGS[3:], pools))
        check_arrays(KERNEL_NAME, dict(k=k, v=v, slots=slots))
        check_activations(KERNEL_NAME, dict(k=k, v=v))
        if k.shape != v.shape:
            raise KernelArgumentError(f"{KERNEL_NAME}: k {shape_str(k)} and v {shape_str(v)} must have the same shape")
        T, Hkv, D = rows_of(k)
        check_index(KERNEL_NAME, "slots", slots, T)
        if not self.fmt.quantized:
            raise KernelArgumentError(f"{KERNEL_NAME}: bits=None: the kernel stores 4- or 8-bit rows")
        check_pools(KERNEL_NAME, named, Hkv, D, self.fmt, act_dtype=k.dtype)

    def reference(self, k, v, slots, *pools):
        return (*store_group(pools[:3], slots, group_rows(to_rows(k), self.fmt)),
                *store_group(pools[3:], slots, group_rows(to_rows(v), self.fmt)))

    def launch_config(self, k, v, slots, *pools):
        T, Hkv, D = rows_of(k)
        scalars = dict(n_tokens=T, n_kv_heads=Hkv, head_dim=D, **quant_scalars(self.fmt),
                       **PoolGeometry(pools[0]).scalars, **act_scalars(k))
        grid, group = quant_geometry(self.backend, 2 * T * Hkv)
        return DTYPE_NAMES[k.dtype], scalars, grid, group

    def launch_arrays(self, k, v, slots, *pools):
        return [k, v, *pools, slots]


build = KvQuantPoolStoreKernel.build


def kv_quant_pool_store_reference(k, v, slots, *pools, bits: int, group_size: int):
    """Pure-MLX kv_quant_pool_store (mx.quantize + one scatter per pool array); every MLX device."""
    kernel = KvQuantPoolStoreKernel(pool_format(KERNEL_NAME, bits, group_size), backend="cpu")
    kernel.validate(k, v, slots, *pools)
    return kernel.reference(k, v, slots, *pools)


def kv_quant_pool_store(k, v, slots, *pools, bits: int, group_size: int, check_slots: bool = True):
    """Functional entry: the native kernel for the default device when its artifact is available,
    else the reference."""
    return KvQuantPoolStoreKernel.functional((k, v, slots, *pools), pool_format(KERNEL_NAME, bits, group_size),
                                             check_slots=check_slots)
