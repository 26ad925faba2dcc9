"""mlx-lm models -> kernel sets: find every attention layer, read its shape robustly, and build one
kernel set per distinct layer configuration (gemma3's sliding and global layers differ; hybrid
models have layers without attention).

Two readings of each attention layer:
  - static: attributes (`n_heads`/`num_heads`/..., `head_dim`, else the projections' widths);
  - traced (default): one short forward of the model with mlx-lm's own caches, watching what the
    attention actually does: the q/k/v tensors it produces (heads and head_dim read off the arrays),
    whether it calls its rope module (NoPE layers do not), and whether its data flow lets an engine
    rotate q and k at cache-write time (`_capture.py`). The static reading stays available
    (`trace=False`) and is tested to agree with the traced one.

Also builds mlx-lm 0.32 architectures from config dicts with random weights (no downloads), with or
without transformers installed: mlx_lm/__init__ imports its tokenizer stack, so when that import
fails only the model modules (which need just mlx) are loaded, through a bare package object.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..core import KernelRegistry, KernelSet, default_registry, describe_attention, describe_qk_norm, qk_norm_attrs
from ._capture import CountingRope, DataflowError, NormBypass, RopeCapture, resolve, resolve_with_module_rope

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
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"build_model: config must be a dict with a 'model_type' key, got {config!r:.80}")
    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    try:
        arch = import_mlx_lm_module(model_type)
    except ModuleNotFoundError as e:
        if e.name == f"mlx_lm.models.{model_type}":
            raise ValueError(f"build_model: model_type {config['model_type']!r}: mlx-lm has no "
                             f"mlx_lm/models/{model_type}.py") from None
        raise
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def make_prompt_cache(model, max_kv_size: int | None = None, **kwargs) -> list:
    """Caches for mlx-lm's own generate_step/generate/stream_generate (`prompt_cache=`) with the fused
    kernel in every layer where it is selected: registry/integrations/mlx_lm_cache.py."""
    from .mlx_lm_cache import make_prompt_cache as fused

    return fused(model, max_kv_size, **kwargs)


def restore_model(model) -> None:
    """Undo make_prompt_cache on `model` for good (registry/integrations/mlx_lm_cache.py)."""
    from .mlx_lm_cache import restore_model as restore

    restore(model)


def make_own_cache(model) -> list:
    """mlx-lm's own cache list for `model` (make_prompt_cache: the model's make_cache, else KVCache)."""
    return import_mlx_lm_module("cache").make_prompt_cache(model)


# ----------------------------------------------------------------------------- layers

_ATTN_NAMES = ("self_attn", "attention", "attn")
# Attributes that mark a child module as the layer's attention when it has none of the usual names.
_ATTN_MARKERS = ("rope", "rotary_emb", "q_proj", "qkv_proj", "query_key_value", "wqkv", "c_attn")


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
    """The layer's KV attention module: `self_attn`/`attention`/`attn`, else the one child module
    that looks like attention (has a rope or a query projection)."""
    for name in _ATTN_NAMES:
        attn = getattr(layer, name, None)
        if attn is not None:
            return _unwrap(attn)
    children = getattr(layer, "children", None)
    if children is None:
        return None
    found = [m for m in children().values()
             if hasattr(m, "__call__") and any(hasattr(m, a) for a in _ATTN_MARKERS)]
    return _unwrap(found[0]) if len(found) == 1 else None


def _unwrap(attn):
    """exaone's `attn` is a wrapper whose `attention` child is the attention proper."""
    for _ in range(3):
        if any(hasattr(attn, a) for a in _ATTN_MARKERS):
            return attn
        inner = next((getattr(attn, n) for n in _ATTN_NAMES if getattr(attn, n, None) is not None), None)
        if inner is None:
            return attn
        attn = inner
    return attn


def rope_attr(attn) -> str | None:
    """The attribute holding the attention's rope module (None: it has none, e.g. function-style RoPE)."""
    for name in ("rope", "rotary_emb"):
        if getattr(attn, name, None) is not None:
            return name
    return None


def is_kv_cache(c) -> bool:
    return c is not None and hasattr(c, "update_and_fetch")


