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
  - attention (`attend`): up to 8 query tokens on decode_attention_quantized where selected, each
    row's valid range as data (a lone cache: mask None or "causal", rows [0, offset); a batch cache:
    the array mask its make_mask made, rows [_idx - offset[b], _idx) of row b); else mlx-lm's own
    quantized attention (mx.quantized_matmul) with the mask on the CPU and Metal, and on CUDA, where
    MLX 0.32.4's quantized_matmul has no kernel for these shapes, the valid rows dequantized
    (mx.dequantize) and MLX's fused sdpa with the mask: so prefill chunks dequantize the whole valid
    range once per chunk. The model's attention code reaches it through mlx-lm's own
    `quantized_scaled_dot_product_attention`, which `install_attention` wraps: keys that this module's
    caches returned (`QuantRows`) go to their cache; every other call runs mlx-lm's function.

Batching (mlx-lm's BatchGenerator, batch_generate): `QuantizedKVCache.merge` makes a
`BatchQuantizedKVCache`, mlx-lm's BatchKVCache layout (left padding, per-row offsets, _idx) in the
same buffer format, bound to the same layer; mlx-lm 0.32.2 has no quantized batch cache of its own
(its QuantizedKVCache has no merge: BatchGenerator raises ValueError). Each update writes rows
[_idx, _idx + L) of every row in place through the same kernels, RoPE at each row's own positions
(offset[b] + l); prepare/finalize (the right-padded prefill rolled into left padding), filter (a
gather of the rows shifted past the padding the kept rows share: new buffers, no view), extend, trim
and make_mask as mlx-lm's BatchKVCache; extract(i) gives request i's rows as a QuantizedKVCache in
buffers of their own, a snapshot the batch's later writes never change. state is (keys, values,
offset, left_padding, _idx, group_size, bits); mlx-lm's load_prompt_cache knows no
BatchQuantizedKVCache class, so save the requests' extracted caches (QuantizedKVCache files, which
stock mlx-lm reads).

Not quantized: rotating caches (sliding windows, max_kv_size) stay float drop-in caches, as mlx-lm
cannot quantize them (its to_quantized raises); in a batch they merge into the float drop-in's
BatchRotatingKVCache. No class here has to_quantized, so generate_step(kv_bits=...)'s conversion
(maybe_quantize_kv_cache) leaves these caches as they are.
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
from .mlx_lm_cache import (_MASKS, Fusion, FusedModel, _adopt, _batch_index, _compact, _Fused, _row_ends,
                           _rows_index, _steps)

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


class _Quantized(_Fused):
    """What the drop-in quantized caches share (QuantizedKVCache, BatchQuantizedKVCache): the binding to
    a QuantLayer, the buffers as the kernels' pools, the writes and the attention. Mixed in before
    the mlx-lm-level class; each class says where its rows go (`_index`, `_advance`, `_rows`) and
    which valid ranges the attention kernel reads (`_kernel_ranges`)."""

    _quant: QuantLayer | None = None

    def _bind(self, quant: QuantLayer | None):
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
        _room(self, prev, keys, values)

    def keys_and_values(self):
        n = self._rows()
        k, v = self.keys, self.values
        if n != k[0].shape[2]:
            k, v = tuple(x[:, :, :n] for x in k), tuple(x[:, :, :n] for x in v)
        return QuantRows(k, self), QuantRows(v, self)

    # -- writes
    def fused_update(self, q, k, v, weights=None):
        """(rotated q, rotated k, keys, values): one rope_quant_pool_fused call quantizing the L new
        rows of every batch row into the buffers (weights: the q/k norm weights)."""
        prev, L = self._start(), k.shape[2]
        self._room(prev, k, v)
        q, k = self._write(q, k, v, *self._index(prev, k.shape, self.keys[0].shape[2], self._fusion.backend), weights)
        self._advance(L)
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
        prev = self._start()
        self._room(prev, keys, values)
        slots = self._index(prev, keys.shape, self.keys[0].shape[2], store.backend)[1]
        last = self.__dict__.get("_launch_store")
        if last is None or last[0] is not store:   # the first write, or the first since a snapshot
            self._unshare()
            last = self.__dict__["_launch_store"] = (store, store.last_bound())
        self._set_pools(last[1](keys, values, slots, *self._pools()))
        self._advance(keys.shape[2])
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
        if quant is not None and quant.attention is not None and L <= MAX_DECODE:
            ranges = self._kernel_ranges(B, mask, quant.attention.backend)
            if ranges is not None:
                kv_len, kv_end, window = ranges
                quant.calls["attention"] += 1
                return quant.attention(queries, self.keys, self.values, kv_len, kv_end, scale=scale, window=window,
                                       check=False)
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


