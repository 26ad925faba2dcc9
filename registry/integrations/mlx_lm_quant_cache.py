"""The drop-in cache's quantized form (docs/engine.md, "Quantized caches"): mlx-lm's QuantizedKVCache
with its writes and its attention in AOT kernels, on every backend.

`make_prompt_cache(model, kv_bits=8, kv_group_size=64)` (mlx_lm_cache.py) gives every layer whose own
cache is a KVCache a `QuantizedKVCache` of this module: a subclass of mlx-lm's (same name, same state,
same buffers: (uint32 words, scales, biases) per side, head-major [B, Hkv, S, W], grown by 256 rows),
so save_prompt_cache writes mlx-lm's own file. mlx-lm's `generate_step(..., kv_bits=...)` reaches it
too: it converts the drop-in KVCache with `to_quantized`, which the drop-in class overrides.

What runs, per layer and format (`QuantLayer`):
  - writes: in a fused layer (the float drop-in's rope_pool_fused layers) rope_quant_pool_fused
    (its q/k-norm form where the layer has one), through the direct forward or the rope capture as
    the float caches; in every other layer, and for keys a forward rotated itself,
    kv_quant_pool_store. Either quantizes the rows into the buffers in place, bit for bit
    mx.quantize on the backend. Without the kernel (not selected: another format, an unfused rope
    and so on) mlx-lm's own mx.quantize and slice assignment;
  - attention (`QuantizedKVCache.attend`): up to 8 query tokens (mask None or "causal") on
    decode_attention_quantized where selected; else mlx-lm's own quantized attention (mx.quantized_matmul) on the CPU and
    Metal, and on CUDA, where MLX 0.32.4's quantized_matmul has no kernel for these shapes, the valid
    rows dequantized (mx.dequantize of [0, offset)) and MLX's fused sdpa: so prefill chunks dequantize
    the whole valid range once per chunk. The model's attention code reaches it through mlx-lm's own
    `quantized_scaled_dot_product_attention`, which `install_attention` wraps: keys that this module's
    caches returned (`QuantRows`) go to their cache; every other call runs mlx-lm's function.

Not quantized: rotating caches (sliding windows, max_kv_size) stay float drop-in caches, as mlx-lm
cannot quantize them (its to_quantized raises). mlx-lm's BatchGenerator does not batch quantized
caches (QuantizedKVCache has no merge: its _merge_caches raises ValueError), this class neither.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..core import default_registry
from ..native import device_arange
from ..kernels._base import PoolFormat
from .mlx_lm import import_mlx_lm_module
from .mlx_lm_cache import Fusion, FusedModel, _adopt, _Fused, _rows_index, _steps

_stock = import_mlx_lm_module("cache")
KV_BITS = (2, 3, 4, 5, 6, 8)          # mx.quantize's affine formats (mlx-lm's kv_bits)
KV_GROUP_SIZES = (32, 64, 128)
MAX_DECODE = 8                        # query tokens the decode attention kernel takes


def check_format(bits, group_size, who: str = "make_prompt_cache") -> None:
    if isinstance(bits, bool) or bits not in KV_BITS:
        raise ValueError(f"{who}: kv_bits must be one of {', '.join(map(str, KV_BITS))} (mx.quantize's affine "
                         f"formats), got {bits!r}")
    if isinstance(group_size, bool) or group_size not in KV_GROUP_SIZES:
        raise ValueError(f"{who}: kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got "
                         f"{group_size!r}")


class QuantRows(tuple):
    """A quantized cache's (words, scales, biases) of its valid rows, as mlx-lm's update_and_fetch
    returns them, holding the cache they came from: the attention (install_attention) reads it."""

    def __new__(cls, arrays, cache):
        self = super().__new__(cls, arrays)
        self.cache = cache
        return self


@dataclass
class QuantLayer:
    """What the quantized caches of one layer share, for one format."""
    layer: int
    fmt: PoolFormat
    store: Any = None          # kv_quant_pool_store where selected (rows the forward rotated itself)
    fusion: Fusion | None = None   # rope_quant_pool_fused where the float layer is fused
    attention: Any = None      # the quantized decode attention where selected
    reasons: dict = field(default_factory=dict)       # what did not go to a kernel, and why
    calls: Counter = field(default_factory=Counter)   # 'store' | 'stock' | 'attention' | 'dequantized' | 'mlx-lm'

    @property
    def backend(self) -> str | None:
        k = self.fusion.kernel if self.fusion is not None else self.store
        return None if k is None else k.backend

    def describe(self) -> str:
        if self.fusion is not None:
            write = f"{self.fusion.reason}, {self.fusion.path}"
        elif self.store is not None:
            write = f"{self.store.NAME} ({self.store.implementation}; {self.reasons.get('rope', 'not fused')})"
        else:
            write = f"mlx-lm's own quantize ({self.reasons.get('store', '?')})"
        att = (f"{self.attention.NAME} ({self.attention.implementation})" if self.attention is not None
               else f"not a kernel ({self.reasons.get('attention', '?')})")
        return f"{self.fmt}: writes {write}; decode attention {att}"


def quant_layers(fm: FusedModel, bits: int, group_size: int) -> dict[int, QuantLayer]:
    """The model's QuantLayer per KV layer for one format: the layer's selection context with the
    cache format, one kernel set per distinct layer configuration. Made once per format; the fused
    layers' direct-forward state is refreshed from the float Fusion at each call (make_prompt_cache
    may have changed it)."""
    install_attention()
    plan = fm.quant.get((bits, group_size))
    if plan is None:
        plan = fm.quant[(bits, group_size)] = {}
        sets: dict[int, Any] = {}
        for i, ks in fm.kernels.by_layer.items():
            kq = sets.get(id(ks))
            if kq is None:
                kq = sets[id(ks)] = default_registry().build_for_context(ks.context.quantized(bits, group_size))
            plan[i] = _layer(fm, i, kq, PoolFormat(bits, group_size))
    for i, q in plan.items():
        f, qf = fm.fusions.get(i), q.fusion
        if f is not None and qf is not None:
            qf.direct, qf.direct_reason, qf.pack_reason = f.direct, f.direct_reason, f.pack_reason
    return plan


def _layer(fm: FusedModel, i: int, kq, fmt: PoolFormat) -> QuantLayer:
    q = QuantLayer(i, fmt, store=kq.kv_store_quant, attention=getattr(kq, "attention_quant", None))
    rq, f = kq.rope_quant, fm.fusions.get(i)
    if f is not None and rq is not None:
        q.fusion = Fusion(i, rq, f.switch, norm_kernel=rq.norm)
    elif f is None:
        q.reasons["rope"] = fm.reasons.get(i, "the layer's float cache is not fused")
    else:
        q.reasons["rope"] = f"rope_quant_pool_fused not selected: {kq.rejections.get('rope_quant_pool_fused', '?')}"
    if q.store is None:
        q.reasons["store"] = f"kv_quant_pool_store not selected: {kq.rejections.get('kv_quant_pool_store', '?')}"
    if q.attention is None:
        q.reasons["attention"] = kq.rejections.get("decode_attention_quantized", "no quantized attention kernel")
    return q


def explain(fm: FusedModel) -> list[str]:
    """FusedModel.explain's lines for the quantized formats made so far."""
    from .mlx_lm import ranges

    lines = []
    for plan in fm.quant.values():
        groups: dict[str, list[int]] = {}
        for i, q in plan.items():
            groups.setdefault(q.describe(), []).append(i)
        lines += [f"layers {ranges(sorted(ls))}, quantized {what}" for what, ls in groups.items()]
    return lines