def kv_cache_path(entry) -> tuple[int, ...] | None:
    """Where the layer's KV cache sits in its mlx-lm cache entry: () for a plain KV cache, (1,) for
    falcon_h1's CacheList(ArraysCache, KVCache), None when the layer keeps no KV cache."""
    if is_kv_cache(entry):
        return ()
    subs = getattr(entry, "caches", None)
    if subs is not None:
        paths = [(i,) + p for i, c in enumerate(subs) if (p := kv_cache_path(c)) is not None]
        if len(paths) > 1:
            raise ValueError(f"{type(entry).__name__} holds {len(paths)} KV caches; one per layer is supported")
        return paths[0] if paths else None
    return None


def cache_at(entry, path: tuple[int, ...]):
    for i in path:
        entry = entry.caches[i]
    return entry


def cache_window(c) -> tuple[int | None, str]:
    """(sliding window, reason it cannot be emulated or ""), from the layer's own mlx-lm cache."""
    name = type(c).__name__
    if name in ("KVCache", "ConcatenateKVCache", "QuantizedKVCache", "BatchKVCache"):
        return None, ""
    if name in ("RotatingKVCache", "BatchRotatingKVCache"):
        keep = getattr(c, "keep", 0)
        if keep:
            return c.max_size, f"RotatingKVCache(keep={keep}) keeps its first {keep} tokens (attention sinks)"
        return int(c.max_size), ""
    if name == "ChunkedKVCache":
        return None, f"ChunkedKVCache(chunk_size={c.chunk_size}): chunked local attention"
    return None, f"unknown KV cache class {name}"