class QuantizedKVCache(_Quantized, _stock.QuantizedKVCache):
    """mlx-lm's QuantizedKVCache; its writes and attention in the kernels (module docstring)."""

    def __init__(self, group_size: int = 64, bits: int = 8, quant: QuantLayer | None = None):
        super().__init__(group_size=group_size, bits=bits)
        self._bind(quant)

    def _start(self) -> int:
        return self.__dict__["_fused_off"]

    _rows = _start

    def _index(self, prev: int, shape: tuple, S: int, backend: str):
        return _rows_index(prev, shape, S, backend)

    def _advance(self, L: int) -> None:
        self.__dict__["_fused_off"] += L

    def _kernel_ranges(self, B: int, mask, backend: str):
        # mask None or "causal": the rows [0, offset) of every batch row, causal among the L queries
        if not (mask is None or (isinstance(mask, str) and mask == "causal")):
            return None
        n = self.__dict__["_fused_off"]
        ends = device_arange(n, B, 0, backend) if B > 1 else device_arange(n, 1, 1, backend)
        return ends, ends, 0

    @classmethod
    def merge(cls, caches):
        """BatchGenerator's merge of per-request caches: a BatchQuantizedKVCache (left-padded rows)."""
        return BatchQuantizedKVCache.merge(caches)