class QuantizedKVCache(_Fused, _stock.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache; its writes and attention in the kernels (module docstring)."""

    _quant: QuantLayer | None = None

    def __init__(self, group_size: int = 64, bits: int = 8, quant: QuantLayer | None = None):
        super().__init__(group_size=group_size, bits=bits)
        self._bind(quant)

    def _bind(self, quant: QuantLayer | None) -> "QuantizedKVCache":
        self._quant = quant
        self._fusion = None if quant is None else quant.fusion
        return self

    @property
    def kernel(self):
        q = self._quant
        return None if q is None else (q.fusion.kernel if q.fusion is not None else q.store)

    @property
    def reason(self) -> str:
        return "not bound to a model layer" if self._quant is None else self._quant.describe()

    # -- the buffers
    def _pools(self) -> tuple:
        return (*self.keys, *self.values)

    def _set_pools(self, pools) -> None:
        self.keys, self.values = tuple(pools[:3]), tuple(pools[3:])

    def _room(self, prev: int, keys: mx.array, values: mx.array) -> None:
        """Rows [prev, prev + L) made to exist, as mlx-lm's update_and_fetch grows its buffers: whole
        steps of 256 zero rows, the buffers cut at prev first when prev is not on a step boundary."""
        L = keys.shape[2]
        if self.keys is not None and prev + L <= self.keys[0].shape[2]:
            return
        B, H = keys.shape[:2]
        rows = _steps(L, self.step)

        def zeros(dim):
            return (mx.zeros((B, H, rows, dim * self.bits // 32), mx.uint32),
                    mx.zeros((B, H, rows, dim // self.group_size), keys.dtype),
                    mx.zeros((B, H, rows, dim // self.group_size), keys.dtype))

        if self.keys is None:
            self.keys, self.values = zeros(keys.shape[3]), zeros(values.shape[3])
            return
        if prev % self.step:
            self.keys, self.values = (tuple(x[..., :prev, :] for x in side) for side in (self.keys, self.values))
        self.keys, self.values = (tuple(mx.concatenate([x, z], axis=2) for x, z in zip(side, zeros(D)))
                                  for side, D in ((self.keys, keys.shape[3]), (self.values, values.shape[3])))

    def keys_and_values(self):
        n = self.__dict__["_fused_off"]
        k, v = self.keys, self.values
        if n != k[0].shape[2]:
            k, v = tuple(x[:, :, :n] for x in k), tuple(x[:, :, :n] for x in v)
        return QuantRows(k, self), QuantRows(v, self)

    # -- writes
    def fused_update(self, q, k, v, weights=None):
        """(rotated q, rotated k, keys, values): one rope_quant_pool_fused call quantizing rows
        [offset, offset + L) of every batch row into the buffers (weights: the q/k norm weights)."""
        prev = self.__dict__["_fused_off"]
        self._room(prev, k, v)
        q, k = self._write(q, k, v, *_rows_index(prev, k.shape, self.keys[0].shape[2], self._fusion.backend), weights)
        self.__dict__["_fused_off"] = prev + k.shape[2]
        if self.__dict__.get("_direct"):      # direct_attend reads the buffers: no slices to build
            return q, k, QuantRows(self.keys, self), QuantRows(self.values, self)
        return (q, k, *self.keys_and_values())

    def direct_update(self, attn, q, k, v, norms):
        self.__dict__["_direct"] = True
        try:
            return super().direct_update(attn, q, k, v, norms)
        finally:
            self.__dict__["_direct"] = False

    def _plain_update(self, keys, values):
        """Rows the forward rotated itself: kv_quant_pool_store into the buffers in place, else
        mlx-lm's own update (the scales' dtype or the format not the kernel's)."""
        quant = self._quant
        store = None if quant is None else quant.store
        if store is None or not keys.dtype == values.dtype or (self.keys is not None and
                                                                self.keys[1].dtype != keys.dtype):
            if quant is not None:
                quant.calls["stock"] += 1
            return self._stock_update(keys, values)
        prev = self.__dict__["_fused_off"]
        self._room(prev, keys, values)
        slots = _rows_index(prev, keys.shape, self.keys[0].shape[2], store.backend)[1]
        last = self.__dict__.get("_launch_store")
        if last is None or last[0] is not store:   # the first write, or the first since a snapshot
            self._unshare()
            last = self.__dict__["_launch_store"] = (store, store.last_bound())
        self._set_pools(last[1](keys, values, slots, *self._pools()))
        self.__dict__["_fused_off"] = prev + keys.shape[2]
        quant.calls["store"] += 1
        return self.keys_and_values()

    # -- attention
    def direct_attend(self, attn, q: mx.array, mask):
        """direct_attention's attention after direct_update: this cache's own (attend)."""
        return self.attend(q, attn.scale, mask)

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        """Attention of queries [B, Hq, L, D] over this cache's valid rows (module docstring)."""
        quant = self._quant
        B, _, L, _ = queries.shape
        if quant is not None and quant.attention is not None and L <= MAX_DECODE and (mask is None or (
                isinstance(mask, str) and mask == "causal")):
            # the rows [0, offset) of every batch row, causal among the L queries: the kernel's own ranges
            n = self.__dict__["_fused_off"]
            ends = device_arange(n, B, 0, quant.attention.backend) if B > 1 else \
                device_arange(n, 1, 1, quant.attention.backend)
            quant.calls["attention"] += 1
            return quant.attention(queries, self.keys, self.values, ends, ends, scale=scale, check=False)
        keys, values = self.keys_and_values()
        if _backend(quant) == "cuda":
            k = mx.dequantize(*keys, group_size=self.group_size, bits=self.bits)
            v = mx.dequantize(*values, group_size=self.group_size, bits=self.bits)
            if quant is not None:
                quant.calls["dequantized"] += 1
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        if quant is not None:
            quant.calls["mlx-lm"] += 1
        return _ORIGINAL[0](queries, tuple(keys), tuple(values), scale=scale, mask=mask, group_size=self.group_size,
                            bits=self.bits)


def _backend(quant: QuantLayer | None) -> str:
    from ..core import backend_of

    backend = None if quant is None else quant.backend
    return backend or backend_of(None)


def adopt(cache, quant: QuantLayer | None) -> QuantizedKVCache:
    """Our QuantizedKVCache holding the arrays of an mlx-lm QuantizedKVCache (to_quantized's, a loaded
    one), bound to `quant`."""
    return _adopt(cache, None if quant is None else quant.fusion, QuantizedKVCache)._bind(quant)


def quantized_entry(entry, fm: FusedModel, i: int, bits: int, group_size: int):
    """make_prompt_cache(kv_bits=...)'s cache for layer i: an empty QuantizedKVCache where the layer's
    own cache is a KVCache, else the entry as it is (rotating caches stay float: mlx-lm cannot
    quantize them)."""
    from .mlx_lm import cache_at, kv_cache_path
    from .mlx_lm_cache import _replace

    path = kv_cache_path(entry)
    if path is None or type(cache_at(entry, path)).__name__ != "KVCache" or i not in fm.kernels.by_layer:
        return entry
    new = QuantizedKVCache(group_size, bits, quant_layers(fm, bits, group_size)[i])
    if path:
        entry.kernel, entry.reason = new.kernel, new.reason
    return _replace(entry, path, new)


# ----------------------------------------------------------------------------- mlx-lm's quantized attention

_ORIGINAL: list = []


def install_attention() -> None:
    """Wrap mlx_lm.models.base.quantized_scaled_dot_product_attention (which base's
    scaled_dot_product_attention calls for a cache with `bits`): keys this module's caches returned go
    to their cache's attend; anything else runs mlx-lm's function unchanged. Once per process."""
    base = import_mlx_lm_module("base")
    current = base.quantized_scaled_dot_product_attention
    if getattr(current, "_mlx_aot_wrapped", False):
        return
    _ORIGINAL[:] = [current]

    def quantized_scaled_dot_product_attention(queries, q_keys, q_values, scale, mask, group_size=64, bits=8):
        cache = getattr(q_keys, "cache", None)
        if isinstance(cache, QuantizedKVCache):
            return cache.attend(queries, scale, mask)
        return current(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)

    quantized_scaled_dot_product_attention._mlx_aot_wrapped = True
    quantized_scaled_dot_product_attention.__wrapped__ = current
    quantized_scaled_dot_product_attention.__doc__ = current.__doc__
    base.quantized_scaled_dot_product_attention = quantized_scaled_dot_product_attention