def _first(obj, *names):
    for n in names:
        value = getattr(obj, n, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _out_features(proj) -> int | None:
    weight = getattr(proj, "weight", None) if proj is not None else None
    return int(weight.shape[0]) if weight is not None else None   # quantised too: rows are not packed


def attention_dims(attn) -> tuple[int, int, int]:
    """(n_heads, n_kv_heads, head_dim) from attributes. head_dim falls back to k_proj's output /
    kv heads (q_proj can be twice as wide, e.g. qwen3_next's gated query), then to a fused qkv
    projection's output / (heads + 2 kv heads), then q_proj's output / heads."""
    n_heads = _first(attn, "n_heads", "num_heads", "num_attention_heads", "n_head", "q_num_heads")
    if n_heads is None:
        raise ValueError(f"{type(attn).__name__}: no n_heads/num_heads/num_attention_heads attribute")
    n_kv = _first(attn, "n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head", "k_num_heads") or n_heads
    head_dim = _first(attn, "head_dim", "head_size", "qk_dim")
    if head_dim is None:
        k_out = _out_features(getattr(attn, "k_proj", None))
        fused = next((f for n in ("qkv_proj", "query_key_value", "wqkv", "c_attn")
                      if (f := _out_features(getattr(attn, n, None)))), None)
        q_out = _out_features(getattr(attn, "q_proj", None))
        if k_out:
            head_dim = k_out // n_kv
        elif fused:
            head_dim = fused // (n_heads + 2 * n_kv)
        elif q_out:
            head_dim = q_out // n_heads
        else:
            raise ValueError(f"{type(attn).__name__}: cannot determine head_dim (no head_dim attribute, "
                             f"no k_proj/qkv_proj/q_proj weight)")
    return n_heads, n_kv, head_dim


# ----------------------------------------------------------------------------- tracing

@dataclass
class AttentionTrace:
    """What one attention layer did in a short forward with mlx-lm's own caches."""
    rope_calls: int | None             # per forward; 0: NoPE layer; None: no rope module to watch
    n_heads: int | None                # from q (None when q was not seen: no rope calls)
    n_kv_heads: int                    # from the keys written to the cache
    head_dim: int
    v_head_dim: int
    dtype: str
    dataflow_error: str = ""           # why q/k cannot be rotated at cache-write time ("" = they can)
    qk_norm_fusable: bool = False      # q/k run per-head norm -> RoPE -> cache: the norm can move to the kernel
    qk_norm_error: str = ""            # why not, for a layer whose q/k norms are per-head RMSNorms


class _TraceCache:
    """Wraps one mlx-lm KV cache during tracing: resolves the captured q/k with the module's own
    rope (so the forward stays exact) and records what reached update_and_fetch."""

    def __init__(self, inner, hook, layer: int, sink: dict, norms: tuple | None = None):
        self._inner, self._hook, self._layer, self._sink = inner, hook, layer, sink
        self._norms = norms                           # (q norm, k norm) bypassed in this run

    def __getattr__(self, name):                     # offset, make_mask, state, ... of the real cache
        return getattr(self._inner, name)

    def update_and_fetch(self, keys, values):
        rec = self._sink.setdefault(self._layer, {"calls": set(), "errors": [], "shapes": None})
        hook = self._hook
        q_shape = None
        if hook is not None:
            rec["calls"].add(len(hook.calls))
        if isinstance(hook, RopeCapture) and hook.calls:
            try:
                q_call, k_call = hook.split(keys, values)
                q_shape = q_call.x.shape
                dtypes = {str(q_call.x.dtype), str(k_call.x.dtype), str(values.dtype)}
                if len(dtypes) > 1:
                    rec["errors"].append(f"q, k and v dtypes differ ({', '.join(sorted(dtypes))})")
            except DataflowError as e:
                rec["errors"].append(str(e))
            else:
                if self._norms is not None:           # the norm the kernel would apply, then the module's rope
                    for call, norm in ((q_call, self._norms[0]), (k_call, self._norms[1])):
                        resolve(call, hook.rope(norm(call.x), *call.args, **call.kwargs))
                    hook.calls = []
            keys = resolve_with_module_rope(hook, keys)
        elif hook is not None:
            hook.reset()
        rec["shapes"] = (keys.shape, values.shape, keys.dtype)
        if q_shape is not None:
            rec["q_shape"] = q_shape
        return self._inner.update_and_fetch(keys, values)


def _wrap_entry(entry, path, wrapper):
    if not path:
        return wrapper
    subs = list(entry.caches)
    subs[path[0]] = _wrap_entry(subs[path[0]], path[1:], wrapper)
    return type(entry)(*subs)


def _trace_run(model, attn_layers: dict[int, Any], captured: set[int],
               bypass: set[int] = frozenset()) -> tuple[dict, bool, list]:
    """Prefill 4 tokens then decode 1 with fresh mlx-lm caches; layers in `captured` get a
    RopeCapture (NaN placeholders resolved at the cache write), the others their own rope. Layers in
    `bypass` (a subset of `captured`) also skip their q/k norms, which the cache write applies before
    the module's rope, as qk_norm_rope_pool_fused would. Returns (per-layer records, whether every
    logit was finite, the logits of both forwards)."""
    own = make_own_cache(model)
    sink: dict[int, dict] = {}
    hooks = []
    norm_hooks = []
    caches = list(own)
    for i, attn in attn_layers.items():
        attr = rope_attr(attn)
        hook = None
        if attr is not None:
            rope = getattr(attn, attr)
            hook = RopeCapture(rope) if i in captured else CountingRope(rope)
            hooks.append((i, attn, attr, hook))
        norms = None
        if i in bypass:
            names = qk_norm_attrs(attn)
            norms = tuple(getattr(attn, n) for n in names)
            norm_hooks += [(i, attn, n, NormBypass(m)) for n, m in zip(names, norms)]
        path = kv_cache_path(own[i])
        caches[i] = _wrap_entry(own[i], path, _TraceCache(cache_at(own[i], path), hook, i, sink, norms))
    finite = True
    outputs = []
    try:
        for _, attn, attr, hook in hooks + norm_hooks:
            setattr(attn, attr, hook)
        for tokens in ([[1, 2, 3, 4]], [[5]]):
            for *_, hook in hooks + norm_hooks:
                hook.reset()
            logits = model(mx.array(tokens, dtype=mx.int32), cache=caches)
            mx.eval(logits)
            outputs.append(logits)
            finite = finite and bool(mx.all(mx.isfinite(logits)).item())
            for i, _, _, hook in hooks:
                if hook.calls:     # rope was called but the cache never written: q/k never resolved
                    rec = sink.setdefault(i, {"calls": set(), "errors": [], "shapes": None})
                    rec["errors"].append(f"the attention called its rope {len(hook.calls)} times "
                                         f"without writing the cache")
            for i, _, name, hook in norm_hooks:
                if hook.calls != 1:
                    rec = sink.setdefault(i, {"calls": set(), "errors": [], "shapes": None})
                    rec.setdefault("norm_errors", []).append(f"the attention calls its {name} {hook.calls} times "
                                                             f"per forward (expected 1)")
    finally:
        for _, attn, attr, hook in hooks + norm_hooks:
            setattr(attn, attr, hook.rope)
    return sink, finite, outputs


def trace_attention(model, attn_layers: dict[int, Any] | None = None) -> dict[int, AttentionTrace]:
    """Trace every KV attention layer of `model` (see the module docstring)."""
    if attn_layers is None:
        attn_layers = find_attention_layers(model)[0]
    candidates = {i for i, a in attn_layers.items() if rope_attr(a) is not None}
    q_shapes: dict[int, tuple] = {}

    def run(captured: set[int]) -> tuple[dict, bool]:
        sink, finite, _ = _trace_run(model, attn_layers, captured)
        q_shapes.update({i: r["q_shape"] for i, r in sink.items() if r.get("q_shape") is not None})
        return sink, finite

    own_sink, finite, own_logits = _trace_run(model, attn_layers, set())
    sink = own_sink
    if not finite:
        raise ValueError(f"{type(model).__name__}: the model's own forward gives non-finite logits; "
                         f"cannot trace its attention layers")
    calls = {i: r["calls"] for i, r in sink.items()}
    errors: dict[int, str] = {}
    for i, c in calls.items():
        if len(c) > 1:
            errors[i] = f"the attention calls its rope a different number of times in prefill and decode ({sorted(c)})"
    candidates -= {i for i, c in calls.items() if c == {0}}       # NoPE layers: nothing to capture
    # Layers that break the capture contract explicitly (call count, key identity, dtypes) are
    # excluded and the rest re-run; then non-finite logits mean a captured placeholder was read
    # before the cache write: find which attention classes do it by capturing one class at a time.
    for _ in range(3):
        sink, finite = run(candidates - set(errors))
        new = {i: r["errors"][0] for i, r in sink.items() if r["errors"] and i in candidates and i not in errors}
        errors.update(new)
        if not new:
            break
    if not finite:
        for layers in _by_class(attn_layers, candidates - set(errors)).values():
            if not run(layers)[1]:
                for i in layers:
                    errors[i] = ("the attention reads q or k between its rope call and cache.update_and_fetch "
                                 "(e.g. a norm or a scale after RoPE), so they cannot be rotated at the cache write")
        if not run(candidates - set(errors))[1]:
            for i in candidates - set(errors):
                errors[i] = "capturing this layer's rope makes the logits non-finite"
    norm_errors = _trace_qk_norms(model, attn_layers, candidates - set(errors), own_sink, own_logits)
    traces = {}
    for i, attn in attn_layers.items():
        rec = sink.get(i)
        if rec is None or rec["shapes"] is None:
            raise ValueError(f"layer {i} ({type(attn).__name__}): its cache was never written during the trace")
        k_shape, v_shape, dtype = rec["shapes"]
        q_shape = q_shapes.get(i)
        traces[i] = AttentionTrace(
            rope_calls=max(calls[i]) if calls.get(i) else None, n_heads=int(q_shape[1]) if q_shape is not None else None,
            n_kv_heads=int(k_shape[1]), head_dim=int(k_shape[-1]), v_head_dim=int(v_shape[-1]),
            dtype=str(dtype).replace("mlx.core.", ""), dataflow_error=errors.get(i, ""),
            qk_norm_fusable=norm_errors.get(i) == "", qk_norm_error=norm_errors.get(i) or "")
    return traces


def _trace_qk_norms(model, attn_layers: dict[int, Any], capturable: set[int], own_sink: dict,
                    own_logits: list) -> dict[int, str]:
    """{layer: '' (its q/k run per-head norm -> RoPE -> cache) or why not} for the capturable layers
    whose q/k norms are per-head RMSNorms. Checked, not assumed: the layers run with their norms
    skipped and applied at the cache write right before the module's rope; the logits must equal the
    model's own (a norm across heads, after RoPE, or anything computed between norm and rope but a
    layout change would change them), and each norm must run once per forward."""
    cands = set()
    for i in capturable:
        shapes = own_sink.get(i, {}).get("shapes")
        if shapes is not None and describe_qk_norm(attn_layers[i], int(shapes[0][-1]))[0] is not None:
            cands.add(i)

    def agrees(layers: set[int]) -> tuple[bool, dict]:
        sink, finite, logits = _trace_run(model, attn_layers, capturable, bypass=layers)
        same = finite and all(bool(mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=1e-3,
                                               atol=1e-3 * (float(mx.abs(b).max().item()) + 1e-6)).item())
                              for a, b in zip(logits, own_logits))
        return same, sink

    out: dict[int, str] = {}
    if not cands:
        return out
    ok, sink = agrees(cands)
    groups = [cands] if ok else list(_by_class(attn_layers, cands).values())
    for layers in groups:
        if not ok:
            ok_group, sink = agrees(layers)
        else:
            ok_group = True
        for i in layers:
            calls = sink.get(i, {}).get("norm_errors")
            if calls:
                out[i] = calls[0]
            elif not ok_group:
                out[i] = ("the attention does not run per-head norm -> RoPE -> cache on q and k (applying its "
                          "norms right before its rope changes the logits)")
            else:
                out[i] = ""
    return out


