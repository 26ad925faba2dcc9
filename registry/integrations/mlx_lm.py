"""mlx-lm models -> kernel sets: find every attention layer, read its shape robustly, and build one
kernel set per distinct layer configuration (gemma3's sliding and global layers differ; hybrid
models have layers without attention).

Also builds mlx-lm 0.32 architectures from config dicts with random weights (no downloads), with or
without transformers installed: mlx_lm/__init__ imports its tokenizer stack, so when that import
fails only the model modules (which need just mlx) are loaded, through a bare package object.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..core import KernelRegistry, KernelSet, default_registry, describe_attention

# An excerpt of mlx_lm.utils.MODEL_REMAPPING (importing mlx_lm.utils needs transformers).
MODEL_REMAPPING = {"mistral": "llama", "iquestcoder": "llama", "xverse": "llama"}


def import_mlx_lm_module(name: str):
    """mlx_lm.models.<name>, importing mlx_lm's tokenizer stack only if it is installed."""
    try:
        import mlx_lm  # noqa: F401  (needs transformers/huggingface_hub)
    except ImportError:
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None:
            raise ImportError("mlx-lm is not installed: pip install mlx-lm==0.32.2") from None
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = pkg
    return importlib.import_module(f"mlx_lm.models.{name}")


def build_model(config: dict, dtype=None):
    """An mlx-lm model from a config dict (random weights, nothing downloaded)."""
    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    arch = import_mlx_lm_module(model_type)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


# ----------------------------------------------------------------------------- layers

_ATTN_NAMES = ("self_attn", "attention", "attn")


def model_layers(model) -> list:
    for obj in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        if obj is None:
            continue
        layers = getattr(obj, "layers", None)
        if layers is not None:
            return list(layers)
        inner = getattr(obj, "model", None)
        if inner is not None and getattr(inner, "layers", None) is not None:
            return list(inner.layers)
    raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (no `layers` attribute)")


def attention_of(layer) -> Any | None:
    for name in _ATTN_NAMES:
        attn = getattr(layer, name, None)
        if attn is not None:
            return attn
    return None


def _first(obj, *names):
    for n in names:
        value = getattr(obj, n, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _out_features(proj) -> int | None:
    weight = getattr(proj, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def attention_dims(attn) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim). head_dim falls back to k_proj's output / n_kv_heads (q_proj
    can be twice as wide, e.g. qwen3_next's gated query; fused qkv projections hold no k_proj)."""
    n_heads = _first(attn, "n_heads", "num_heads", "num_attention_heads")
    if n_heads is None:
        raise ValueError(f"{type(attn).__name__}: no n_heads/num_heads/num_attention_heads attribute")
    n_kv = _first(attn, "n_kv_heads", "num_key_value_heads", "num_kv_heads") or n_heads
    head_dim = _first(attn, "head_dim")
    if head_dim is None:
        k_out = _out_features(getattr(attn, "k_proj", None)) if hasattr(attn, "k_proj") else None
        if k_out:
            head_dim = k_out // n_kv
        elif hasattr(attn, "q_proj"):
            head_dim = _out_features(attn.q_proj) // n_heads
        else:
            raise ValueError(f"{type(attn).__name__}: cannot determine head_dim")
    return n_heads, n_kv, head_dim


# ----------------------------------------------------------------------------- kernel sets per layer config

@dataclass
class LayerConfig:
    layers: list[int]
    attention_class: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_desc: str
    kernel_set: KernelSet


@dataclass
class ModelKernels:
    """Kernel sets of one model: one per distinct attention configuration."""
    configs: list[LayerConfig] = field(default_factory=list)
    by_layer: dict[int, KernelSet] = field(default_factory=dict)
    non_attention_layers: list[int] = field(default_factory=list)

    def explain(self) -> str:
        lines = []
        for c in self.configs:
            lines.append(f"layers {_ranges(c.layers)} ({c.attention_class}):")
            lines.append("  " + c.kernel_set.explain().replace("\n", "\n  "))
        if self.non_attention_layers:
            lines.append(f"layers {_ranges(self.non_attention_layers)}: no attention (kept as the model runs them)")
        return "\n".join(lines)


def _ranges(idx: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def _rope_key(ctx) -> str:
    r = ctx.rope
    if r is None:
        return f"unsupported: {ctx.rope_error}"
    what = (f"base={r.base:g}" if r.base is not None
            else f"periods[{len(r.periods)}] {min(r.periods):.4g}..{max(r.periods):.4g}")
    return (f"{r.source}(dims={r.rotary_dims}{', traditional' if r.traditional else ''}, {what}"
            f"{f', scale={r.pos_scale:g}' if r.pos_scale != 1 else ''}{f', mscale={r.mscale:.4g}' if r.mscale != 1 else ''})")


def build_kernel_sets(model, *, registry: KernelRegistry | None = None, dtype=None,
                      device: mx.Device | None = None) -> ModelKernels:
    registry = registry or default_registry()
    result = ModelKernels()
    groups: dict[tuple, LayerConfig] = {}
    for i, layer in enumerate(model_layers(model)):
        attn = attention_of(layer)
        if attn is None:
            result.non_attention_layers.append(i)
            continue
        if any(hasattr(attn, m) for m in ("kv_lora_rank", "qk_rope_head_dim")):
            n_heads = _first(attn, "num_heads", "n_heads") or 1
            n_kv, head_dim = n_heads, _first(attn, "q_head_dim", "qk_head_dim") or 1
        else:
            n_heads, n_kv, head_dim = attention_dims(attn)
        ctx = describe_attention(sample_attn=attn, n_kv_heads=n_kv, head_dim=head_dim, dtype=dtype, device=device)
        rope_desc = _rope_key(ctx)
        key = (type(attn).__name__, n_heads, n_kv, head_dim, ctx.attention, ctx.rope, ctx.rope_error, ctx.dtype)
        if key not in groups:
            kset = registry.build_for_context(ctx)
            groups[key] = LayerConfig([], type(attn).__name__, n_heads, n_kv, head_dim, rope_desc, kset)
            result.configs.append(groups[key])
        groups[key].layers.append(i)
        result.by_layer[i] = groups[key].kernel_set
    return result
