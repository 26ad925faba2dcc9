"""The per-head q/k RMSNorm of an attention module, normalised to what a fused kernel needs.

    y = x * rsqrt(mean(x^2) + eps) * (weight + weight_offset)     over the head_dim features

weight_offset is 0 for mlx.nn.RMSNorm (`w`) and 1 for Gemma-style norms (`1 + w`: gemma3's RMSNorm,
plamo3's offset=1.0, step3p5's ZeroCenteredRMSNorm). The form is not guessed from the class: the module
is run once on a probe input and compared with both forms (`normalize_qk_norm`), so any RMSNorm-like
class that computes one of them is recognised and anything else (LayerNorm with a bias or mean
subtraction, a norm across heads) is refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx


class UnsupportedNorm(ValueError):
    """The module is not a per-head RMSNorm of either form; str(e) says why."""


@dataclass(frozen=True)
class NormConfig:
    eps: float
    weight_offset: float = 0.0            # 0: y = n(x) * w; 1: y = n(x) * (1 + w)
    source: str = "RMSNorm"


def _eps(module: Any) -> float | None:
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def normalize_qk_norm(module: Any, head_dim: int) -> NormConfig:
    """The NormConfig of a q or k norm module over rows of `head_dim`, or UnsupportedNorm."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if not isinstance(weight, mx.array) or weight.ndim != 1:
        raise UnsupportedNorm(f"{name} has no 1-D weight")
    if weight.shape[0] != head_dim:
        raise UnsupportedNorm(f"{name} normalises {weight.shape[0]} features, not one head of {head_dim} "
                              f"(a norm across heads)")
    if getattr(module, "bias", None) is not None:
        raise UnsupportedNorm(f"{name} has a bias (a LayerNorm, not an RMSNorm)")
    eps = _eps(module)
    if eps is None:
        raise UnsupportedNorm(f"{name} has no eps attribute")
    # Probe: a fixed input with a nonzero mean, so a mean-subtracting LayerNorm differs too.
    x = (mx.arange(2 * head_dim, dtype=mx.float32).reshape(2, head_dim) % 7 - 2.0) * 0.37 + 0.5
    try:
        got = module(x.astype(weight.dtype)).astype(mx.float32)
    except Exception as e:  # a module that cannot run on [2, head_dim] rows is not a per-row norm
        raise UnsupportedNorm(f"{name} cannot be probed on [rows, {head_dim}] ({type(e).__name__}: {e})") from None
    w = weight.astype(mx.float32)
    tol = 1e-2 if weight.dtype != mx.float32 else 1e-5
    for offset in (0.0, 1.0):
        want = mx.fast.rms_norm(x, w + offset, eps)
        if got.shape == want.shape and bool(mx.allclose(got, want, rtol=tol, atol=tol).item()):
            return NormConfig(eps=eps, weight_offset=offset, source=name)
    raise UnsupportedNorm(f"{name} computes neither rms_norm(x, w, eps) nor rms_norm(x, 1 + w, eps)")