def _by_class(attn_layers: dict[int, Any], layers: set[int]) -> dict[str, set[int]]:
    by_class: dict[str, set[int]] = {}
    for i in sorted(layers):
        by_class.setdefault(type(attn_layers[i]).__name__, set()).add(i)
    return by_class


# ----------------------------------------------------------------------------- kernel sets per layer config

@dataclass
class LayerConfig:
    layers: list[int]
    attention_class: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_desc: str
    kernel_set: KernelSet
    applies_rope: bool | None = None   # traced: calls its rope; None: not traced or no rope module
    dataflow_error: str = ""           # traced: why an engine cannot rotate q/k at the cache write
    window: int | None = None          # sliding window of the layer's own mlx-lm cache
    cache_error: str = ""              # the layer's own cache semantics the slot engine cannot emulate

    @property
    def label(self) -> str:
        return self.attention_class + (f" (window {self.window})" if self.window else "")

    @property
    def status(self) -> str:
        """One line: which kernel serves these layers' RoPE and cache write, and if none, why."""
        ks = self.kernel_set
        store = "kv_pool_store" if getattr(ks, "kv_store", None) is not None else ""
        if self.applies_rope is False:
            return "no RoPE (NoPE)" + (f": {store}" if store else "")
        if self.dataflow_error and (ks.rope is not None or ks.qk_norm_rope is not None):
            return (f"{'qk_norm_rope_pool_fused' if ks.qk_norm_rope is not None else 'rope_pool_fused'} selected, "
                    f"but engines cannot fuse it here: {self.dataflow_error}"
                    + (f"; {store} for the cache write" if store else ""))
        if ks.qk_norm_rope is not None:
            return "qk_norm_rope_pool_fused (q/k norm + RoPE + cache write)"
        if ks.rope is not None:
            return "rope_pool_fused" + ("" if ks.context.qk_norm_error.startswith("the attention has no")
                                        else f" (q/k norm not fused: {ks.rejections.get('qk_norm_rope_pool_fused')})")
        return (f"rejected: {ks.rejections.get('rope_pool_fused', 'not selected')}"
                + (f"; {store} for the cache write" if store else ""))


