"""kv_pool_store: K and V rows into the slot-indexed KV pools, in place, one dispatch.

Contract (docs/kernel-abi.md):
    kv_pool_store(k, v, slots, k_pool, v_pool) -> (k_pool, v_pool)
k and v [T, Hkv, D] of one float dtype, slots int32 [T], pools slot-major [S, Hkv, D] or head-major
[B, Hkv, S, D] of one float dtype (may differ from k/v's: the store converts). slots[t] < 0 skips the
token; slots[t] >= pool size is never written (an error with check_slots=True, as is a valid slot
given twice). For NoPE layers and layers whose RoPE is the model's own code: the keys arrive rotated.
Always rebind the pools: `k_pool, v_pool = kernel(...)`.
"""

from __future__ import annotations

from ._base import (PoolGeometry, PoolKernel, act_scalars, check_activations, check_arrays, check_index, check_pools,
                    pool_dtype_key, rows_of, shape_str, store_rows, to_rows)
from ..errors import KernelArgumentError

KERNEL_NAME = "kv_pool_store"
# The CUDA kernel's supported vector widths (elements); cuda_src/kv_pool_store.cu switches on them.
CUDA_WIDTHS = (8, 4, 2, 1)


def cuda_vector_width(head_dim: int, act_itemsize: int, pool_itemsize: int) -> int:
    """Elements per vector access: 16 bytes of the wider dtype when head_dim is a multiple, else
    narrower, down to 1. The one source of the width: the wrapper passes it as the scalar vec_width."""
    w = 16 // max(act_itemsize, pool_itemsize)
    while w > 1 and head_dim % w:
        w //= 2
    return w


class KvPoolStoreKernel(PoolKernel):
    NAME = KERNEL_NAME
    ARGS = ("k", "v", "slots", "k_pool", "v_pool")
    INPUTS = ("k", "v", "k_pool", "v_pool", "slots")

    def validate(self, k, v, slots, k_pool, v_pool) -> None:
        check_arrays(KERNEL_NAME, dict(k=k, v=v, slots=slots, k_pool=k_pool, v_pool=v_pool))
        check_activations(KERNEL_NAME, dict(k=k, v=v))
        if k.shape != v.shape:
            raise KernelArgumentError(f"kv_pool_store: k {shape_str(k)} and v {shape_str(v)} must have the same shape")
        T, Hkv, D = rows_of(k)
        check_index(KERNEL_NAME, "slots", slots, T)
        check_pools(KERNEL_NAME, dict(k_pool=k_pool, v_pool=v_pool), Hkv, D)

    def reference(self, k, v, slots, k_pool, v_pool):
        return store_rows(k_pool, slots, to_rows(k)), store_rows(v_pool, slots, to_rows(v))

    def launch_config(self, k, v, slots, k_pool, v_pool):
        T, Hkv, D = rows_of(k)
        pool = PoolGeometry(k_pool)
        width = cuda_vector_width(D, k.dtype.size, k_pool.dtype.size) if self.backend == "cuda" else 1
        scalars = dict(n_tokens=T, n_kv_heads=Hkv, head_dim=D, vec_width=width, **pool.scalars, **act_scalars(k))
        if self.backend == "cuda":        # one thread per vector of a row, rows token-major
            grid, group = (T * Hkv * (D // width), 1, 1), (256, 1, 1)
        elif self.backend == "metal":     # one thread per feature
            grid, group = (D, Hkv, T), (min(D, 256), 1, 1)
        else:
            grid, group = (1, 1, 1), (1, 1, 1)
        return pool_dtype_key(k.dtype, k_pool.dtype), scalars, grid, group

    def launch_arrays(self, k, v, slots, k_pool, v_pool):
        return [k, v, k_pool, v_pool, slots]


build = KvPoolStoreKernel.build


def kv_pool_store_reference(k, v, slots, k_pool, v_pool):
    """Pure-MLX kv_pool_store (two scatters); runs on every MLX device."""
    kernel = KvPoolStoreKernel(backend="cpu")
    kernel.validate(k, v, slots, k_pool, v_pool)
    return kernel.reference(k, v, slots, k_pool, v_pool)


def kv_pool_store(k, v, slots, k_pool, v_pool, *, check_slots: bool = True):
    """Functional entry: the native kernel for the default device when its artifact is available,
    else the reference."""
    return KvPoolStoreKernel.functional((k, v, slots, k_pool, v_pool), check_slots=check_slots)
