"""Driving an unmodified mlx-lm attention module so that its q/k rotation happens at the cache write.

mlx-lm attention code runs, in this order (shared/reference/mlx-lm-rope-and-caches.md):

    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, ...)

A fused rope + pool-write kernel needs q, k and v together, which only update_and_fetch sees. So
the attention's rope is replaced by a RopeCapture for the forward: each call records its input and
returns a fresh placeholder array (NaN-filled, lazily: it is never computed unless something reads
it before it is resolved). In update_and_fetch the cache identifies which placeholder is k (the one
passed in) and which is q (the other), runs one rope + pool-write call on the un-rotated inputs,
and resolves both placeholders in place (`ph[...] = value`, which rebinds that very array object,
so the attention's `queries` variable now holds the rotated q).

What this needs from the attention, and how each requirement is checked rather than assumed:
  - exactly two rope calls before the cache write (q and k, either order): counted;
  - the keys written are the rope's output, unchanged: identity of the array object;
  - q (and k) are not read between the rope call and the cache write (a norm or a scale after
    RoPE, a concat of a partially rotated slice): such a read sees NaN placeholders, so the
    logits go non-finite; `mlx_lm.trace_attention` runs this check once per model and layers
    that fail it run their own rope instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx


class DataflowError(ValueError):
    """The attention's q/k data flow does not allow rotating them at the cache write; str(e) says why."""


@dataclass(slots=True)         # slots: built twice per fused layer and forward, read on the hot path
class RopeCall:
    x: mx.array            # the un-rotated input, [B, H, L, D]
    ph: mx.array           # the placeholder returned to the attention
    args: tuple
    kwargs: dict


class RopeCapture:
    """Stands in for an attention module's rope during one forward."""

    def __init__(self, rope: Any):
        self.rope = rope                  # the module's own rope (what replays of the calls run)
        self.calls: list[RopeCall] = []

    def reset(self) -> None:
        self.calls = []

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        ph = mx.full(x.shape, math.nan, dtype=x.dtype)
        self.calls.append(RopeCall(x, ph, args, kwargs))
        return ph

    def split(self, keys: mx.array, values: mx.array) -> tuple[RopeCall, RopeCall]:
        """(q call, k call) of this forward, or DataflowError."""
        return split_calls(self.calls, keys, values)


def split_calls(calls: list[RopeCall], keys: mx.array, values: mx.array) -> tuple[RopeCall, RopeCall]:
    """(q call, k call) of a forward's recorded rope calls, or DataflowError: exactly two calls, the
    keys are one call's placeholder (k; the other is q), [B, H, L, D] tensors of one batch, seq_len
    and head_dim with q heads a multiple of k heads and v shaped like k."""
    n = len(calls)
    if n != 2:
        raise DataflowError(f"the attention calls its rope {n} time{'s' if n != 1 else ''} before "
                            f"cache.update_and_fetch (expected 2: q and k)")
    if calls[1].ph is keys:
        q, k = calls
    elif calls[0].ph is keys:
        k, q = calls
    else:
        raise DataflowError("the keys reaching cache.update_and_fetch are not the rope's output (the "
                            "attention transforms k after RoPE, e.g. a norm or a concat of a rotated slice)")
    qs, ks, vs = q.x.shape, k.x.shape, values.shape
    if (len(qs) != 4 or len(ks) != 4 or qs[0] != ks[0] or qs[2] != ks[2] or qs[3] != ks[3]
            or vs != ks or ks[1] == 0 or qs[1] % ks[1]):
        raise DataflowError(f"q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)} are not [B, H, L, D] "
                            f"tensors of one head_dim with q heads a multiple of k heads")
    return q, k


class CountingRope:
    """Pass-through stand-in for a rope that only counts its calls (layers not being captured)."""

    def __init__(self, rope: Any):
        self.rope = rope
        self.calls: list = []

    def reset(self) -> None:
        self.calls = []

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        self.calls.append(None)
        return self.rope(x, *args, **kwargs)


class NormBypass:
    """Stands in for an attention's q or k norm during one forward of a layer whose norm the kernel
    applies (qk_norm_rope_pool_fused): returns its input unchanged, so the rope capture records the
    un-normalised q/k, and counts its calls. Only valid where the trace showed norm -> RoPE -> cache
    with nothing but layout changes between the norm and the rope (mlx_lm.trace_attention)."""

    def __init__(self, norm: Any):
        self.norm = norm
        self.calls = 0

    @property
    def rope(self) -> Any:
        """The module to put back after the forward (the model trace restores every hook's `rope`)."""
        return self.norm

    def reset(self) -> None:
        self.calls = 0

    def __call__(self, x: mx.array) -> mx.array:
        self.calls += 1
        return x


def _rebinder():
    """registry._ext.rebind (the placeholder object becomes `value` itself: no graph node), else
    MLX's `ph[...] = value` (which adds a broadcast, and a squeeze at batch 1, per call)."""
    try:
        from registry._ext import rebind
        return rebind
    except ImportError:
        def rebind(ph: mx.array, value: mx.array) -> None:
            ph[...] = value
        return rebind


rebind = _rebinder()


def resolve(call: RopeCall, value: mx.array) -> None:
    """Give the attention's placeholder its value (the same array object, rebound in place)."""
    if tuple(value.shape) != tuple(call.ph.shape):
        raise DataflowError(f"the value {tuple(value.shape)} for a rope output {tuple(call.ph.shape)} has another shape")
    rebind(call.ph, value)


def resolve_with_module_rope(cap: RopeCapture, keys: mx.array) -> mx.array:
    """Resolve every pending placeholder with the module's own rope on the recorded arguments;
    returns the keys to store (resolved when `keys` is a placeholder)."""
    for call in cap.calls:
        resolve(call, cap.rope(call.x, *call.args, **call.kwargs))
    cap.calls = []
    return keys
