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
                                                    <- sdpa: decode_attention where the cache says
                                                       (`cache.direct_attend`, else None: sdpa)

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

q/k/v in one projection (pack_qkv): a decode step's three projections of one token are three small
matrix-vector products, two of them with a quarter of q's rows or fewer (grouped-query attention), so
the GPU runs three launches at low occupancy. make_prompt_cache packs a direct module's q_proj, k_proj
and v_proj (three nn.Linear, or three nn.QuantizedLinear of one quantisation) into one projection of
the same class whose rows are theirs end to end, and gives the three modules views of those rows: the
weights are held once and the module's own forward reads the same values. The form then runs decode
steps (L = 1) of the drop-in caches as one projection, one reshape and one split into the q, k and v
views (the kernel reads them strided); prefill chunks keep the three projections, so they compute
exactly what stock does. A module whose projection arrays were replaced since (load_weights, update,
quantize) runs the three projections until the next make_prompt_cache packs it again.
MLX_AOT_PACK_QKV=0 keeps the three projections.
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

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


def _form(attn, x: mx.array, mask, cache, step: Callable, norms: bool, sdpa: Callable,
          pack: "QKVPack | None" = None) -> mx.array:
    B, L, _ = x.shape
    if pack is not None and L == 1 and pack.current(attn):
        heads, D = pack.heads
        qkv = pack.proj(x).reshape(B, 1, heads, D).transpose(0, 2, 1, 3)
        q, k, v = mx.split(qkv, pack.cuts, axis=1)
    else:
        q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, keys, values = step(cache, attn, q, k, v, norms)
    attend = getattr(type(cache), "direct_attend", None)       # the drop-in caches' decode attention
    out = attend(cache, attn, q, mask) if attend is not None else None
    if out is None:
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
        # the packed projection serves the drop-in caches only (the slot engine measures the form as it is)
        pack = self.__dict__.get(_PACK_ATTR) if getattr(type(cache), "direct_packed", False) else None
        return _form(self, x, mask, cache, update, self._direct_norms, self._direct_sdpa, pack)


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


# ----------------------------------------------------------------------------- q/k/v in one projection

_PACK_ATTR = "_mlx_aot_qkv_pack"        # a plain attribute of the module: not part of its module tree
_PROJ = ("q_proj", "k_proj", "v_proj")


class QKVPack:
    """One module's q/k/v projections as one (module docstring, "q/k/v in one projection")."""

    __slots__ = ("proj", "held", "heads", "cuts")

    def __init__(self, proj, held: tuple, heads: tuple[int, int], cuts: list[int]):
        self.proj = proj            # a module of the projections' class holding the packed arrays
        self.held = held            # (projection name, array name, the view it was given)
        self.heads = heads          # (q + k + v heads, head dim)
        self.cuts = cuts            # where k's and v's heads start

    def current(self, attn) -> bool:
        """The three projections still hold the packed views (none was replaced since)."""
        for name, key, view in self.held:
            if attn[name].get(key) is not view:
                return False
        return True


def packed(attn) -> bool:
    """Whether the module's decode steps on the drop-in caches run q/k/v as one projection now."""
    pack = attn.__dict__.get(_PACK_ATTR)
    return pack is not None and pack.current(attn)


def _arrays(m) -> dict[str, mx.array]:
    return {k: v for k, v in m.items() if isinstance(v, mx.array)}


def pack_reason(attn) -> str:
    """"" when the module's q/k/v projections can be packed, else why not."""
    mods = [attn.get(n) if isinstance(attn, dict) else None for n in _PROJ]
    cls = type(mods[0])
    if cls not in (nn.Linear, nn.QuantizedLinear) or any(type(m) is not cls for m in mods):
        return (f"q/k/v_proj are {', '.join(type(m).__name__ for m in mods)}: only three nn.Linear or three "
                f"nn.QuantizedLinear pack")
    if any(m.children() for m in mods):
        return "a q/k/v projection has child modules"
    arrays = [_arrays(m) for m in mods]
    if any(a.keys() != arrays[0].keys() for a in arrays) or "weight" not in arrays[0]:
        return "the q/k/v projections hold different arrays (a bias on some only)"
    if cls is nn.QuantizedLinear and len({(m.group_size, m.bits, m.mode) for m in mods}) != 1:
        return "the q/k/v projections are quantised differently"
    for key in arrays[0]:
        rows = [a["weight"].shape[0] for a in arrays]
        if any(a[key].ndim < 1 or a[key].shape[0] != r for a, r in zip(arrays, rows)) or \
                len({(a[key].shape[1:], a[key].dtype) for a in arrays}) != 1:
            return f"the q/k/v projections' {key} arrays do not stack by rows"
    H, Hkv = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
    rows = [a["weight"].shape[0] for a in arrays]
    if not (isinstance(H, int) and isinstance(Hkv, int) and H > 0 and Hkv > 0 and rows[0] % H == 0
            and rows[0] // H * Hkv == rows[1] == rows[2]):
        return f"q/k/v_proj give {rows} outputs, not n_heads={H} and 2 x n_kv_heads={Hkv} heads of one size"
    return ""


def pack_qkv(attn, enabled: bool) -> str:
    """Pack the module's q/k/v projections (module docstring) unless they are packed already;
    enabled=False (MLX_AOT_PACK_QKV=0) takes a pack out. "" when packed, else why not."""
    if not enabled:
        attn.__dict__.pop(_PACK_ATTR, None)
        return "MLX_AOT_PACK_QKV=0"
    if packed(attn):
        return ""
    attn.__dict__.pop(_PACK_ATTR, None)
    why = pack_reason(attn)
    if why:
        return why
    mods = [attn[n] for n in _PROJ]
    keys = list(_arrays(mods[0]))
    whole = {k: mx.concatenate([m[k] for m in mods], axis=0) for k in keys}
    mx.eval(whole)
    rows = [m["weight"].shape[0] for m in mods]
    starts = [0, rows[0], rows[0] + rows[1], sum(rows)]
    held = []
    for name, m, a, b in zip(_PROJ, mods, starts, starts[1:]):
        for k in keys:
            m[k] = whole[k][a:b]            # a view: the rows are held once, in `whole`
            held.append((name, k, m[k]))
    mx.eval([v for *_, v in held])
    proj = copy.copy(mods[0])               # same class and settings (quantisation), packed arrays
    for k in keys:
        proj[k] = whole[k]
    H, Hkv = attn.n_heads, attn.n_kv_heads
    object.__setattr__(attn, _PACK_ATTR, QKVPack(proj, tuple(held), (H + 2 * Hkv, rows[0] // H), [H, H + Hkv]))
    return ""
