"""Normalise any RoPE module into one RopeConfig: what a fused kernel needs to reproduce it.

RopeConfig describes `mx.fast.rope(x * mscale on the rotated features, rotary_dims,
traditional=..., base=... or freqs=periods, scale=pos_scale, offset=position)`.
Facts behind each class: shared/reference/mlx-lm-rope-and-caches.md.

Supported: mlx.nn.RoPE and mlx-lm's Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE and
hunyuan's DynamicNTKAlphaRoPE. Rejected with a reason: DynamicNTKScalingRoPE (its base depends on
the sequence length), DeepSeek's MLA rotary embedding, anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


class UnsupportedRope(ValueError):
    """This RoPE module cannot be expressed as a RopeConfig; str(e) says why."""


@dataclass(frozen=True)
class RopeConfig:
    rotary_dims: int
    traditional: bool = False
    base: float | None = 10000.0          # exactly one of base / periods is set
    periods: tuple[float, ...] | None = None  # length rotary_dims/2; inf = identity pair
    pos_scale: float = 1.0
    mscale: float = 1.0                   # multiplies the rotated input features
    source: str = "RoPE"                  # class the config came from

    def __post_init__(self):
        if not isinstance(self.rotary_dims, int) or self.rotary_dims <= 0 or self.rotary_dims % 2:
            raise UnsupportedRope(f"rotary_dims={self.rotary_dims!r}: expected a positive even integer")
        if (self.base is None) == (self.periods is None):
            raise UnsupportedRope("exactly one of base and periods must be given")
        if self.periods is not None and len(self.periods) != self.rotary_dims // 2:
            raise UnsupportedRope(f"periods has {len(self.periods)} entries, expected "
                                  f"rotary_dims/2 = {self.rotary_dims // 2}")
        if self.base is not None and not (self.base > 0 and math.isfinite(self.base)):
            raise UnsupportedRope(f"base={self.base!r}: expected a positive finite number")
        for name in ("pos_scale", "mscale"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise UnsupportedRope(f"{name}={value!r}: expected a finite number")

    @property
    def has_periods(self) -> bool:
        return self.periods is not None

    def inv_freq(self) -> np.ndarray:
        """float32 [rotary_dims/2]: angle per unit position for each pair (0 for an infinite period)."""
        half = self.rotary_dims // 2
        if self.periods is None:
            inv = self.base ** (-np.arange(0, self.rotary_dims, 2, dtype=np.float64) / self.rotary_dims)
        else:
            periods = np.asarray(self.periods, dtype=np.float64)
            with np.errstate(divide="ignore"):
                inv = np.where(np.isinf(periods), 0.0, 1.0 / periods)
        assert inv.shape == (half,)
        return inv.astype(np.float32)

    def periods_array(self) -> np.ndarray:
        """float32 periods as mx.fast.rope's `freqs` takes them."""
        if self.periods is not None:
            return np.asarray(self.periods, dtype=np.float32)
        return (self.base ** (np.arange(0, self.rotary_dims, 2, dtype=np.float64)
                              / self.rotary_dims)).astype(np.float32)


def _periods(module: Any, attr: str = "_freqs") -> tuple[float, ...]:
    freqs = getattr(module, attr, None)
    if freqs is None:
        raise UnsupportedRope(f"{type(module).__name__} has no {attr} table")
    return tuple(float(x) for x in np.asarray(freqs, dtype=np.float64).reshape(-1))


def _nn_rope(m: Any) -> RopeConfig:
    return RopeConfig(rotary_dims=int(m.dims), traditional=bool(m.traditional),
                      base=float(m.base), pos_scale=float(m.scale), source="RoPE")


def _table(m: Any, dims: int, traditional: bool, mscale: float = 1.0) -> RopeConfig:
    return RopeConfig(rotary_dims=int(dims), traditional=bool(traditional), base=None,
                      periods=_periods(m), mscale=float(mscale), source=type(m).__name__)


_HANDLERS = {
    "Llama3RoPE": lambda m: _table(m, m.dims, m.traditional),
    "YarnRoPE": lambda m: _table(m, m.dims, m.traditional, m.mscale),
    "SuScaledRoPE": lambda m: _table(m, m.dim, False, m._scale),   # traditional hard-coded False
    "ProportionalRoPE": lambda m: _table(m, m.dims, m.traditional),
    "DynamicNTKAlphaRoPE": lambda m: _table(m, m.dims, False),      # hunyuan: static table
}
_REJECTED = {
    "NoPE": "NoPE layer: it applies no rotary embedding, so there is nothing to fuse",
    "DynamicNTKScalingRoPE": "DynamicNTKScalingRoPE recomputes its base from the sequence length "
                             "on every call, so no fixed table reproduces it",
    "DeepseekV2YarnRotaryEmbedding": "DeepSeek MLA rotary embedding: rotates a shared k_pe slice, "
                                     "not per-head K",
}


def normalize_rope(module: Any) -> RopeConfig:
    """RopeConfig for `module`, or UnsupportedRope saying why it cannot be fused."""
    if module is None:
        raise UnsupportedRope("the attention module has no RoPE module (no `rope`/`rotary_emb` attribute): "
                              "a RoPE applied inline by the attention code, if any, cannot be fused")
    if isinstance(module, RopeConfig):
        return module
    while getattr(type(module), "wraps_rope", False):   # mlx_lm_cache.SwitchRope: the rope it stands in for
        module = module.rope
    name = type(module).__name__
    if name in _REJECTED:
        raise UnsupportedRope(_REJECTED[name])
    try:
        import mlx.nn as nn
        if type(module) is nn.RoPE:
            return _nn_rope(module)
    except ImportError:  # pragma: no cover - mlx is a hard dependency
        pass
    handler = _HANDLERS.get(name)
    if handler is None:
        raise UnsupportedRope(f"unknown RoPE class {type(module).__module__}.{name}: supported are "
                              f"mlx.nn.RoPE, {', '.join(sorted(_HANDLERS))}")
    try:
        return handler(module)
    except AttributeError as e:
        raise UnsupportedRope(f"{name} lacks an expected attribute ({e})") from None
