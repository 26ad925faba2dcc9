"""KernelRegistry and KernelSet: what engines import.

    from registry import KernelRegistry
    kernels = KernelRegistry.from_yaml().build_kernel_set(sample_attn=attn, n_kv_heads=8, head_dim=128)
    if kernels.rope is not None:
        q, k, k_pool, v_pool = kernels.rope(q, k, v, positions, slots, k_pool, v_pool)

For each kernel of the manifest, in order: the env flag (kernels.yaml `enable`), the correctness
requirements (`requires`), the speed requirements (`prefer`, skipped when the flag is explicitly on),
the optional Python `check`, then the wrapper builds the kernel object. Every kernel not selected
gets a reason; `explain()` prints them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import mlx.core as mx

from . import envs
from .errors import ManifestError
from .manifest import KernelSpec, Manifest, hook_module_allowed, load_manifest
from .norm import NormConfig, UnsupportedNorm, normalize_qk_norm
from .rope import RopeConfig, UnsupportedRope, normalize_rope

log = logging.getLogger("registry")

DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}


# ----------------------------------------------------------------------------- selection context

@dataclass(frozen=True)
class SelectionContext:
    """The names a requirement expression may use (registry/expr.py CONTEXT_NAMES), plus the device."""
    attention: str
    rope: RopeConfig | None
    rope_error: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str | None
    backend: str
    device: Any = field(default=None, compare=False)
    module: Any = field(default=None, compare=False, repr=False)
    applies_rope: bool | None = None       # traced: whether the layer calls its rope; None: unknown
    qk_norm: NormConfig | None = None      # per-head q/k RMSNorm feeding the RoPE, or None
    qk_norm_error: str = "the attention has no per-head q/k norm"
    attention_sinks: bool = False          # learned sink logits (gpt-oss's `sinks`)
    alibi: bool = False                    # ALiBi position biases
    # The KV cache's format: float rows (kv_bits None), or mlx-lm's affine quantization (4 or 8 bits)
    kv_bits: int | None = None
    kv_group_size: int | None = None
    kv_scales_dtype: str | None = None

    def as_mapping(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("attention", "rope", "rope_error", "n_heads", "n_kv_heads",
                                              "head_dim", "dtype", "backend", "applies_rope", "qk_norm",
                                              "qk_norm_error", "attention_sinks", "alibi", "kv_bits", "kv_group_size",
                                              "kv_scales_dtype")}

    def quantized(self, bits: int | None, group_size: int | None = None,
                  scales_dtype: Any = None) -> "SelectionContext":
        """This context for a KV cache of `bits` (None: float rows) and `group_size`, the scales in
        `scales_dtype` (default: the activations')."""
        if bits is None:
            return dataclasses.replace(self, kv_bits=None, kv_group_size=None, kv_scales_dtype=None)
        return dataclasses.replace(self, kv_bits=bits, kv_group_size=group_size,
                                   kv_scales_dtype=_dtype_name(scales_dtype) or self.dtype)


def _first_attr(obj: Any, *names: str) -> Any:
    for n in names:
        value = getattr(obj, n, None)
        if value is not None:
            return value
    return None


_MLA_MARKERS = ("kv_lora_rank", "qk_rope_head_dim", "q_head_dim")


def attention_layout(module: Any) -> str:
    if module is None:
        return "unknown"
    if any(hasattr(module, m) for m in _MLA_MARKERS):
        return "mla"
    return "mha"


def _module_dtype(module: Any) -> str | None:
    """Compute dtype from the module's float parameters (quantised weights: their scales)."""
    params = getattr(module, "parameters", None)
    if params is None:
        return None
    try:
        from mlx.utils import tree_flatten
        leaves = tree_flatten(params())
    except Exception:  # a module whose parameters() cannot be walked tells us nothing
        return None
    for _, value in leaves:
        if isinstance(value, mx.array) and value.dtype in DTYPE_NAMES:
            return DTYPE_NAMES[value.dtype]
    return None


def backend_of(device: mx.Device | None = None) -> str:
    device = device if device is not None else mx.default_device()
    if device.type == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    if dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    return str(dtype).replace("mlx.core.", "")


def describe_attention(*, sample_attn: Any, n_kv_heads: int, head_dim: int, dtype: Any = None,
                       device: mx.Device | None = None, kv_bits: int | None = None,
                       kv_group_size: int | None = None, kv_scales_dtype: Any = None) -> SelectionContext:
    """Build the selection context for one attention module (and its KV cache's format: kv_bits None
    for float rows, else mlx-lm's quantized cache of kv_bits and kv_group_size)."""
    for name, value in (("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"build_kernel_set: {name} must be a positive int, got {value!r}")
    for name, value in (("kv_bits", kv_bits), ("kv_group_size", kv_group_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"build_kernel_set: {name} must be a positive int or None, got {value!r}")
    layout = attention_layout(sample_attn)
    n_heads = _first_attr(sample_attn, "n_heads", "num_heads", "num_attention_heads")
    n_heads = int(n_heads) if isinstance(n_heads, int) else n_kv_heads
    rope_module = _first_attr(sample_attn, "rope", "rotary_emb")
    rope, rope_error = None, ""
    if layout == "mla":
        rope_error = "MLA attention (latent KV): the pool holds a compressed latent, not per-head K/V"
    else:
        try:
            rope = normalize_rope(rope_module)
        except UnsupportedRope as e:
            rope_error = str(e)
    if dtype is None:
        dtype = _module_dtype(sample_attn)
    qk_norm, qk_norm_error = describe_qk_norm(sample_attn, head_dim) if layout == "mha" else (
        None, "MLA attention: no per-head q/k norm")
    ctx = SelectionContext(attention=layout, rope=rope, rope_error=rope_error, n_heads=n_heads,
                           n_kv_heads=n_kv_heads, head_dim=head_dim, dtype=_dtype_name(dtype),
                           backend=backend_of(device), device=device, module=sample_attn,
                           qk_norm=qk_norm, qk_norm_error=qk_norm_error,
                           attention_sinks=getattr(sample_attn, "sinks", None) is not None,
                           alibi=any(getattr(sample_attn, a, None) is not None for a in ("alibi", "alibi_slopes")))
    return ctx.quantized(kv_bits, kv_group_size, kv_scales_dtype)


# (q norm, k norm) attribute names of mlx-lm 0.32's attention modules.
QK_NORM_ATTRS = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("query_layernorm", "key_layernorm"))


def qk_norm_attrs(attn: Any) -> tuple[str, str] | None:
    """The (q norm, k norm) attribute names of `attn`, when it has both."""
    for qn, kn in QK_NORM_ATTRS:
        if getattr(attn, qn, None) is not None and getattr(attn, kn, None) is not None:
            return qn, kn
    return None


def qk_norm_modules(attn: Any) -> tuple[Any, Any] | None:
    attrs = qk_norm_attrs(attn)
    return None if attrs is None else (getattr(attn, attrs[0]), getattr(attn, attrs[1]))


def describe_qk_norm(attn: Any, head_dim: int) -> tuple[NormConfig | None, str]:
    """(the q/k norms' config, '') when both are per-head RMSNorms of one form and eps, else (None, why).
    Read off the modules; whether the norm runs before the RoPE is the trace's to say (mlx_lm.py)."""
    mods = qk_norm_modules(attn) if attn is not None else None
    if mods is None:
        return None, "the attention has no per-head q/k norm"
    try:
        cq, ck = (normalize_qk_norm(m, head_dim) for m in mods)
    except UnsupportedNorm as e:
        return None, f"q/k norm not fusable: {e}"
    if (cq.eps, cq.weight_offset) != (ck.eps, ck.weight_offset):
        return None, f"q and k norms differ (eps {cq.eps:g}/{ck.eps:g}, weight offset {cq.weight_offset:g}/{ck.weight_offset:g})"
    return cq, ""


# ----------------------------------------------------------------------------- kernel set

class KernelSet:
    """One attribute per declared kernel_attr: a ready kernel object, or None when not selected."""

    def __init__(self, attrs: Iterable[str], context: SelectionContext):
        self._attrs = tuple(attrs)
        self.context = context
        self.kernels: dict[str, Any] = {}          # kernel name -> kernel object
        self.rejections: dict[str, str] = {}       # kernel name -> reason
        self._by_attr: dict[str, Any] = {a: None for a in self._attrs}
        self._attr_of: dict[str, str] = {}

    def _select(self, spec: KernelSpec, kernel: Any) -> None:
        self.kernels[spec.name] = kernel
        self._by_attr[spec.kernel_attr] = kernel
        self._attr_of[spec.name] = spec.kernel_attr

    def __getattr__(self, name: str) -> Any:
        by_attr = self.__dict__.get("_by_attr", {})
        if name in by_attr:
            return by_attr[name]
        raise AttributeError(f"KernelSet has no kernel attribute {name!r}; declared: "
                             f"{', '.join(sorted(by_attr)) or '(none)'}")

    @property
    def selected_kernel_names(self) -> tuple[str, ...]:
        return tuple(self.kernels)

    def explain(self) -> str:
        ctx = self.context
        rope = "none" if ctx.rope is None else (
            f"{ctx.rope.source}(rotary_dims={ctx.rope.rotary_dims}, traditional={ctx.rope.traditional}, "
            f"{'base=' + format(ctx.rope.base, 'g') if ctx.rope.base is not None else 'periods table'}, "
            f"pos_scale={ctx.rope.pos_scale:g}, mscale={ctx.rope.mscale:g})")
        cache = "" if ctx.kv_bits is None else (f" cache={ctx.kv_bits}-bit/group {ctx.kv_group_size} "
                                                f"(scales {ctx.kv_scales_dtype or 'unknown'})")
        lines = [f"kernel set for {ctx.attention} attention: heads={ctx.n_heads} kv_heads={ctx.n_kv_heads} "
                 f"head_dim={ctx.head_dim} dtype={ctx.dtype or 'unknown'} backend={ctx.backend} rope={rope}{cache}"]
        for name, kernel in self.kernels.items():
            impl = getattr(kernel, "implementation", "")
            why = getattr(kernel, "reason", "")
            lines.append(f"  {self._attr_of[name]:<10} = {name}: selected"
                         + (f" [{impl}]" if impl else "") + (f" ({why})" if why else ""))
        for name, reason in self.rejections.items():
            lines.append(f"  {'':<10}   {name}: not selected: {reason}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"KernelSet(selected={list(self.selected_kernel_names)}, rejected={list(self.rejections)})"


# ----------------------------------------------------------------------------- registry

def _resolve(ref: str, what: str, spec: KernelSpec) -> Callable:
    """The hook `module:attr`. load_manifest checked it (registry.* or MLX_AOT_HOOK_MODULES, defined at
    top level); the module allow-list is checked again here, before anything is imported."""
    module_name, attr = ref.split(":")
    if not hook_module_allowed(module_name):
        raise ManifestError([f"kernel {spec.name!r}: {what}: {ref} is outside the registry package and "
                             f"MLX_AOT_HOOK_MODULES"])
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ManifestError([f"kernel {spec.name!r}: {what}: cannot import {ref} ({e})"]) from e
    if not callable(fn):
        raise ManifestError([f"kernel {spec.name!r}: {what}: {ref} is a {type(fn).__name__}, not a function"])
    return fn


class KernelRegistry:
    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.specs: tuple[KernelSpec, ...] = manifest.kernels

    @classmethod
    def from_yaml(cls, path: str | Path | None = None) -> "KernelRegistry":
        """Registry over a manifest (default: the packaged kernels.yaml)."""
        return cls(load_manifest(path))

    @property
    def registered_kernel_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def _decide(self, spec: KernelSpec, ctx: SelectionContext) -> str | None:
        """None when `spec` may be used in `ctx`, else the reason it may not."""
        on, explicit = envs.flag_state(spec.enable.env, spec.enable.default)
        if not on:
            return (f"disabled by {spec.enable.env}=0" if explicit else
                    f"off by default; set {spec.enable.env}=1 to enable")
        values = ctx.as_mapping()
        for req in spec.requires:
            if not req.holds(values):
                return req.explain(values)
        if not explicit:
            for req in spec.prefer:
                if not req.holds(values):
                    return f"not faster here: {req.explain(values)} (set {spec.enable.env}=1 to force it on)"
        if spec.check:
            result = _resolve(spec.check, "check", spec)(spec, ctx)
            ok, reason = result if isinstance(result, tuple) else (result is None, result)
            if not ok:
                if not reason:
                    raise ManifestError([f"kernel {spec.name!r}: check {spec.check} said no without a "
                                         f"reason; it must return (False, 'why') or a reason string"])
                return str(reason)
        return None

    def build_kernel_set(self, *, sample_attn: Any, n_kv_heads: int, head_dim: int, dtype: Any = None,
                         device: mx.Device | None = None, **kv_format) -> KernelSet:
        """kv_format: kv_bits, kv_group_size, kv_scales_dtype (describe_attention)."""
        ctx = describe_attention(sample_attn=sample_attn, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                 dtype=dtype, device=device, **kv_format)
        return self.build_for_context(ctx)

    def build_for_context(self, ctx: SelectionContext) -> KernelSet:
        kset = KernelSet((s.kernel_attr for s in self.specs), ctx)
        for spec in self.specs:
            reason = self._decide(spec, ctx)
            if reason is not None:
                kset.rejections[spec.name] = reason
                log.debug("kernel %s not selected: %s", spec.name, reason)
                continue
            kernel = _resolve(spec.wrapper, "wrapper", spec)(spec, ctx)
            kset._select(spec, kernel)
        log.info("MLX AOT kernels selected: %s%s",
                 ", ".join(f"{n} [{getattr(k, 'implementation', '?')}]" for n, k in kset.kernels.items())
                 or "none",
                 f"; not selected: {', '.join(kset.rejections)}" if kset.rejections else "")
        return kset


_DEFAULT: KernelRegistry | None = None


def default_registry() -> KernelRegistry:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = KernelRegistry.from_yaml()
    return _DEFAULT


def build_kernel_set(*, sample_attn: Any, n_kv_heads: int, head_dim: int, dtype: Any = None,
                     device: mx.Device | None = None, **kv_format) -> KernelSet:
    """build_kernel_set on the packaged manifest's registry (kv_format: describe_attention's kv_*)."""
    return default_registry().build_kernel_set(sample_attn=sample_attn, n_kv_heads=n_kv_heads,
                                               head_dim=head_dim, dtype=dtype, device=device, **kv_format)
