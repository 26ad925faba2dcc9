"""Drop-in prompt caches for mlx-lm's own `generate_step` / `generate` / `stream_generate` and its
`BatchGenerator` (docs/engine.md, "The drop-in cache").

`make_prompt_cache(model)` returns mlx-lm's own cache list for the model with the KV cache of every
layer where the fused kernel is selected replaced by a subclass of the same mlx-lm class (same name,
same state, same head-major `[B, Hkv, S, D]` buffer grown by 256 steps). In those layers RoPE on q
and k plus the cache write run as one `rope_pool_fused` call writing the buffer directly, and
attention reads a slice of it, as with mlx-lm's own cache.

How the rope call reaches the cache write when the user calls mlx-lm directly: the attention runs
`q = self.rope(q, offset=cache.offset)`, `k = self.rope(k, offset=cache.offset)`, then
`cache.update_and_fetch(k, v)`. Two ways, both installed by make_prompt_cache, permanently:
  - direct (direct_attention.py): a fused layer whose attention is the llama form (checked by running
    it) gets a subclass of its class whose forward, given one of these caches, runs that form with
    the two rope calls and the cache write as one `cache.direct_update` call: no capture at all;
  - the rope capture, for every other fused layer (and with MLX_AOT_DIRECT_ATTENTION=0), below.
The capture: make_prompt_cache installs a `SwitchRope` in place of each fused layer's rope. When model code (an `mlx_lm.models.*` module other than the cache
module) reads a fused cache's `offset`, it gets an object of its own (a fresh int subclass, or the
batch caches' offset array) and the layer's switch is told to expect it; a rope call with that very
object (identity) returns a lazy NaN placeholder and is recorded for that cache
(`_capture.RopeCapture`), whose update_and_fetch checks the forward's two calls (`split`: q and k,
keys the rope's output), runs the kernel on their inputs and resolves both placeholders with the
kernel's q and k (`_capture.resolve` rebinds the array). Every other call (mlx-lm's own caches, the
slot engine, no cache) runs the original rope. A forward that breaks the contract is resolved with
the module's own rope and written the stock way. mlx-lm's cache module, its generate loop and user
code read the plain offset, so the expected object cannot leak into another cache.

What each cache type does in a fused layer:
  - KVCache, BatchKVCache: every update (prefill chunks and decode) is one kernel call writing
    rows [idx, idx + L) of each batch row in place; growth (256 steps, as mlx-lm) is the only copy.
  - RotatingKVCache, BatchRotatingKVCache: decode steps (L = 1) are one kernel call writing the
    ring slot in place (growth, trim and wrap-around as mlx-lm). Prefill chunks (L > 1) run one
    kernel call that rotates q and k with the write skipped (slot -1), then mlx-lm's own
    concatenation: mlx-lm rebuilds the window in temporal order by concatenating there (the buffer
    is max_size + L - 1 long afterwards), so there is no slot of an existing buffer to write into.
  - QuantizedKVCache: the quantized drop-in class of mlx_lm_quant_cache.py (make_prompt_cache(kv_bits=),
    KVCache.to_quantized, a loaded cache bound again); BatchGenerator merges it into that module's
    BatchQuantizedKVCache.
  - Every other cache class (ChunkedKVCache, ConcatenateKVCache, ArraysCache) stays mlx-lm's own,
    with `.kernel = None` and `.reason`.

Saving: the classes carry mlx-lm's names and state, so `save_prompt_cache` writes a file stock
mlx-lm loads; `load_prompt_cache(path, model)` here loads it and re-binds the fused layers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from . import direct_attention
from ._capture import (DataflowError, RopeCall, RopeCapture, rebind, resolve, resolve_with_module_rope,
                       split_calls)
from .. import envs
from ..errors import NativeUnavailableError
from ..native import COPY_ADVISERS, device_arange, device_indices, import_ext
from .mlx_lm import (ModelKernels, build_kernel_sets, cache_at, find_attention_layers, import_mlx_lm_module,
                     kv_cache_path, rope_attr)

_stock = import_mlx_lm_module("cache")


class _Offset(int):
    """A cache offset with an identity of its own: arithmetic on it gives plain ints."""
    __slots__ = ()


class SwitchRope:
    """Stands in for a fused layer's rope, permanently. A call made with an offset object one of our
    caches handed out to model code (identity) is recorded for that cache and returns a lazy NaN
    placeholder (`_capture.RopeCapture`'s), which that cache's update_and_fetch resolves; every other
    call runs the original rope."""

    wraps_rope = True          # registry.rope.normalize_rope looks through it

    def __init__(self, rope: Any):
        self.rope = rope
        self._expected: list = []           # (offset object, cache that handed it out)
        self.calls: list = []               # (cache, RopeCall)

    def take(self, cache) -> list:
        """The calls recorded for `cache` since its last write. Any other record (a forward that
        failed before its write) gets the original rope's output, so no placeholder stays NaN."""
        calls = self.calls
        self.calls = []
        self._expected = []
        if len(calls) == 2 and calls[0][0] is cache and calls[1][0] is cache:   # the common case
            return [calls[0][1], calls[1][1]]
        mine = []
        for owner, c in calls:
            if owner is cache:
                mine.append(c)
            else:
                c = _plain_offsets(c)
                resolve(c, self.rope(c.x, *c.args, **c.kwargs))
        return mine

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        off = kwargs.get("offset") if kwargs else (args[0] if args else None)
        if off is not None:
            for e, cache in self._expected:
                if off is e:
                    # Recorded as called (our offset object included: _plain_offsets converts it
                    # where the original rope replays a record); the placeholder memo's hit inline.
                    nan = _NAN.get((x.shape, x.dtype))
                    ph = mx.array(nan) if nan is not None else _placeholder(x)
                    self.calls.append((cache, RopeCall(x, ph, args, kwargs)))
                    return ph
            if isinstance(off, _Offset):     # one of our offsets that no cache expects: a plain int
                if "offset" in kwargs:
                    kwargs = {**kwargs, "offset": int(off)}
                else:
                    args = (int(off),) + args[1:]
        return self.rope(x, *args, **kwargs)

    def __getattr__(self, name):           # dims, base, ... of the original rope
        if name == "rope":
            raise AttributeError(name)
        return getattr(self.rope, name)


def _plain_offsets(c: RopeCall) -> RopeCall:
    """A record with our offset objects as plain ints, for the original rope to replay it."""
    c.args = tuple(int(a) if isinstance(a, _Offset) else a for a in c.args)
    c.kwargs = {k: int(a) if isinstance(a, _Offset) else a for k, a in c.kwargs.items()}
    return c


_NAN: dict[tuple, mx.array] = {}


def _placeholder(x: mx.array) -> mx.array:
    """A fresh array object shaped like x sharing one lazy NaN array per shape and dtype: cheaper
    than a new mx.full node per call, and the rebind that resolves it replaces only this object's
    descriptor, never the shared one."""
    key = (x.shape, x.dtype)
    nan = _NAN.get(key)
    if nan is None:
        if len(_NAN) > 32:
            _NAN.clear()
        nan = _NAN[key] = mx.full(x.shape, math.nan, dtype=x.dtype)
    return mx.array(nan)


@dataclass
class Fusion:
    """What the caches of one fused layer share."""
    layer: int
    kernel: Any                # the kernel set's rope_pool_fused kernel object
    switch: SwitchRope
    calls: Counter = field(default_factory=Counter)   # 'fused' | 'rotate_only' | 'stock' (+ last fallback reason)
    fallback: str = ""
    direct: bool = False       # the attention runs direct_attention's form (else: the rope capture)
    direct_reason: str = ""    # why not, when direct attention was asked for
    pack_reason: str = ""      # direct layers: why q/k/v run as three projections ("" = one, packed)
    norm_kernel: Any = None    # qk_norm_rope_pool_fused where the trace put the q/k norms right before RoPE:
                               # the direct form's norms run in the kernel too
    attention: Any = None      # decode_attention where selected: the direct form's masked decode attention
    attention_reason: str = "" # why not, when it is None
    owner: Any = field(default=None, repr=False)   # the FusedModel: to_quantized finds the layer's quantized form
    backend: str = field(init=False)   # the kernel's, for the index arrays (read per layer per step)

    def __post_init__(self):
        self.backend = self.kernel.backend

    @property
    def reason(self) -> str:
        """The kernel this layer's decode runs, and its implementation."""
        k = self.norm_kernel if self.direct and self.norm_kernel is not None else self.kernel
        return f"{k.NAME} ({k.implementation}{f': {k.reason}' if k.reason else ''})"

    def kernel_for(self, weights) -> Any:
        """The kernel of one call: the norm kernel when the q/k norm weights come with it."""
        return self.kernel if weights is None else self.norm_kernel

    @property
    def path(self) -> str:
        """How the attention reaches the kernel: 'direct forward' or 'rope capture (why not direct)'."""
        if self.direct:
            how = ["q/k norms in the kernel"] if self.norm_kernel is not None else []
            how.append(f"q/k/v as three projections: {self.pack_reason}" if self.pack_reason
                       else "q/k/v in one projection")
            if self.attention is not None:
                how.append(f"batch-cache decode attention: {self.attention.NAME} ({self.attention.implementation})")
            elif self.attention_reason:       # "" for the quantized caches: their attention is their own
                how.append(f"attention: MLX's sdpa ({self.attention_reason})")
            return f"direct forward ({'; '.join(how)})"
        return f"rope capture{f' ({self.direct_reason})' if self.direct_reason else ''}"


# ----------------------------------------------------------------------------- positions and slots

@functools.lru_cache(maxsize=64)
def _int_index(start: int, L: int, B: int, S: int, pos: int, backend: str) -> tuple[mx.array, mx.array]:
    """(positions, slots) int32 [B*L] for rows start..start+L-1 of each batch row of a [B, H, S, D]
    buffer (slot = b*S + row), token positions pos..pos+L-1, for the kernels of `backend` (in device
    memory on CUDA: registry.native.device_indices). Memoised: every layer of a step asks for the same."""
    ls = np.tile(np.arange(L, dtype=np.int64), B)
    bs = np.repeat(np.arange(B, dtype=np.int64), L)
    return device_indices(backend, pos + ls, bs * S + start + ls)


def _decode_index(pos: int, row: int, B: int, S: int, backend: str) -> tuple[mx.array, mx.array]:
    """(positions, slots) of a single-request cache's decode token: position pos, row `row` of each
    batch row (slot b*S + row). One request: both made on the device (registry.native.device_arange),
    one array for both when they are equal (KVCache: row = pos); a batch of equal rows: _int_index."""
    if B > 1:
        return _int_index(row, 1, B, S, pos, backend)
    slots = device_arange(row, 1, 1, backend)
    return (slots if pos == row else device_arange(pos, 1, 1, backend)), slots


def _rows_index(prev: int, shape: tuple, S: int, backend: str) -> tuple[mx.array, mx.array]:
    """(positions, slots) of the L tokens of k [B, H, L, D] appended at row prev of every batch row of
    a buffer of S rows (KVCache, QuantizedKVCache): positions prev.., slots b * S + prev + l."""
    B, L = shape[0], shape[2]
    return _decode_index(prev, prev, B, S, backend) if L == 1 else _int_index(prev, L, B, S, prev, backend)


_DUMMY_POOLS: dict[tuple, tuple[mx.array, mx.array]] = {}


def _dummy_pools(H: int, D: int, dtype) -> tuple[mx.array, mx.array]:
    """Two one-row pools for rotate-only calls (every slot -1: nothing is written). Two, not one
    passed twice: the launcher guards a buffer passed as both pools with a copy."""
    key = (H, D, dtype)
    if key not in _DUMMY_POOLS:
        _DUMMY_POOLS[key] = (mx.zeros((1, H, D), dtype=dtype), mx.zeros((1, H, D), dtype=dtype))
    return _DUMMY_POOLS[key]


# ----------------------------------------------------------------------------- the caches

class _Fused:
    """Shared part of the fused caches; mixed in before the mlx-lm class."""

    _fusion: Fusion | None = None
    direct_packed = True        # the direct forward runs decode steps' q/k/v as one projection (where packed)

    @property
    def offset(self):
        off = self.__dict__.get("_fused_off", 0)
        f = self._fusion
        # Only model code (the attention's rope calls) gets an offset object the switch expects:
        # mlx-lm's cache module (state, size, to_quantized, merge, masks), mlx-lm's generate loop and
        # user code get the plain value, so it cannot leak into another cache.
        if f is None:
            return off
        module = sys._getframe(1).f_globals.get("__name__", "")
        model_code = _MODEL_MODULES.get(module)          # the memo's hit inline: two reads per layer
        if model_code is None:
            model_code = _model_code(module)
        if model_code:
            if isinstance(off, int):
                off = _Offset(off)
            exp = f.switch._expected                     # the switch expects it for this cache
            exp.append((off, self))
            if len(exp) > 8:
                del exp[0]
        return off

    @offset.setter
    def offset(self, value):
        self.__dict__["_fused_off"] = int(value) if isinstance(value, int) else value

    @property
    def kernel(self):
        return self._fusion.kernel if self._fusion is not None else None

    @property
    def reason(self) -> str:
        return self._fusion.reason if self._fusion is not None else "not bound to a model layer"

    def __deepcopy__(self, memo):           # BatchGenerator deep-copies caches: share the binding
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k not in _LAUNCH_SLOTS:          # the copy starts its own streams of launches
                new.__dict__[k] = v if k in ("_fusion", "_quant") else copy.deepcopy(v, memo)
        self._handed_out()                      # MLX's deepcopy of an array is an alias: both share the buffers
        return new

    @property
    def state(self):
        """mlx-lm's state as a snapshot: every array a new array object of the same array (an alias,
        as copy.deepcopy gives), so writes of later steps never reach it (docs/native.md,
        "Snapshots"). Free when dropped, as mlx-lm's own loops do after evaluating it; one copy of
        the buffers at this cache's next write while it is kept."""
        st = super().state
        self._handed_out()
        return _alias(st)

    @state.setter
    def state(self, v):
        super(_Fused, type(self)).state.fset(self, v)
        self._handed_out()                      # the caller may still hold the arrays it set

    def _handed_out(self) -> None:
        """This cache's buffers were handed out (state, deepcopy, extract): dropping the launch slots
        makes the next write take _write's slow path, which runs _unshare first."""
        for k in _LAUNCH_SLOTS:
            self.__dict__.pop(k, None)

    def _unshare(self) -> None:
        """A buffer that another array object or a pending op still refers to (a snapshot handed out
        and kept) becomes a copy of its own (one concatenate, which the launcher takes in place), so
        the snapshot keeps its values and the launcher need not copy behind a guard, with a warning.
        A buffer not yet computed is left to the launcher: its own count also sees the pending
        launch's sibling outputs, which this one cannot tell from a snapshot."""
        counts = _owner_counts()
        if counts is None:
            return

        def unshared(a):
            if isinstance(a, (tuple, list)):            # a quantized buffer: (data, scales, biases)
                return type(a)(unshared(x) for x in a)
            if isinstance(a, mx.array):
                refs, buffer_refs = counts(a)
                if refs > 1 and buffer_refs >= 0:
                    return _compact(a)
            return a

        for name in ("keys", "values"):
            if self.__dict__.get(name) is not None:
                self.__dict__[name] = unshared(self.__dict__[name])

    def update_and_fetch(self, keys, values):
        """mlx-lm's update_and_fetch after the attention's two rope calls: the capture's path (the
        direct forward calls direct_update instead)."""
        calls, keys = self._captured(keys, values)
        if calls is None:
            return self._plain_update(keys, values)
        q_call, k_call = calls
        q, k, keys, values = self.fused_update(q_call.x, k_call.x, values)
        # The kernel's q and k have the shapes of its inputs, which the placeholders were made like.
        rebind(q_call.ph, q)
        rebind(k_call.ph, k)                 # free unless the attention reads its keys again
        return keys, values

    def direct_update(self, attn, q: mx.array, k: mx.array, v: mx.array, norms: bool):
        """direct_attention's step: (rotated q, keys, values) as the attention's q/k norms (norms=True),
        two rope calls and update_and_fetch would give them, in one kernel call when this cache is
        fused for attn's layer (its rope is this layer's switch; the norms too where the layer has a
        norm kernel); else those calls as written."""
        f = self._fusion
        if f is None or f.switch is not attn.rope:
            return direct_attention.stock_step(self, attn, q, k, v, norms)
        if not q.dtype == k.dtype == v.dtype:
            f.fallback = "q, k and v dtypes differ"
            return direct_attention.stock_step(self, attn, q, k, v, norms)
        weights = None
        if norms:
            if f.norm_kernel is not None:
                weights = (attn.q_norm.weight, attn.k_norm.weight)
            else:
                q, k = attn.q_norm(q), attn.k_norm(k)
        q, _, keys, values = self.fused_update(q, k, v, weights)
        return q, keys, values

    def _stock_update(self, keys, values):
        """mlx-lm's own update_and_fetch of this cache's class."""
        return super().update_and_fetch(keys, values)

    # The write of keys the forward already rotated (no capture, or a capture that fell back):
    # mlx-lm's own, unless the cache class has a kernel for it (the quantized caches' store).
    _plain_update = _stock_update

    def _pools(self) -> tuple:
        """The arrays the kernels write in place, in their argument order."""
        return self.keys, self.values

    def _set_pools(self, pools) -> None:
        self.keys, self.values = pools

    def make_mask(self, *args, **kwargs):
        """mlx-lm's mask; an array mask is remembered with the window it was made for, so that
        direct_attend can tell a mask it can read as valid ranges from any other."""
        mask = super().make_mask(*args, **kwargs)
        if isinstance(mask, mx.array):
            _remember_mask(mask, type(self), kwargs.get("window_size"))
        return mask

    def direct_attend(self, attn, q: mx.array, mask):
        """direct_attention's attention after direct_update: decode_attention over this cache's
        buffers read in place, each row's valid range from the cache's state, where the stock call
        would get an array mask (the batch caches, windowed masks): MLX's CUDA attention then
        leaves its fused kernel (docs/benchmarks/e2e-root-cause.md). None: run MLX's sdpa (mask
        None or "causal", which MLX's fused kernels take; a mask this cache did not make; L > 8)."""
        f = self._fusion
        if f is None or f.attention is None or not isinstance(mask, mx.array) or q.shape[2] > 8:
            return None
        made = _MASKS.get(id(mask))
        if made is None or made[0] is not mask or made[1] is not type(self) or self.keys is None:
            return None
        ranges = self._ranges(q.shape[2], made[2])
        if ranges is None:
            return None
        kv_len, kv_end, window = ranges
        f.calls["attention"] += 1
        return f.attention(q, self.keys, self.values, kv_len, kv_end, scale=attn.scale, window=window, check=False)

    def _ranges(self, L: int, window):
        """(kv_len, kv_end, window) of docs/kernel-abi.md for this cache after its update, or None."""
        return None

    def _batch_ranges(self):
        """A batch cache's (kv_len, kv_end): each row's offset, all ending at _idx."""
        off = self.__dict__["_fused_off"]
        return (off if off.dtype == mx.int32 else off.astype(mx.int32)), \
            _row_ends(self._idx, off.shape[0], self._fusion.backend)

    def _captured(self, keys: mx.array, values: mx.array):
        """(q call, k call) when this forward's two rope calls were recorded for this cache, else
        None: then the keys already hold the original rope's output and the write is mlx-lm's."""
        f = self._fusion
        if f is None:
            return None, keys
        calls = f.switch.take(self)
        if not calls:
            f.calls["stock"] += 1
            return None, keys
        try:
            q_call, k_call = split_calls(calls, keys, values)
            cur = self.__dict__.get("_fused_off", 0)
            for c in (q_call, k_call):
                kw = c.kwargs
                off = kw.get("offset", kw)
                # the cache's current offset: ints by value, the batch caches' arrays by identity
                if c.args or len(kw) != 1 or not (off is cur or (isinstance(off, int) and isinstance(cur, int)
                                                                 and off == cur)):
                    raise DataflowError("the q and k rope calls pass another offset than the cache's, or other "
                                        "arguments than offset=")
            if not q_call.x.dtype == k_call.x.dtype == values.dtype:
                raise DataflowError("q, k and v dtypes differ")
        except DataflowError as e:
            f.fallback = str(e)
            f.calls["stock"] += 1
            cap = RopeCapture(f.switch.rope)
            cap.calls = [_plain_offsets(c) for c in calls]
            return None, resolve_with_module_rope(cap, keys)
        return (q_call, k_call), keys

    def _rotate_only(self, q, k, values, positions, weights=None) -> tuple[mx.array, mx.array]:
        """One kernel call rotating q and k (normalising them first with the norm weights, when
        given) with the write skipped: (rotated q, rotated k)."""
        B, Hkv, L, D = k.shape
        kp, vp = _dummy_pools(Hkv, D, k.dtype)
        slots = mx.full((B * L,), -1, dtype=mx.int32)
        f = self._fusion
        q_rot, k_rot, kp, vp = f.kernel_for(weights)(q, k, values, positions, slots, kp, vp, *(weights or ()),
                                                     check_slots=False)
        _DUMMY_POOLS[(Hkv, D, k.dtype)] = (kp, vp)          # rebind, as with any in-place output
        f.calls["rotate_only"] += 1
        return q_rot, k_rot

    def _write(self, q, k, values, positions, slots, weights=None) -> tuple[mx.array, mx.array]:
        """One kernel call: rotate q and k (normalising them first with the norm weights, when given:
        the norm kernel), write k and v into self.keys/self.values at `slots`; returns (rotated q,
        rotated k). The kernel reads the attention's [B, H, L, D] views as they are (strided: token
        t = b * L + l, the order of positions and slots) and returns q and k in that shape."""
        f = self._fusion
        # This cache's own stream of launches per kernel (kernel.last_bound): steady decode calls launch
        # the last signature's plan directly, the launcher refusing any other shapes or dtypes.
        slot = "_launch" if weights is None else "_launch_norm"
        last = self.__dict__.get(slot)
        if last is None or last[0] is not f:       # the first write, or the first since a snapshot
            self._unshare()
            last = self.__dict__[slot] = (f, f.kernel_for(weights).last_bound())
        q_rot, k_rot, *pools = last[1](q, k, values, positions, slots, *self._pools(), *(weights or ()))
        self._set_pools(pools)
        f.calls["fused"] += 1
        return q_rot, k_rot

    def _grow(self, rows: int, keys: mx.array, values: mx.array, B: int | None = None) -> None:
        """Append `rows` zero rows to the buffers (allocating them when empty): the only copy."""
        B = keys.shape[0] if B is None else B
        new_k = mx.zeros((B, keys.shape[1], rows, keys.shape[3]), keys.dtype)
        new_v = mx.zeros((B, values.shape[1], rows, values.shape[3]), values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def _room(self, prev: int, keys: mx.array, values: mx.array) -> None:
        """KVCache/BatchKVCache: make rows [prev, prev + L) exist, growing by whole steps of 256
        (a buffer cut at prev first when prev is not on a step boundary, as mlx-lm does)."""
        L = keys.shape[2]
        if self.keys is None or prev + L > self.keys.shape[2]:
            if self.keys is not None and prev % self.step:
                self.keys, self.values = self.keys[..., :prev, :], self.values[..., :prev, :]
            self._grow(_steps(L, self.step), keys, values)

    def _ring_slot(self, prev: int, keys: mx.array, values: mx.array) -> int:
        """Rotating caches, one decode token: mlx-lm's in-place step up to the write (grow up to
        max_size, drop the rows a prefill left beyond it, wrap); returns how many rows were dropped."""
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            self._grow(min(self.step, self.max_size - prev), keys, values)
            self._idx = prev
        excess = self.keys.shape[2] - self.max_size
        if excess > 0:
            self.keys, self.values = self._trim(excess, self.keys), self._trim(excess, self.values)
            self._idx = self.max_size
        return max(excess, 0)


_MODEL_MODULES: dict[str, bool] = {}


def _row_ends(end: int, B: int, backend: str) -> mx.array:
    """int32 [B] of `end`, made on the device and memoised (every layer of a step asks for the same;
    at batch 1 the same array as a decode step's slot, device_arange(row, 1, 1))."""
    return device_arange(end, B, 0 if B > 1 else 1, backend)

# Array masks a fused cache made, by id: (the mask, the cache class, its window_size). mlx-lm's models
# make one mask per step from one layer's cache and pass it to every layer of that kind.
_MASKS: dict[int, tuple] = {}


def _remember_mask(mask: mx.array, cls: type, window) -> None:
    if len(_MASKS) >= 8:
        del _MASKS[next(iter(_MASKS))]
    _MASKS[id(mask)] = (mask, cls, window)


def _is_model_code(module: str) -> bool:
    return module.startswith("mlx_lm.models.") and module != "mlx_lm.models.cache"


def _model_code(module: str) -> bool:
    """_is_model_code, memoised by module name (every offset read of model code asks)."""
    hit = _MODEL_MODULES.get(module)
    if hit is None:
        if len(_MODEL_MODULES) > 1024:
            _MODEL_MODULES.clear()
        hit = _MODEL_MODULES[module] = _is_model_code(module)
    return hit


def _steps(n: int, step: int) -> int:
    return (n + step - 1) // step * step


class KVCache(_Fused, _stock.KVCache):
    """mlx-lm's KVCache; in a fused layer each update is one rope_pool_fused call into the buffer."""

    def __init__(self, fusion: Fusion | None = None):
        super().__init__()
        self._fusion = fusion

    def fused_update(self, q, k, v, weights=None):
        """(rotated q, rotated k, keys, values): one kernel call writing rows [offset, offset + L)
        (weights: the q/k norm weights, for the norm kernel)."""
        prev = self.__dict__["_fused_off"]
        self._room(prev, k, v)
        S = self.keys.shape[2]
        q, k = self._write(q, k, v, *_rows_index(prev, k.shape, S, self._fusion.backend), weights)
        n = self.__dict__["_fused_off"] = prev + k.shape[2]
        if n < S:
            return q, k, self.keys[:, :, :n], self.values[:, :, :n]     # [..., :n, :] parses slower (4-D buffers)
        return q, k, self.keys, self.values

    def _ranges(self, L, window):
        # an array mask on a lone cache: mlx-lm's causal mask with a window (offset = rows written)
        ends = _row_ends(self.__dict__["_fused_off"], self.keys.shape[0], self._fusion.backend)
        return ends, ends, int(window or 0)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's to_quantized (generate_step's kv_bits: its buffers through mx.quantize), as the
        drop-in QuantizedKVCache of this layer (mlx_lm_quant_cache.py) where the cache is bound."""
        quantized = super().to_quantized(group_size=group_size, bits=bits)
        f = self._fusion
        if f is None or f.owner is None:
            return quantized
        from . import mlx_lm_quant_cache as quant

        return quant.adopt(quantized, quant.quant_layers(f.owner, bits, group_size).get(f.layer))

    @classmethod
    def merge(cls, caches):
        return _rebind(BatchKVCache.merge(caches), caches)


class RotatingKVCache(_Fused, _stock.RotatingKVCache):
    """mlx-lm's RotatingKVCache; fused decode writes the ring slot in place (see the module docstring)."""

    def __init__(self, max_size, keep=0, fusion: Fusion | None = None):
        super().__init__(max_size, keep)
        self._fusion = fusion

    def fused_update(self, q, k, v, weights=None):
        """(rotated q, rotated k, keys, values): decode writes the ring slot in one kernel call; a
        prefill chunk rotates in one call, then mlx-lm's own concatenation."""
        prev, (B, _, L, _) = self.__dict__["_fused_off"], k.shape
        if L > 1:
            positions, _ = _int_index(0, L, B, 0, prev, self._fusion.backend)
            q, k = self._rotate_only(q, k, v, positions, weights)
            return (q, k, *self._stock_update(k, v))
        self._ring_slot(prev, k, v)
        if self._idx == self.max_size:
            self._idx = self.keep
        q, k = self._write(q, k, v, *_decode_index(prev, self._idx, B, self.keys.shape[2], self._fusion.backend),
                           weights)
        self.offset = prev + 1
        self._idx += 1
        return (q, k, *self.keys_and_values())

    @classmethod
    def merge(cls, caches):
        return _rebind(BatchRotatingKVCache.merge(caches), caches)


def _batch_index(offset: mx.array, start: int, L: int, S: int, backend: str) -> tuple[mx.array, mx.array]:
    """(positions, slots) int32 [B*L] for a batch cache: token l of row b at position offset[b] + l,
    written to row start + l of batch row b (slot b*S + start + l). Lazy: no host sync. The slots
    are a constant every layer of a step shares (memoised); a decode step's positions are the
    offsets themselves, and its slots b * S + start one Arange on the device (device_arange): no host
    data, so no per-step copy of managed memory that the GPU must fault in (ncu at batch 32: ~200 us
    per step, docs/benchmarks/e2e-root-cause.md, "Host memory on CUDA")."""
    B = offset.shape[0]
    if L == 1:
        return (offset if offset.dtype == mx.int32 else offset.astype(mx.int32)), device_arange(start, B, S, backend)
    _, slots = _int_index(start, L, B, S, 0, backend)
    positions = (offset.astype(mx.int32)[:, None] + mx.arange(L, dtype=mx.int32)[None]).reshape(-1)
    return positions, slots


class BatchKVCache(_Fused, _stock.BatchKVCache):
    """mlx-lm's BatchKVCache (left-padded rows, per-row offsets); fused like KVCache."""

    def __init__(self, left_padding, fusion: Fusion | None = None):
        super().__init__(left_padding)
        self._fusion = fusion

    def fused_update(self, q, k, v, weights=None):
        """(rotated q, rotated k, keys, values): one kernel call writing rows [_idx, _idx + L) of every row."""
        prev, L = self._idx, k.shape[2]
        self._room(prev, k, v)
        q, k = self._write(q, k, v, *_batch_index(self.__dict__["_fused_off"], prev, L, self.keys.shape[2],
                                                  self._fusion.backend), weights)
        self.offset = self.__dict__["_fused_off"] + L
        self._idx += L
        return (q, k, *self.keys_and_values())

    def _ranges(self, L, window):
        # row b: the offset[b] tokens it holds end at _idx (left padding before them)
        return (*self._batch_ranges(), int(window or 0))

    def filter(self, batch_indices):
        """mlx-lm's, but the buffers stay pools: mlx-lm gathers the kept rows, then slices off the
        left padding they all share (when the request with the longest prompt has finished), a
        view the launcher could write only through a copy, after computing it (a wait). Here the
        gather reads the sliced rows instead: the same values, and its output is a new buffer."""
        keys, values, idx = self.keys, self.values, self._idx
        self.keys = self.values = None
        try:
            super().filter(batch_indices)          # offsets, left padding and _idx, shifted as mlx-lm's
        finally:
            self.keys, self.values = keys, values
        if keys is not None:
            shift = idx - self._idx
            if shift:
                keys, values = keys[..., shift:, :], values[..., shift:, :]
            self.keys, self.values = keys[batch_indices], values[batch_indices]

    def extract(self, idx):
        """mlx-lm's, but the request's rows as buffers of their own (_compact): mlx-lm's
        mx.contiguous keeps a view of the batch buffer where the rows are contiguous there (one
        request, no padding), which the batch's later in-place writes would change."""
        mx.eval(self.left_padding)
        padding = self.left_padding.tolist()[idx]
        cache = KVCache(self._fusion)
        cache.keys = _compact(self.keys[idx:idx + 1, :, padding:self._idx])
        cache.values = _compact(self.values[idx:idx + 1, :, padding:self._idx])
        cache.offset = cache.keys.shape[2]
        self._handed_out()
        return cache


class BatchRotatingKVCache(_Fused, _stock.BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache; fused decode writes the ring slot in place, prefill chunks
    rotate in one call and concatenate as mlx-lm does."""

    def __init__(self, max_size, left_padding, fusion: Fusion | None = None):
        super().__init__(max_size, left_padding)
        self._fusion = fusion

    def fused_update(self, q, k, v, weights=None):
        """(rotated q, rotated k, keys, values), as RotatingKVCache's, per batch row."""
        off, L = self.__dict__["_fused_off"], k.shape[2]
        if L > 1:
            positions, _ = _batch_index(off, 0, L, 0, self._fusion.backend)
            q, k = self._rotate_only(q, k, v, positions, weights)
            return (q, k, *self._stock_update(k, v))
        if self._lengths is not None:
            raise RuntimeError("finalize() should be called before decoding with BatchRotatingKVCache")
        excess = self._ring_slot(self._offset, k, v)
        if excess:
            self.left_padding -= excess
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding -= 1
        q, k = self._write(q, k, v, *_batch_index(off, self._idx, 1, self.keys.shape[2], self._fusion.backend),
                           weights)
        self._offset += 1
        self.offset = off + 1
        self._idx += 1
        keys, values = self.keys_and_values()
        # As mlx-lm: evaluating the keys evaluates left_padding and offset (on the returned view,
        # so the stored buffer stays the kernel's output and the next call writes it in place).
        return q, k, mx.depends(keys, (self.left_padding, self.__dict__["_fused_off"])), values

    def _trim(self, trim_size, v, append=None):
        """mlx-lm's, but never a view: its batch _trim slices the buffer when nothing is appended (the
        first decode past a prefill longer than the window), and a view is no pool the kernel can
        write in place (the launcher would copy it on every such call, with a warning). One
        concatenate makes the same rows a buffer of their own, as RotatingKVCache._trim does."""
        v = super()._trim(trim_size, v, append)
        return _compact(v) if trim_size > 0 and append is None else v

    def _ranges(self, L, window):
        # decode only, a window no narrower than the ring: row b's min(offset[b], rows) newest rows end
        # at _idx, wrapping (the kernel clamps the count to the buffer's rows)
        if L != 1 or (window is not None and window < self.max_size):
            return None
        return (*self._batch_ranges(), 0)

    def extract(self, idx):
        """mlx-lm's, with the rows as buffers of their own, as BatchKVCache.extract."""
        mx.eval(self.left_padding, self.offset)
        padding = max(0, self.left_padding.tolist()[idx])
        keys, values, end = self.keys[idx:idx + 1], self.values[idx:idx + 1], self._idx
        if self.rotated:
            keys, values, end = mx.roll(keys, -self._idx, axis=2), mx.roll(values, -self._idx, axis=2), self.max_size
        cache = RotatingKVCache(self.max_size, fusion=self._fusion)
        cache.keys = _compact(keys[:, :, padding:end])
        cache.values = _compact(values[:, :, padding:end])
        cache.offset = self.offset.tolist()[idx]
        cache._idx = cache.keys.shape[2]
        self._handed_out()
        return cache


def _compact(v: mx.array) -> mx.array:
    """v [B, H, S, D] as a fresh row-contiguous buffer: a concatenate of two parts always writes a
    new one (mx.contiguous keeps a view that is already contiguous, with its offset)."""
    half = v.shape[2] // 2
    return mx.concatenate([v[..., :half, :], v[..., half:, :]], axis=2)


_LAUNCH_SLOTS = ("_launch", "_launch_norm", "_launch_store")


def _alias(x):
    """x with every array a new array object of the same array (nested tuples and lists too)."""
    if isinstance(x, mx.array):
        return copy.copy(x)
    return type(x)(_alias(y) for y in x) if isinstance(x, (tuple, list)) else x


def _copy_advice() -> str | None:
    """registry.native's copy adviser: when the launch that copies is a drop-in cache's write, what
    applies to its user (who never sees the pools the kernel returns)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _Fused._write.__code__:
        frame = frame.f_back
    if frame is None:
        return None
    cache = frame.f_locals.get("self")
    return (f"The pool is layer {cache._fusion.layer}'s {type(cache).__name__} buffer of the drop-in cache: "
            "something kept referring to it across a step (a cache.state / copy.deepcopy / extract snapshot "
            "taken between two forwards with no evaluation, or an op on cache.keys or cache.values not yet "
            "evaluated), or an mlx-lm cache method left the buffer as a view (please report that). A snapshot "
            "taken after an evaluation costs no such copy (docs/native.md, \"Snapshots\").")


COPY_ADVISERS.append(_copy_advice)


def _owner_counts():
    """registry._ext.owner_counts (array -> (array objects and pending ops referring to it, buffer
    owners or -1 when not computed)), or None without the extension: then every kernel runs its
    reference path, which writes no buffer in place."""
    try:
        return import_ext().owner_counts
    except NativeUnavailableError:
        return None


_FUSED = {c.__name__: c for c in (KVCache, RotatingKVCache, BatchKVCache, BatchRotatingKVCache)}


def _adopt(stock, fusion: Fusion | None, cls: type | None = None):
    """The fused counterpart of an mlx-lm cache object of one of the four classes (or `cls`), sharing
    its arrays."""
    cls = cls or _FUSED[type(stock).__name__]
    new = cls.__new__(cls)
    for k, v in stock.__dict__.items():
        if k == "offset":
            new.offset = v
        elif k != "_fused_off":
            new.__dict__[k] = v
    if "offset" not in stock.__dict__ and "_fused_off" in stock.__dict__:
        new.offset = stock.__dict__["_fused_off"]
    new._fusion = fusion
    return new


def _rebind(cache, sources):
    """A cache built by an mlx-lm classmethod/extract from fused caches: fused again, same layer."""
    fusion = next((s._fusion for s in sources if isinstance(s, _Fused) and s._fusion is not None), None)
    if fusion is None or type(cache).__name__ not in _FUSED:
        return cache
    return _adopt(cache, fusion) if not isinstance(cache, _Fused) else _set_fusion(cache, fusion)


def _set_fusion(cache, fusion):
    cache._fusion = fusion
    return cache


# ----------------------------------------------------------------------------- per-model plan

@dataclass
class FusedModel:
    """make_prompt_cache's per-model state (kept on the model): kernel sets and each KV layer's
    Fusion, or the reason it runs mlx-lm's own path."""
    kernels: ModelKernels
    fusions: dict[int, Fusion]
    reasons: dict[int, str]
    signature: tuple = ()      # the attention modules' children: model.shard() replaces them
    direct: bool = False       # direct attention was asked for (each Fusion says whether its layer got it)
    quant: dict = field(default_factory=dict)   # (bits, group_size) -> {layer: mlx_lm_quant_cache.QuantLayer}

    def explain(self) -> str:
        from .mlx_lm import ranges

        groups: dict[str, list[int]] = {}
        for i, f in self.fusions.items():
            groups.setdefault(f"fused: {f.reason}, {f.path}", []).append(i)
        for i, r in self.reasons.items():
            groups.setdefault(f"mlx-lm's own cache: {r}", []).append(i)
        lines = [f"layers {ranges(sorted(ls))}: {what}" for what, ls in groups.items()]
        if self.kernels.non_attention_layers:
            lines.append(f"layers {ranges(self.kernels.non_attention_layers)}: no KV attention (mlx-lm's own cache)")
        if self.quant:
            from . import mlx_lm_quant_cache

            lines += mlx_lm_quant_cache.explain(self)
        return "\n".join(lines)


_STATE_ATTR = "_mlx_aot_fused_model"


def _layer_reason(kernels: ModelKernels, i: int, attn) -> str:
    """Why layer i runs mlx-lm's own path ("" = it can be fused)."""
    c = kernels.config_of[i]
    ks = c.kernel_set
    if c.applies_rope is False:
        return "the layer applies no RoPE (NoPE)"
    if rope_attr(attn) is None:
        return "no rope module: any RoPE is the attention's own code"
    if ks.context.attention == "mla":
        return "MLA: the cache holds latent rows, which the kernel cannot produce"
    if c.dataflow_error:
        return c.dataflow_error
    if ks.rope is None:
        return f"rope_pool_fused not selected: {ks.rejections.get('rope_pool_fused', ks.context.rope_error or '?')}"
    return ""


def _signature(attn_layers: dict) -> tuple:
    """Identity of every attention's child modules: a sharded (or otherwise rebuilt) model gets
    its kernel sets traced again, with the per-rank head counts."""
    return tuple((i, tuple(id(m) for m in attn.children().values())) for i, attn in attn_layers.items())


def _direct_arg(direct, who: str) -> bool | None:
    if direct is None or isinstance(direct, bool):
        return direct
    raise TypeError(f"{who}: direct must be True, False or None (None: MLX_AOT_DIRECT_ATTENTION), got {direct!r}")


def fused_model(model, *, kernels: ModelKernels | None = None, direct: bool | None = None) -> FusedModel:
    """The model's FusedModel, built (tracing the model, installing the SwitchRopes and the direct
    attention classes) on first use. direct: install direct attention where the layer runs the llama
    form, or take it out; None: as the model has it (a new one: MLX_AOT_DIRECT_ATTENTION, on by
    default). Changing it re-decides only that."""
    direct = _direct_arg(direct, "fused_model")
    attn_layers, _, own = find_attention_layers(model)
    state = getattr(model, _STATE_ATTR, None)
    if state is not None and kernels is None and state.signature == _signature(attn_layers):
        if direct is not None and state.direct != direct:
            _set_direct(state, attn_layers, own, direct)
        _pack(state, attn_layers)
        return state
    direct = envs.get_flag("MLX_AOT_DIRECT_ATTENTION") if direct is None else direct
    kernels = kernels if kernels is not None else build_kernel_sets(model)
    if not kernels.traced:
        raise ValueError("make_prompt_cache: the kernel sets must be traced (build_kernel_sets(model, trace=True)): "
                         "the trace decides which layers' data flow allows the fused cache write")
    fusions, reasons = {}, {}
    for i, attn in attn_layers.items():
        why = _layer_reason(kernels, i, attn)
        if why:
            reasons[i] = why
            continue
        attr = rope_attr(attn)
        switch = getattr(attn, attr)
        if not isinstance(switch, SwitchRope):
            switch = SwitchRope(switch)
            setattr(attn, attr, switch)
        ks = kernels.by_layer[i]
        attention = getattr(ks, "attention", None)
        fusions[i] = Fusion(i, ks.rope, switch, norm_kernel=ks.qk_norm_rope, attention=attention,
                            attention_reason="" if attention is not None else
                            ks.rejections.get("decode_attention", "decode_attention is not declared"))
    state = FusedModel(kernels, fusions, reasons, _signature(attn_layers))   # after the switches went in
    for f in fusions.values():
        f.owner = state
    _set_direct(state, attn_layers, own, direct)
    _pack(state, attn_layers)
    object.__setattr__(model, _STATE_ATTR, state)     # a plain attribute: not part of the module tree
    return state


def _pack(state: FusedModel, attn_layers: dict) -> None:
    """Pack the q/k/v projections of the direct layers (direct_attention.pack_qkv; MLX_AOT_PACK_QKV
    read now), again where they were replaced since."""
    enabled = envs.get_flag("MLX_AOT_PACK_QKV")
    for i, f in state.fusions.items():
        f.pack_reason = direct_attention.pack_qkv(attn_layers[i], enabled) if f.direct else ""


def _set_direct(state: FusedModel, attn_layers: dict, own: list, direct: bool) -> None:
    """Install (checked per layer: direct_attention.direct_reason) or take out the direct attention
    classes of the fused layers."""
    for i, f in state.fusions.items():
        attn = attn_layers[i]
        direct_attention.uninstall(attn)            # the check runs the module's own class
        f.direct, f.direct_reason = False, ""
        if not direct:
            continue
        entry = own[i]
        stock_cache = cache_at(entry, kv_cache_path(entry))
        f.direct_reason = direct_attention.direct_reason(attn, lambda: copy.deepcopy(stock_cache))
        if not f.direct_reason:
            direct_attention.install(attn)
            f.direct = True
    state.direct = direct


def _take_out(model, state: FusedModel) -> list:
    """Take the rope switches and direct attention classes out of the fused layers; what was there,
    as (attention, its class, rope attribute, switch), to put back."""
    attn_layers = find_attention_layers(model)[0]
    taken = []
    for i, f in state.fusions.items():
        attn, attr = attn_layers[i], rope_attr(attn_layers[i])
        taken.append((attn, type(attn), attr, getattr(attn, attr)))
        direct_attention.uninstall(attn)
        setattr(attn, attr, f.switch.rope)
    return taken


@contextlib.contextmanager
def stock_model(model):
    """mlx-lm's model exactly as shipped for the block (the rope switches and direct attention
    classes make_prompt_cache installed taken out), then as make_prompt_cache left it."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        yield model
        return
    taken = _take_out(model, state)
    try:
        yield model
    finally:
        for attn, cls, attr, switch in taken:
            setattr(attn, attr, switch)
            attn.__class__ = cls


def restore_model(model) -> None:
    """Undo make_prompt_cache on `model` for good: its attention classes, rope modules and q/k/v
    projections run mlx-lm's own code again (the projections keep their weights, as views of the
    packed rows), and the next make_prompt_cache plans the model anew. Caches made before keep
    working as mlx-lm's own. A model make_prompt_cache never saw is left as it is."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for attn, *_ in _take_out(model, state):
        direct_attention.pack_qkv(attn, enabled=False)
    del model.__dict__[_STATE_ATTR]


def _bind_entry(entry, fm: FusedModel, i: int):
    """The cache entry for layer i: its KV cache fused where possible, else annotated with the reason."""
    path = kv_cache_path(entry)
    if path is None:
        entry.kernel, entry.reason = None, f"no KV attention ({type(entry).__name__}: mlx-lm's own cache)"
        return entry
    c = cache_at(entry, path)
    if type(c).__name__ == "QuantizedKVCache" and i in fm.kernels.by_layer:   # mlx-lm's, loaded or converted
        from . import mlx_lm_quant_cache as quant

        layer = quant.quant_layers(fm, c.bits, c.group_size).get(i)
        new = c._bind(layer) if isinstance(c, quant.QuantizedKVCache) else quant.adopt(c, layer)
        if path:
            entry.kernel, entry.reason = new.kernel, new.reason
        return _replace(entry, path, new)
    fusion = fm.fusions.get(i)
    why = fm.reasons.get(i, "")
    if fusion is not None and type(c).__name__ not in _FUSED:
        why, fusion = f"{type(c).__name__} is not one of the fused cache classes ({', '.join(_FUSED)})", None
    if fusion is None:
        for obj in (c, entry):
            if not isinstance(obj, _Fused):
                obj.kernel, obj.reason = None, why or "layer not fused"
        return entry
    new = _set_fusion(c, fusion) if isinstance(c, _Fused) else _adopt(c, fusion)
    if path:                                  # falcon_h1's CacheList: say it at the top too
        entry.kernel, entry.reason = new.kernel, new.reason
    return _replace(entry, path, new)


def _replace(entry, path, new):
    if not path:
        return new
    subs = list(entry.caches)
    subs[path[0]] = _replace(subs[path[0]], path[1:], new)
    entry.caches = tuple(subs)
    return entry


def make_prompt_cache(model, max_kv_size: int | None = None, *, kernels: ModelKernels | None = None,
                      direct: bool | None = None, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """mlx-lm's make_prompt_cache(model, max_kv_size) with the KV caches of the fused layers replaced
    by the fused classes of this module; pass it as `prompt_cache=` to mlx-lm's generate_step,
    generate or stream_generate, or per request to BatchGenerator.insert(caches=...). direct: whether
    the fused layers whose attention is the llama form run direct_attention's forward (None:
    MLX_AOT_DIRECT_ATTENTION, on by default); it applies to the model, so to its earlier caches too.
    kv_bits (with kv_group_size): quantized caches from the first token, mlx-lm's QuantizedKVCache
    format with the kernels' writes and attention (mlx_lm_quant_cache.py) in every layer whose own
    cache is a KVCache."""
    if max_kv_size is not None and (not isinstance(max_kv_size, int) or isinstance(max_kv_size, bool)
                                    or max_kv_size < 1):
        raise ValueError(f"make_prompt_cache: max_kv_size must be a positive int or None, got {max_kv_size!r}")
    direct = _direct_arg(direct, "make_prompt_cache")
    if kv_bits is not None:
        from . import mlx_lm_quant_cache as quant

        quant.check_format(kv_bits, kv_group_size)
    if direct is None:                # each call: the variable as it is now (fused_model's None keeps the model's)
        direct = envs.get_flag("MLX_AOT_DIRECT_ATTENTION")
    fm = fused_model(model, kernels=kernels, direct=direct)
    own = _stock.make_prompt_cache(model, max_kv_size)
    cache = [_bind_entry(e, fm, i) for i, e in enumerate(own)]
    if kv_bits is None:
        return cache
    return [quant.quantized_entry(e, fm, i, kv_bits, kv_group_size) for i, e in enumerate(cache)]


def bind_prompt_cache(model, cache: list) -> list:
    """Fuse an mlx-lm cache list of `model` (e.g. from mlx-lm's load_prompt_cache): same arrays."""
    fm = fused_model(model)
    if len(cache) != len(fm.kernels.by_layer) + len(fm.kernels.non_attention_layers):
        raise ValueError(f"bind_prompt_cache: {len(cache)} caches for a model of "
                         f"{len(fm.kernels.by_layer) + len(fm.kernels.non_attention_layers)} layers")
    return [_bind_entry(e, fm, i) for i, e in enumerate(cache)]


def load_prompt_cache(file_name: str, model, return_metadata: bool = False):
    """mlx-lm's load_prompt_cache, then bind_prompt_cache(model, ...)."""
    cache, metadata = _stock.load_prompt_cache(file_name, return_metadata=True)
    cache = bind_prompt_cache(model, cache)
    return (cache, metadata) if return_metadata else cache