@dataclass
class ModelKernels:
    """Kernel sets of one model: one per distinct attention configuration."""
    configs: list[LayerConfig] = field(default_factory=list)
    by_layer: dict[int, KernelSet] = field(default_factory=dict)
    config_of: dict[int, LayerConfig] = field(default_factory=dict)
    non_attention_layers: list[int] = field(default_factory=list)
    non_attention_caches: dict[int, str] = field(default_factory=dict)   # layer -> own cache class
    traced: bool = False

    def explain(self) -> str:
        lines = []
        for c in self.configs:
            lines.append(f"layers {ranges(c.layers)} ({c.label}): {c.status}")
            lines.append("  " + c.kernel_set.explain().replace("\n", "\n  "))
        if self.non_attention_layers:
            kinds = sorted(set(self.non_attention_caches.values()))
            lines.append(f"layers {ranges(self.non_attention_layers)}: no KV attention "
                         f"({', '.join(kinds) or 'no cache'}; run as the model runs them)")
        return "\n".join(lines)


def ranges(idx: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def rope_description(ctx, attn=None) -> str:
    r = ctx.rope
    if r is None:
        attr = rope_attr(attn) if attn is not None else None
        if attr is None:
            return "no rope module"
        name = type(getattr(attn, attr)).__name__
        return f"{name} ({'MLA' if ctx.attention == 'mla' else 'identity' if name == 'NoPE' else 'not expressible'})"
    what = (f"base={r.base:g}" if r.base is not None
            else f"periods[{len(r.periods)}] {min(r.periods):.4g}..{max(r.periods):.4g}")
    return (f"{r.source}(dims={r.rotary_dims}{', traditional' if r.traditional else ''}, {what}"
            f"{f', scale={r.pos_scale:g}' if r.pos_scale != 1 else ''}"
            f"{f', mscale={r.mscale:.4g}' if r.mscale != 1 else ''})")


def find_attention_layers(model) -> tuple[dict[int, Any], dict[int, str], list]:
    """({layer: attention module} for layers with a KV cache, {layer: own cache class} for the
    others, mlx-lm's own cache list). The model's own cache list decides which layers attend over a
    KV cache: hybrid models give their linear-attention/SSM layers an ArraysCache instead."""
    layers = model_layers(model)
    own = make_own_cache(model)
    if len(own) != len(layers):
        raise ValueError(f"{type(model).__name__}: make_prompt_cache gives {len(own)} caches for "
                         f"{len(layers)} layers")
    attn_layers, others = {}, {}
    for i, (layer, entry) in enumerate(zip(layers, own)):
        path = kv_cache_path(entry)
        if path is None:
            others[i] = type(entry).__name__ if entry is not None else "none"
            continue
        attn = attention_of(layer)
        if attn is None:
            raise ValueError(f"layer {i} ({type(layer).__name__}) keeps a {type(cache_at(entry, path)).__name__} "
                             f"but has no attention module (looked for {', '.join(_ATTN_NAMES)} and for one "
                             f"child with any of {', '.join(_ATTN_MARKERS)})")
        attn_layers[i] = attn
    return attn_layers, others, own


def build_kernel_sets(model, *, registry: KernelRegistry | None = None, dtype=None,
                      device: mx.Device | None = None, trace: bool = True) -> ModelKernels:
    """One kernel set per distinct attention configuration of `model`. With trace=True (default)
    one short forward checks what each layer really does (see the module docstring)."""
    registry = registry or default_registry()
    attn_layers, others, own = find_attention_layers(model)
    traces = {}
    if trace:
        try:
            traces = trace_attention(model, attn_layers)
        except Exception as e:  # the model's own forward failed: say so, with the way around it
            raise ValueError(f"build_kernel_sets: tracing {type(model).__name__} failed ({type(e).__name__}: {e}); "
                             f"build_kernel_sets(model, trace=False) reads the attention attributes only") from e
    result = ModelKernels(non_attention_layers=sorted(others), non_attention_caches=others, traced=trace)
    groups: dict[tuple, LayerConfig] = {}
    for i, attn in attn_layers.items():
        t = traces.get(i)
        if t is not None:
            static_heads = _static_heads(attn)
            n_heads = t.n_heads or static_heads or t.n_kv_heads
            n_kv, head_dim, v_head_dim = t.n_kv_heads, t.head_dim, t.v_head_dim
        else:
            n_heads, n_kv, head_dim = attention_dims(attn)
            v_head_dim = head_dim
        ctx = describe_attention(sample_attn=attn, n_kv_heads=n_kv, head_dim=head_dim, dtype=dtype, device=device)
        window, cache_error = cache_window(cache_at(own[i], kv_cache_path(own[i])))
        applies = None if t is None or t.rope_calls is None else t.rope_calls > 0
        attr = rope_attr(attn)
        if attr is not None and type(getattr(attn, attr)).__name__ == "NoPE":
            applies = False            # smollm3's NoPE layers: an identity rope module
        ctx = dataclasses.replace(ctx, applies_rope=applies)
        if t is not None and ctx.qk_norm is not None and not t.qk_norm_fusable:
            # The modules are per-head RMSNorms, but the traced data flow does not put them right
            # before the RoPE: no kernel may apply them.
            ctx = dataclasses.replace(ctx, qk_norm=None, qk_norm_error=(
                t.qk_norm_error or t.dataflow_error or "the layer's q/k cannot be captured at the cache write"))
        flow = "" if t is None else t.dataflow_error
        if not cache_error and head_dim != v_head_dim:
            flow = flow or f"keys and values differ in head_dim ({head_dim} vs {v_head_dim})"
        key = (type(attn).__name__, n_heads, n_kv, head_dim, v_head_dim, ctx.attention, ctx.rope,
               ctx.rope_error, ctx.qk_norm, ctx.qk_norm_error, ctx.dtype, applies, flow, window, cache_error)
        if key not in groups:
            kset = registry.build_for_context(ctx)
            groups[key] = LayerConfig([], type(attn).__name__, n_heads, n_kv, head_dim, v_head_dim,
                                      rope_description(ctx, attn), kset, applies, flow, window, cache_error)
            result.configs.append(groups[key])
        groups[key].layers.append(i)
        result.by_layer[i] = groups[key].kernel_set
        result.config_of[i] = groups[key]
    return result


def _static_heads(attn) -> int | None:
    return _first(attn, "n_heads", "num_heads", "num_attention_heads", "n_head", "q_num_heads")