def _room(cache, prev: int, keys: mx.array, values: mx.array) -> None:
    """Rows [prev, prev + L) of the cache's buffers made to exist, as mlx-lm's update_and_fetch grows
    them: whole steps of 256 zero rows, the buffers cut at prev first when prev is not on a step
    boundary (prev: the lone cache's offset, the batch cache's _idx)."""
    L = keys.shape[2]
    if cache.keys is not None and prev + L <= cache.keys[0].shape[2]:
        return
    B, H = keys.shape[:2]
    rows = _steps(L, cache.step)
    bits, gs = cache.bits, cache.group_size

    def zeros(dim):
        return (mx.zeros((B, H, rows, dim * bits // 32), mx.uint32),
                mx.zeros((B, H, rows, dim // gs), keys.dtype),
                mx.zeros((B, H, rows, dim // gs), keys.dtype))

    if cache.keys is None:
        cache.keys, cache.values = zeros(keys.shape[3]), zeros(values.shape[3])
        return
    if prev % cache.step:
        cache.keys, cache.values = (tuple(x[..., :prev, :] for x in side) for side in (cache.keys, cache.values))
    cache.keys, cache.values = (tuple(mx.concatenate([x, z], axis=2) for x, z in zip(side, zeros(D)))
                                for side, D in ((cache.keys, keys.shape[3]), (cache.values, values.shape[3])))


# ----------------------------------------------------------------------------- the batch cache

class _BatchQuantized(_stock.BatchKVCache):
    """mlx-lm's BatchKVCache (left-padded rows, per-row offsets, _idx the next buffer row of every
    row) in mlx-lm's quantized buffer format, as mlx-lm would write it (mx.quantize and slice
    assignment): the class BatchQuantizedKVCache puts the kernels on. mlx-lm 0.32.2 has no such
    class; its BatchKVCache's prepare, trim, size, empty, make_mask and filter's bookkeeping apply
    unchanged, the methods that touch the buffers are here."""

    def __init__(self, left_padding, group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys, values):
        prev, L = self._idx, keys.shape[2]
        _room(self, prev, keys, values)
        self.offset = self.offset + L
        self._idx += L
        for side, new in ((self.keys, keys), (self.values, values)):
            for x, q in zip(side, mx.quantize(new, group_size=self.group_size, bits=self.bits)):
                x[..., prev:self._idx, :] = q
        return self.keys_and_values()

    def keys_and_values(self):
        return tuple(x[..., :self._idx, :] for x in self.keys), tuple(x[..., :self._idx, :] for x in self.values)

    def finalize(self):
        """mlx-lm's: the right-padded prefill's rows rolled right by each row's padding (left padding)."""
        padding = self._right_padding
        if padding is None:
            return
        if self.keys is not None:
            shifts = padding[:, None]
            self.keys, self.values = (tuple(_stock.dynamic_roll(x, shifts, axis=2) for x in side)
                                      for side in (self.keys, self.values))
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits = v
        self.keys = None if self.keys is None else tuple(self.keys)
        self.values = None if self.values is None else tuple(self.values)
        self.__dict__.setdefault("_right_padding", None)

    def extend(self, other):
        """mlx-lm's BatchKVCache.extend: both batches' rows right-justified at the larger _idx, in one
        buffer as long as the longer one (every array of the format)."""
        _check_same_format([self, other], "extend")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        ref = self if self.keys is not None else other

        def pad(c):
            if c.keys is None:
                Bc = c.offset.shape[0]
                k, v = (tuple(mx.zeros((Bc, *x.shape[1:2], 0, x.shape[3]), x.dtype) for x in side)
                        for side in (ref.keys, ref.values))
            else:
                k, v = c.keys, c.values
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = tuple(x[..., :right, :] for x in k), tuple(x[..., :right, :] for x in v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = tuple(mx.pad(x, widths) for x in k), tuple(mx.pad(x, widths) for x in v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([p1, p2])
        self._idx = max_idx

    @property
    def nbytes(self):
        return 0 if self.keys is None else sum(x.nbytes for x in (*self.keys, *self.values))


def _check_same_format(caches, who: str) -> None:
    formats = {(c.bits, c.group_size) for c in caches}
    if len(formats) > 1:
        raise ValueError(f"BatchQuantizedKVCache.{who}: the caches have different formats "
                         f"({', '.join(f'{b}-bit, group size {g}' for b, g in sorted(formats))})")


class BatchQuantizedKVCache(_Quantized, _BatchQuantized):
    """The batch form of QuantizedKVCache, for mlx-lm's BatchGenerator (module docstring): mlx-lm's
    BatchKVCache layout (left padding, per-row offsets) in the quantized buffer format; each update
    is one kernel call writing rows [_idx, _idx + L) of every row in place, RoPE at each row's own
    positions; attention through decode_attention_quantized with each row's valid range."""

    def __init__(self, left_padding, group_size: int = 64, bits: int = 8, quant: QuantLayer | None = None):
        super().__init__(left_padding, group_size=group_size, bits=bits)
        self._bind(quant)

    def _start(self) -> int:
        return self._idx

    _rows = _start

    def _index(self, prev: int, shape: tuple, S: int, backend: str):
        # token l of row b at position offset[b] + l, written to buffer row prev + l of row b
        return _batch_index(self.__dict__["_fused_off"], prev, shape[2], S, backend)

    def _advance(self, L: int) -> None:
        self.offset = self.__dict__["_fused_off"] + L
        self._idx += L

    def _kernel_ranges(self, B: int, mask, backend: str):
        # Only a mask this class made (make_mask: causal, the left padding masked, maybe a window): row b's
        # offset[b] tokens end at _idx, the left padding before them, causal among the L queries.
        made = _MASKS.get(id(mask)) if isinstance(mask, mx.array) else None
        if made is None or made[0] is not mask or made[1] is not type(self):
            return None
        off = self.__dict__["_fused_off"]
        return (off if off.dtype == mx.int32 else off.astype(mx.int32)), _row_ends(self._idx, B, backend), \
            int(made[2] or 0)

    @classmethod
    def merge(cls, caches):
        """Per-request quantized caches (QuantizedKVCache, ours or mlx-lm's; one row each) as one
        batch: each request's rows right-justified at the longest one's length (left padding), as
        mlx-lm's BatchKVCache.merge does; bound to the first bound cache's layer."""
        _check_same_format(caches, "merge")
        quant = next((c._quant for c in caches if isinstance(c, _Quantized) and c._quant is not None), None)
        bits, gs = caches[0].bits, caches[0].group_size
        lengths = [int(c.offset) if c.keys is not None else 0 for c in caches]
        n = max(lengths)
        if n == 0:
            return cls([0] * len(caches), gs, bits, quant)
        ref = next(c for c in caches if c.keys is not None)

        def rows(c, side: int):
            arrays = (c.keys, c.values)[side] if c.keys is not None else None
            out = []
            for j, r in enumerate((ref.keys, ref.values)[side]):
                if arrays is None:
                    out.append(mx.zeros((1, r.shape[1], n, r.shape[3]), r.dtype))
                    continue
                x = arrays[j][..., :int(c.offset), :]
                out.append(x if x.shape[2] == n else mx.pad(x, [(0, 0), (0, 0), (n - x.shape[2], 0), (0, 0)]))
            return out

        cache = cls([n - m for m in lengths], gs, bits, quant)
        parts = [(rows(c, 0), rows(c, 1)) for c in caches]
        cache.keys = tuple(mx.concatenate([p[0][j] for p in parts]) for j in range(3))
        cache.values = tuple(mx.concatenate([p[1][j] for p in parts]) for j in range(3))
        cache.offset = cache.offset + n
        cache._idx = n
        return cache

    def filter(self, batch_indices):
        """mlx-lm's, but the buffers stay pools (as mlx_lm_cache.BatchKVCache.filter): the gather reads
        the rows already shifted past the left padding every kept row shares, so its output is a new
        buffer, never a view the kernels could write only through a copy."""
        keys, values, idx = self.keys, self.values, self._idx
        self.keys = self.values = None
        try:
            super().filter(batch_indices)          # offsets, left padding and _idx, shifted as mlx-lm's
        finally:
            self.keys, self.values = keys, values
        if keys is not None:
            shift = idx - self._idx
            self.keys, self.values = (tuple((x[..., shift:, :] if shift else x)[batch_indices] for x in side)
                                      for side in (keys, values))

    def extract(self, idx):
        """Request idx's rows as a QuantizedKVCache of this layer, in buffers of their own (_compact):
        a snapshot the batch's later in-place writes never change."""
        mx.eval(self.left_padding)
        padding = self.left_padding.tolist()[idx]
        cache = QuantizedKVCache(self.group_size, self.bits, self._quant)
        if self.keys is not None:
            cache.keys, cache.values = (tuple(_compact(x[idx:idx + 1, :, padding:self._idx]) for x in side)
                                        for side in (self.keys, self.values))
            cache.offset = self._idx - padding
        self._handed_out()
        return cache


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
        if isinstance(cache, _Quantized):
            return cache.attend(queries, scale, mask)
        return current(queries, q_keys, q_values, scale=scale, mask=mask, group_size=group_size, bits=bits)

    quantized_scaled_dot_product_attention._mlx_aot_wrapped = True
    quantized_scaled_dot_product_attention.__wrapped__ = current
    quantized_scaled_dot_product_attention.__doc__ = current.__doc__
    base.quantized_scaled_dot_product_attention = quantized_scaled_dot_product_attention
