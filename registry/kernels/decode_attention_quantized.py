"""decode_attention_quantized: decode_attention over mlx-lm's quantized K/V, read in place.

Contract (docs/kernel-abi.md):
    kernel(q, k_pool, v_pool, kv_len, kv_end=None, table=None, *, scale, window=0, softcap=0.0) -> out
decode_attention's (decode_attention.py), with k_pool and v_pool each a quantized pool group, the
tuple (uint32 words [.., D * bits / 32], scales [.., D / group_size], biases) that mlx-lm's
QuantizedKVCache keeps (head-major [B, Hkv, S, W]) or a slot-major one [P, Hkv, W] through a table,
scales and biases in q's dtype; the kernel object is configured by its PoolFormat (bits 4 or 8, group
size 32, 64 or 128). A key's or value's feature is q * scale + bias in fp32 (the stored scale and
bias; mx.dequantize would round the result to their dtype once more), attended exactly as
decode_attention attends float rows; no dequantized copy of the cache is made. The reference
dequantizes the pools in fp32 (mx.dequantize) and runs decode_attention's reference.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import KernelArgumentError
from ._base import INT32_MAX, FormatConfig, check_arrays, check_pools, shape_str
from .decode_attention import KERNEL_NAME as FLOAT_KERNEL, DecodeAttentionKernel, check_queries, check_rows
from .kv_quant_pool_store import pool_format

KERNEL_NAME = "decode_attention_quantized"


def _group(name: str, pool) -> tuple:
    if not (isinstance(pool, (tuple, list)) and len(pool) == 3):
        raise KernelArgumentError(f"{KERNEL_NAME}: {name} must be a quantized pool group (words, scales, biases), "
                                  f"got {type(pool).__name__}" + (f" of {len(pool)}" if isinstance(pool, (tuple, list))
                                                                   else ""))
    return tuple(pool)


class DecodeAttentionQuantizedKernel(FormatConfig, DecodeAttentionKernel):
    """What `KernelSet.attention_quant` holds."""

    NAME = KERNEL_NAME
    INPUTS = ("q", "k_pool", "k_scales", "k_biases", "v_pool", "v_scales", "v_biases", "kv_len", "kv_end", "table",
              "workspace", "locks")

    def pool_key(self, pool) -> tuple:
        return tuple(x for a in pool for x in (a.shape, a.dtype))

    def pool_arrays(self, pool) -> tuple:
        return tuple(pool)

    def validate(self, q, k_pool, v_pool, kv_len, kv_end, table, scale=1.0, window=0, softcap=0.0) -> None:
        k_pool, v_pool = _group("k_pool", k_pool), _group("v_pool", v_pool)
        names = self.fmt.names("k") + self.fmt.names("v") if self.fmt.quantized else ()
        check_arrays(KERNEL_NAME, dict(q=q, kv_len=kv_len, kv_end=kv_end, **dict(zip(names, (*k_pool, *v_pool)))))
        if not self.fmt.quantized:
            raise KernelArgumentError(f"{KERNEL_NAME}: bits=None: the kernel reads 4- or 8-bit rows")
        B, Hq, L, D = check_queries(KERNEL_NAME, q, scale, window, softcap)
        words = k_pool[0]
        if words.ndim not in (3, 4) or words.shape[1] < 1:
            raise KernelArgumentError(f"{KERNEL_NAME}: k_pool must be head-major [batch, n_kv_heads, rows, width] "
                                      f"(4-D) or slot-major [pool_size, n_kv_heads, width] (3-D), got shape "
                                      f"{shape_str(words)}")
        Hkv = words.shape[1]
        check_pools(KERNEL_NAME, dict(zip(names, (*k_pool, *v_pool))), Hkv, D, self.fmt, act_dtype=q.dtype)
        if Hq % Hkv:
            raise KernelArgumentError(f"{KERNEL_NAME}: n_q_heads={Hq} (q) is not a multiple of n_kv_heads={Hkv} "
                                      f"(k_pool {shape_str(words)})")
        if words.ndim == 4 and words.shape[0] != B:
            raise KernelArgumentError(f"{KERNEL_NAME}: a head-major k_pool {shape_str(words)} must have q's batch {B}")
        if words.shape[-3 if words.ndim == 3 else 2] > INT32_MAX:
            raise KernelArgumentError(f"{KERNEL_NAME}: k_pool {shape_str(words)} has more than INT32_MAX rows")
        check_rows(KERNEL_NAME, kv_len, kv_end, table, B, words.ndim == 3)

    def check_values(self, q, k_pool, v_pool, kv_len, kv_end, table) -> None:
        try:
            super().check_values(q, k_pool[0], v_pool[0], kv_len, kv_end, table)
        except KernelArgumentError as e:
            raise KernelArgumentError(str(e).replace(FLOAT_KERNEL + ":", KERNEL_NAME + ":", 1)) from None

    def dequantized(self, pool) -> mx.array:
        """A quantized pool group as fp32 rows (the kernel's q * scale + bias)."""
        words, scales, biases = pool
        return mx.dequantize(words, scales.astype(mx.float32), biases.astype(mx.float32),
                             group_size=self.fmt.group_size, bits=self.fmt.bits)

    def reference(self, q, k_pool, v_pool, kv_len, kv_end, table, scale=1.0, window=0, softcap=0.0):
        return super().reference(q, self.dequantized(k_pool), self.dequantized(v_pool), kv_len, kv_end, table, scale,
                                 window, softcap)

    def launch_config(self, q, k_pool, v_pool, kv_len, kv_end, table, scale=1.0, window=0, softcap=0.0):
        key, scalars, grid, group = super().launch_config(q, k_pool[0], v_pool[0], kv_len, kv_end, table, scale,
                                                          window, softcap)
        return key, dict(scalars, bits=self.fmt.bits, group_size=self.fmt.group_size), grid, group

    def scratch_need(self, q, k_pool, table) -> tuple[int, int]:
        return super().scratch_need(q, k_pool[0], table)

    @classmethod
    def functional(cls, args: tuple, config=None, **kw):
        check_arrays(KERNEL_NAME, dict(zip(("q", "kv_len"), (args[0], args[3]))))
        from ._base import _default_kernel
        from ..core import backend_of

        cls(config, backend="cpu").validate(*args, kw.get("scale", 1.0), kw.get("window", 0), kw.get("softcap", 0.0))
        return _default_kernel(cls, config, backend_of())(*args, **kw)


build = DecodeAttentionQuantizedKernel.build


def decode_attention_quantized(q, k_pool, v_pool, kv_len, kv_end=None, table=None, *, bits: int, group_size: int,
                               scale, window: int = 0, softcap: float = 0.0, check: bool = True):
    """Functional entry: the native kernel for the default device when its artifact is available, else
    the reference (module docstring)."""
    kv_end = kv_len if kv_end is None else kv_end
    return DecodeAttentionQuantizedKernel.functional((q, k_pool, v_pool, kv_len, kv_end, table),
                                                     pool_format(KERNEL_NAME, bits, group_size), scale=scale,
                                                     window=window, softcap=softcap, check=check)


def decode_attention_quantized_reference(q, k_pool, v_pool, kv_len, kv_end=None, table=None, *, bits: int,
                                         group_size: int, scale, window: int = 0, softcap: float = 0.0):
    """Pure MLX: the pools dequantized in fp32, then decode_attention's reference; every MLX device."""
    kernel = DecodeAttentionQuantizedKernel(pool_format(KERNEL_NAME, bits, group_size), backend="cpu")
    kv_end = kv_len if kv_end is None else kv_end
    kernel.validate(q, k_pool, v_pool, kv_len, kv_end, table, scale, window, softcap)
    return kernel.reference(q, k_pool, v_pool, kv_len, kv_end, table, scale, window, softcap)
