"""The drop-in cache's direct attention forward: the fused kernel without the rope capture, for the
mlx-lm attention classes whose forward is the llama form (docs/engine.md, "The drop-in cache").

The rope capture (mlx_lm_cache.SwitchRope, _capture.py) lets any mlx-lm attention reach the fused
kernel unmodified, but its Python per layer (offset objects, placeholders, checks, rebinding) costs
more host time than the four stock nodes it replaces: in host-bound decode that decides the step.
Most mlx-lm attention classes (llama, mistral, qwen2, qwen3, ...) run one form:

    q, k, v = q_proj(x), k_proj(x), v_proj(x), each as [B, H, L, D]
    q, k = q_norm(q), k_norm(k)                     (only where the module has both norms)
    q, k = rope(q, offset=cache.offset), rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)             <- these lines: one kernel call
    o_proj(sdpa(q, k, v, cache=cache, scale=scale, mask=mask) as [B, L, H * D])

(a per-head norm gives the same bits before or after the [B, L, H, D] -> [B, H, L, D] transpose, so
qwen3's norm-then-transpose runs this form too: the check below is what says so).

For such a module make_prompt_cache swaps its class for a subclass (same name) whose forward, given
a cache with `direct_update` (the drop-in caches), runs this form with the marked lines as
`cache.direct_update(attn, q, k, v, norms)` (norms: the marked lines include the q/k norms,
which the cache may apply in the kernel too: qk_norm_rope_pool_fused); with any other cache (mlx-lm's own, the slot engine's, none)
it runs the class's own forward. Which modules run the form is checked, not assumed:
`direct_reason` runs the module's own forward and the form as written above on random input (a
4-token prefill, then one decode token, with the layer's own mlx-lm cache class) and requires
bitwise-equal outputs and cache contents. MLX_AOT_DIRECT_ATTENTION=0 keeps every layer on the capture.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import mlx.core as mx

_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
FORM = "the llama form"                # the module docstring spells it out


def stock_step(cache, attn, q: mx.array, k: mx.array, v: mx.array, norms: bool):
    """The form's norms, rope and cache write as mlx-lm's attention code writes them: (q, keys, values)."""
    if norms:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.rope(q, offset=cache.offset)
    k = attn.rope(k, offset=cache.offset)
    k, v = cache.update_and_fetch(k, v)
    return q, k, v


def _form(attn, x: mx.array, mask, cache, step: Callable, norms: bool, sdpa: Callable) -> mx.array:
    B, L, _ = x.shape
    q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, keys, values = step(cache, attn, q, k, v, norms)
    out = sdpa(q, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DirectAttention:
    """Mixed in before an mlx-lm attention class (by install()): the form with one kernel call for
    the drop-in caches, the class's own forward for every other cache."""

    __slots__ = ()
    _direct_base: type              # the mlx-lm class
    _direct_norms: bool
    _direct_sdpa: Callable          # the sdpa function the class's module calls

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        update = getattr(type(cache), "direct_update", None)      # the class's, never a wrapper's __getattr__
        if update is None:
            return self._direct_base.__call__(self, x, mask, cache)
        return _form(self, x, mask, cache, update, self._direct_norms, self._direct_sdpa)


_CLASSES: dict[tuple[type, bool], type] = {}


def base_class(attn) -> type:
    """The module's mlx-lm class (its own, when the direct subclass is installed)."""
    return getattr(type(attn), "_direct_base", type(attn))


def _sdpa_of(cls: type) -> Callable:
    own = getattr(sys.modules.get(cls.__module__), "scaled_dot_product_attention", None)
    if own is not None:
        return own
    from .mlx_lm import import_mlx_lm_module
    return import_mlx_lm_module("base").scaled_dot_product_attention


def _norms(attn) -> bool | None:
    """True/False: the module has both q_norm and k_norm / neither; None: only one of them."""
    have = [getattr(attn, n, None) is not None for n in ("q_norm", "k_norm")]
    return have[0] if have[0] == have[1] else None


def _dtype(proj) -> Any:
    """The projection's float dtype (a quantised one's scales'), for the check's input."""
    for name in ("scales", "weight"):
        a = getattr(proj, name, None)
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
            return a.dtype
    return mx.float32


def direct_reason(attn, make_cache: Callable[[], Any]) -> str:
    """"" when `attn` runs the form (module docstring), else why not. make_cache: a fresh mlx-lm
    cache of the layer's own class."""
    cls = base_class(attn)
    missing = [a for a in _ATTRS if getattr(attn, a, None) is None]
    if missing:
        return f"{cls.__name__} has no {', '.join(missing)}, which {FORM} reads"
    norms = _norms(attn)
    if norms is None:
        return f"{cls.__name__} has only one of q_norm and k_norm"
    try:
        params = list(inspect.signature(cls.__call__).parameters.values())
    except (TypeError, ValueError):
        params = []
    if [p.name for p in params[2:]] != ["mask", "cache"] or any(p.kind not in (p.POSITIONAL_OR_KEYWORD,)
                                                               for p in params):
        return f"{cls.__name__}.__call__ does not take (x, mask, cache)"
    hidden = getattr(getattr(attn.o_proj, "weight", None), "shape", (None,))[0]
    if not hidden:
        return f"{cls.__name__}.o_proj has no weight to read the hidden size from"
    sdpa = _sdpa_of(cls)
    keys = mx.random.split(mx.random.key(7))          # a fixed key: the user's random state is untouched
    xs = [mx.random.normal((1, n, int(hidden)), key=kk).astype(_dtype(attn.q_proj)) for n, kk in zip((4, 1), keys)]
    own, form = make_cache(), make_cache()
    try:
        for x, mask in zip(xs, ("causal", None)):
            want = cls.__call__(attn, x, mask, own)
            got = _form(attn, x, mask, form, stock_step, norms, sdpa)
            if want.shape != got.shape or not bool(mx.array_equal(want, got).item()):
                return f"its forward differs from {FORM}"
        for a, b in zip(own.state, form.state):
            same = (a.shape == b.shape and bool(mx.array_equal(a, b).item())) if isinstance(a, mx.array) else a == b
            if not same:
                return f"its cache contents differ from {FORM}'s"
    except Exception as e:  # the form does not even run on this module: it is another form
        return f"{FORM} does not run on it ({type(e).__name__}: {e})"
    return ""


def direct_class(attn) -> type:
    """The module's direct subclass (made once per mlx-lm class and norm form)."""
    cls = base_class(attn)
    norms = bool(_norms(attn))
    sub = _CLASSES.get((cls, norms))
    if sub is None:
        sub = _CLASSES[(cls, norms)] = type(cls.__name__, (DirectAttention, cls), {
            "__slots__": (), "_direct_base": cls, "_direct_norms": norms,
            "_direct_sdpa": staticmethod(_sdpa_of(cls)), "__doc__": cls.__doc__})
    return sub


def install(attn) -> None:
    """Swap the module's class for its direct subclass (call after direct_reason said "")."""
    attn.__class__ = direct_class(attn)


def uninstall(attn) -> None:
    """The module's own class back."""
    attn.__class__ = base_class(attn)
