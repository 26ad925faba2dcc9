"""A small slot-pool decode engine over unmodified mlx-lm models (docs/engine.md).

Per attention layer: K/V pools [S, Hkv, D]. Each request owns a list of pool slots, one per token;
prefill writes its prompt's K/V into fresh slots, every decode step batches the running requests
(different lengths, their own positions) and writes one slot each; attention reads each request's
slots through a padded slot table with a causal / sliding-window / padding mask (a lone request
whose slots are consecutive reads them as a slice of the pool, and while its context fits the window
gets mlx-lm's own masks: None for one query, "causal"; MLX's fused attention kernels take those and
not an array mask on CUDA; past the window, a sliding layer's decode token reads only the window's
last slots, with no mask, as mlx-lm's RotatingKVCache gives it). Finished requests give their slots back; new requests join at the next
step (continuous batching).

The model's own code runs everything (embeddings, norms, projections, gates, soft-caps, MLP, head);
only the attention's rope, cache write and cache read are the engine's, and the per-head q/k norms
where the trace shows norm -> RoPE -> cache. A fused or reference layer whose attention is the llama
form (direct_attention.py, checked per layer) runs, during the engine's forwards, that form with the
call below in place of its norms, rope calls and cache write (`PoolCache.direct_update`); every
other one reaches the call through the q/k capture of `_capture.py`. Per layer (LayerPlan):
  - fused:     one kernel call: the kernel set's `qk_norm_rope`
               (q/k norm, rotation and both pool stores; the norms bypassed in the forward) where
               selected, else its `rope` (rotation plus both pool stores);
  - reference: registry.rope_pool_fused_reference, the same single call in pure MLX, where the
               kernel is not selected but the RoPE is expressible (or mode="reference");
  - module:    the module's own rope (if any) at per-request positions, then the kernel set's
               `kv_store` (kv_pool_store) into the pools, or a plain scatter (mode="module", or not
               selected), where the RoPE cannot be fused (DynamicNTKScalingRoPE), the attention's data
               flow does not allow it (q/k normed after RoPE), or the layer applies no RoPE.
"""

from __future__ import annotations

import copy
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from .. import envs
from ..errors import MlxAotError
from ..kernels.rope_pool_fused import rope_pool_fused_reference
from ..core import backend_of, qk_norm_attrs
from ..native import device_arange, device_indices
from . import direct_attention
from ._capture import DataflowError, NormBypass, RopeCapture, resolve
from .mlx_lm import (ModelKernels, build_kernel_sets, cache_at, find_attention_layers, kv_cache_path,
                     make_own_cache, ranges, rope_attr)

MODES = ("fused", "reference", "module")


class UnsupportedModelError(MlxAotError, ValueError):
    """The slot engine cannot run this model; the message names the layers and the reason."""


class EngineError(MlxAotError, RuntimeError):
    """A request or step cannot proceed (pool exhausted, bad token ids, attention contract broken)."""


# Attention code that computes scores itself instead of mlx-lm's scaled_dot_product_attention
# broadcasts the mask its own way; batched masks need its layout. gemma2 reshapes q to
# [B, Hkv, repeats, L, D] when repeats > 1, so its scores are 5-D.
_MANUAL_MASK_RANK: dict[tuple[str, str], Callable[[Any], int]] = {
    ("mlx_lm.models.gemma2", "Attention"): lambda attn: 5 if getattr(attn, "repeats", 1) > 1 else 4,
}


@dataclass
class LayerPlan:
    layer: int
    path: str                          # 'fused' | 'reference' | 'module'
    reason: str                        # why this path (and, for fused, what runs)
    call: Callable | None              # (q, k, v, positions, slots, k_pool, v_pool) -> 4-tuple
    window: int | None
    rotates: bool = True               # module path: whether the attention rotates through a rope module
    kernel: str = "rope_pool_fused"    # fused path: the kernel of the call
    store: Callable | None = None      # module path: kv_pool_store (k, v, slots, k_pool, v_pool) -> pools; None: scatter
    norms: tuple = ()                  # (attribute, module) of q/k norms the kernel applies (bypassed in forwards)
    direct: bool = False               # fused/reference: the call runs in direct_attention's form (else: capture)
    direct_reason: str = ""            # why not, when direct attention was asked for
    attention: Any = None              # fused, direct: decode_attention over the pool through the batch's slot table

    @property
    def how(self) -> str:
        """How the attention reaches the call: 'direct forward' or 'rope capture (why not direct)'."""
        if self.call is None:
            return ""
        if self.direct:
            return "direct forward"
        return f"rope capture{f' ({self.direct_reason})' if self.direct_reason else ''}"

    @property
    def what(self) -> str:
        if self.path == "fused":
            return self.kernel
        if self.path == "reference":
            return "rope_pool_fused_reference (pure MLX)"
        write = "kv_pool_store" if self.store is not None else "pool scatter"
        return f"module rope + {write}" if self.rotates else write


@dataclass
class Step:
    """What every layer needs for one forward: new tokens' positions and slots (token-major,
    request by request) and each request's context slots: one run of the pool (`span`) when a lone
    request's slots are consecutive, else a padded slot table."""
    batch: int
    length: int
    offsets: list[int]
    context: int                      # ctx: the longest request's tokens, the new ones included
    positions: mx.array               # int32 [batch * length]
    slots: mx.array                   # int32 [batch * length]
    span: tuple[int, int] | None      # (first slot, ctx): batch 1, slots first .. first + ctx - 1 in order
    table: mx.array | None            # int32 [batch, ctx]: slots to attend (padded); None with a span
    key_pos: mx.array | None = None   # int32 [batch, ctx]: position of each context slot (-1: padding);
    query_pos: mx.array | None = None  # int32 [batch, length]  (both None at batch 1: see make_mask)
    lens: mx.array | None = None      # int32 [batch]: each request's context (the table's valid columns)

    def windowed(self, window: int | None) -> bool:
        """A lone request's decode token past a sliding window: a layer of that window reads only its
        last `window` slots, exactly the keys the window lets the query see, so it needs no mask."""
        return self.span is not None and self.length == 1 and bool(window) and self.context > window


class ModuleRope:
    """The module's own rope at the engine's per-request positions (module path)."""

    def __init__(self, engine: "SlotEngine", rope: Any):
        self.engine, self.rope = engine, rope

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        # The engine's positions, not the attention's idea of them: drop its offset (keyword or first positional).
        if "offset" in kwargs:
            del kwargs["offset"]
        else:
            args = args[1:]
        offsets = self.engine.step_ctx.offsets
        if len(offsets) == 1 or len(set(offsets)) == 1:
            return self.rope(x, *args, offset=offsets[0], **kwargs)
        try:                               # mlx-lm's rope classes take a [B] offset ...
            return self.rope(x, *args, offset=mx.array(offsets, dtype=mx.int32), **kwargs)
        except (ValueError, TypeError):   # ... except DynamicNTKScalingRoPE (base from the length)
            return mx.concatenate([self.rope(x[b:b + 1], *args, offset=o, **kwargs)
                                   for b, o in enumerate(offsets)], axis=0)


class PoolCache:
    """The cache object an attention layer sees during engine forwards."""

    def __init__(self, engine: "SlotEngine", plan: LayerPlan, hook: Any, pool_size: int):
        self.engine = engine
        self.plan = plan
        self.hook = hook                  # RopeCapture (fused/reference) or ModuleRope
        self.pool_size = pool_size
        self.window = plan.window
        self.k_pool: mx.array | None = None   # allocated at the first write, in the layer's dtype
        self.v_pool: mx.array | None = None

    @property
    def offset(self):
        """Tokens already cached: an int for one request, a [B] array for a batch (as mlx-lm's
        BatchKVCache), for attention code that uses the offset beyond its rope."""
        offsets = self.engine.step_ctx.offsets
        return offsets[0] if len(offsets) == 1 else mx.array(offsets, dtype=mx.int32)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **_):
        ctx = self.engine.step_ctx
        window = window_size or self.window       # RotatingKVCache.make_mask falls back to max_size too
        if not return_array and N == 1 and window == self.window and ctx.windowed(window):
            return None                           # _read gives this window's layers its last `window` slots
        if ctx.batch == 1 and not return_array and (not window or ctx.context <= window):
            # One request whose context fits the window: the mask is causal, so mlx-lm's own forms
            # (None for one query), which MLX's fused attention kernels take; an array mask sends
            # CUDA's sdpa to its unfused fallback (MLX 0.32.4: supports_sdpa_vector).
            return None if N == 1 else "causal"
        if ctx.batch == 1:                        # [L, ctx], the shape of mlx-lm's own masks; no padding
            q = mx.arange(ctx.offsets[0], ctx.offsets[0] + ctx.length, dtype=mx.int32)[:, None]
            k = mx.arange(ctx.context, dtype=mx.int32)[None]
            mask = k <= q
            return mask & (k > q - window) if window else mask
        q = ctx.query_pos[:, :, None]             # [B, L, 1]
        k = ctx.key_pos[:, None, :]               # [B, 1, ctx]
        mask = (k >= 0) & (k <= q)
        if window:
            mask = mask & (k > q - window)
        return mask[:, None, None] if self.engine.mask_rank == 5 else mask[:, None]

    @staticmethod
    def _tokens(x: mx.array) -> mx.array:         # [B, H, L, D] -> [B*L, H, D]
        B, H, L, D = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B * L, H, D)

    def _store(self, pool: mx.array, x: mx.array) -> mx.array:
        """MLX's own write of x [B, H, L, D] into `pool` at the step's slots: a slice update when they
        are one run (as mlx-lm writes its cache), else a scatter."""
        ctx = self.engine.step_ctx
        if ctx.span is not None:
            first, n = ctx.span
            # [1, L, H, D] rows, the leading 1 dropped; one decode token's [1, H, 1, D] is already in
            # that order: one reshape, where the transpose and the squeeze are two nodes (host time)
            rows = x.reshape(1, x.shape[1], x.shape[3]) if ctx.length == 1 else x.swapaxes(1, 2)
            pool[first + ctx.offsets[0]:first + n] = rows
        else:
            pool[ctx.slots] = self._tokens(x)
        return pool

    def _pools(self, keys: mx.array, values: mx.array) -> None:
        if self.k_pool is None:
            self.k_pool = mx.zeros((self.pool_size, keys.shape[1], keys.shape[3]), dtype=keys.dtype)
            self.v_pool = mx.zeros((self.pool_size, values.shape[1], values.shape[3]), dtype=values.dtype)

    def _call(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """The plan's one call: rotated (q, k); the pools rebound to its in-place outputs. The kernels
        take the attention's [B, H, L, D] views as they are (strided) and return q and k in that
        shape: token t = b * L + l, the order of the step's positions and slots."""
        ctx = self.engine.step_ctx
        self._pools(k, v)
        q_rot, k_rot, self.k_pool, self.v_pool = self.plan.call(q, k, v, ctx.positions, ctx.slots,
                                                                self.k_pool, self.v_pool)
        self.engine.calls[self.plan.path] += 1
        return q_rot, k_rot

    def direct_update(self, attn, q: mx.array, k: mx.array, v: mx.array, norms: bool):
        """direct_attention's step, for a layer whose plan runs the direct form: the q/k norms where
        the plan's kernel does not apply them, then its one call on q/k/v as projected (no capture);
        (rotated q, keys, values). Any other layer (its class made direct by make_prompt_cache) gets
        its norms, rope calls and update_and_fetch as written."""
        if not self.plan.direct:
            return direct_attention.stock_step(self, attn, q, k, v, norms)
        if norms and not self.plan.norms:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q_rot, _ = self._call(q, k, v)
        if self._attends(q.shape[2]):             # direct_attend reads the pool: no gather of the context
            return q_rot, None, None
        return (q_rot, *self._read())

    def _attends(self, L: int) -> bool:
        """Whether direct_attend runs this step: decode_attention selected for the layer, a batch (a slot
        table; a lone request reads its run of slots as a view) and at most 8 new tokens."""
        return self.plan.attention is not None and self.engine.step_ctx.table is not None and L <= 8 \
            and self.engine.step_ctx.lens is not None

    def direct_attend(self, attn, q: mx.array, mask):
        """direct_attention's attention: decode_attention over the pool through the step's slot table,
        each request's context length and the layer's window as data (the mask the engine made says
        the same); None where MLX's attention runs (a lone request, a prefill chunk, no kernel)."""
        if not self._attends(q.shape[2]):
            return None
        ctx = self.engine.step_ctx
        self.engine.calls["decode_attention"] += 1
        return self.plan.attention(q, self.k_pool, self.v_pool, ctx.lens, None, ctx.table, scale=attn.scale,
                                   window=int(self.window or 0), check=False)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        ctx = self.engine.step_ctx
        if self.plan.call is not None:
            try:
                q_call, k_call = self.hook.split(keys, values)
            except DataflowError as e:             # the trace said it would not: data-dependent code path
                raise EngineError(f"layer {self.plan.layer}: {e}; the model trace did not show this "
                                  f"(construct the engine with mode='module')") from None
            self.hook.reset()
            q_rot, k_rot = self._call(q_call.x, k_call.x, values)
            resolve(q_call, q_rot)
            resolve(k_call, k_rot)                 # free unless the attention reads its rotated keys again
            return self._read()
        self._pools(keys, values)
        if self.plan.store is not None:            # keys rotated (or not) by the module: kv_pool_store
            self.k_pool, self.v_pool = self.plan.store(keys, values, ctx.slots, self.k_pool, self.v_pool)
        else:                                      # keys were rotated (or not) by the module itself
            self.k_pool, self.v_pool = self._store(self.k_pool, keys), self._store(self.v_pool, values)
        self.engine.calls[self.plan.path] += 1
        return self._read()

    @staticmethod
    def _run(pool: mx.array, first: int, n: int) -> mx.array:
        """Slots first .. first + n - 1 of a [S, H, D] pool as the [1, H, n, D] view attention reads, no
        copy: two graph nodes (a flatten and the view) where a slice, an expand and a transpose are
        three, each costing host time on CUDA (docs/benchmarks/e2e-root-cause.md). The
        pool stays slot-major: a batch's gather of whole [H, D] rows took 1.1-1.75x less time than a
        head-major pool's on the H200 and 2.4-4.4x less on the CPU (benchmarks.pool_layout, section 12)."""
        S, H, D = pool.shape
        return mx.as_strided(pool, (1, H, n, D), (S * H * D, D, H * D, 1), first * H * D)

    def _read(self) -> tuple[mx.array, mx.array]:
        """Keys and values to attend, [B, Hkv, ctx, D]."""
        ctx = self.engine.step_ctx
        if ctx.span is not None:                   # a view of the pool, as mlx-lm reads its cache: no gather
            first, n = ctx.span
            if ctx.windowed(self.window):          # past the window: its last slots, as a RotatingKVCache holds
                first, n = first + n - self.window, self.window
            return self._run(self.k_pool, first, n), self._run(self.v_pool, first, n)
        kk = self.k_pool[ctx.table].transpose(0, 2, 1, 3)   # [B, Hkv, ctx, D]
        vv = self.v_pool[ctx.table].transpose(0, 2, 1, 3)
        return kk, vv


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    slots: list[int] = field(default_factory=list)
    run: bool = True                   # slots are consecutive, ascending (attention reads them as a slice)
    generated: list[int] = field(default_factory=list)
    state: list | None = None          # the model's own per-request caches (recurrent layers)
    logits: list[np.ndarray] = field(default_factory=list)
    scheduled: int = 0                 # tokens whose forward has been queued (read or not)
    last: "_InFlight | None" = None    # the forward that computes this request's newest token ...
    last_row: int = 0                  # ... and its row there

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


class SlotEngine:
    """Greedy generation for several requests through per-layer slot pools.

    mode: 'fused' (default: the kernel set's rope where selected, else the reference path, else the
    module's rope), 'reference' (rope_pool_fused_reference wherever the RoPE is expressible), or
    'module' (the model's own rope and a plain pool scatter everywhere: the baseline).
    """

    def __init__(self, model, *, pool_size: int = 4096, mode: str = "fused", kernels: ModelKernels | None = None,
                 record_logits: bool = False, direct: bool | None = None):
        if mode not in MODES:
            raise ValueError(f"SlotEngine: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"SlotEngine: pool_size must be a positive int, got {pool_size!r}")
        self.model = model
        self.mode = mode
        self.pool_size = pool_size
        self.record_logits = record_logits
        attn_layers, others, own = find_attention_layers(model)
        self.kernels = kernels if kernels is not None else build_kernel_sets(model)
        if not self.kernels.traced and mode != "module":
            raise ValueError("SlotEngine: fused/reference modes need traced kernel sets "
                             "(build_kernel_sets(model, trace=True))")
        self._check_supported(attn_layers)
        self.attn_layers = attn_layers
        self.own_template = own                  # structure of the model's cache list
        self.kv_paths = {i: kv_cache_path(own[i]) for i in attn_layers}
        self.plans: dict[int, LayerPlan] = {i: self._plan(i) for i in attn_layers}
        if not (direct is None or isinstance(direct, bool)):
            raise ValueError(f"SlotEngine: direct must be True, False or None (None: MLX_AOT_DIRECT_ATTENTION), "
                             f"got {direct!r}")
        self._direct = self._direct_forms(envs.get_flag("MLX_AOT_DIRECT_ATTENTION") if direct is None else direct)
        self.hooks: dict[int, tuple[Any, str, Any]] = {}
        self.pools: dict[int, PoolCache] = {}
        for i, attn in attn_layers.items():
            plan = self.plans[i]
            attr = rope_attr(attn)
            rope = getattr(attn, attr) if attr else None
            hook = RopeCapture(rope) if plan.call is not None else (ModuleRope(self, rope) if rope is not None else None)
            if not plan.direct:                  # the direct form calls neither its rope nor its norms
                if hook is not None:
                    self.hooks[i] = (attn, attr, hook)
                for name, norm in plan.norms:    # q/k norms the plan's kernel applies: identity in forwards
                    self.hooks[(i, name)] = (attn, name, NormBypass(norm))
            self.pools[i] = PoolCache(self, plan, hook, pool_size)
        # Layers whose own caches hold per-request state (recurrent layers, or the state half of a
        # falcon_h1-style CacheList): each request gets its own, batched by merging along B.
        self.stateful = [i for i, e in enumerate(own) if _has_state(e)]
        self.mask_rank, self.batch_reason = self._batching(attn_layers, own)
        self.free = list(range(pool_size - 1, -1, -1))
        self.requests: dict[int, Request] = {}
        self.waiting: list[int] = []
        self.running: list[int] = []
        self._next_rid = 0
        self.step_ctx: Step | None = None
        self.calls: Counter = Counter()
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0,
                       "decode_steps": 0}
        self.vocab_size = _vocab_size(model)
        self._inflight: list[_InFlight] = []      # decode steps queued, tokens not read yet
        self._arange = np.arange(pool_size + 1, dtype=np.int32)   # positions, sliced per step
        self._backend = backend_of()            # where the step's index arrays go (device_indices)
        # Without per-request state the cache list is the same every forward (the pools read step_ctx).
        paths = [self.kv_paths.get(i) for i in range(len(own))]
        self._static_caches = (None if self.stateful or any(p not in ((), None) for p in paths)
                               else [self.pools[i] if p == () else None for i, p in enumerate(paths)])

    # --------------------------------------------------------------------- setup

    def _check_supported(self, attn_layers: dict[int, Any]) -> None:
        problems = []
        for c in self.kernels.configs:
            where = f"layers {ranges(c.layers)} ({c.attention_class})"
            if c.cache_error:
                problems.append(f"{where}: {c.cache_error}: not supported by the slot engine")
        if problems:
            raise UnsupportedModelError(f"{type(self.model).__name__}: " + "; ".join(problems))

    def _plan(self, i: int) -> LayerPlan:
        """The layer's path and kernel: qk_norm_rope_pool_fused where the trace shows per-head norm ->
        RoPE -> cache, else rope_pool_fused, else its reference; where the model rotates (or does not)
        by itself, kv_pool_store for the cache write (a plain scatter in mode='module' or without it)."""
        c = self.kernels.config_of[i]
        ks, ctx = c.kernel_set, c.kernel_set.context
        window = c.window
        attn = self.attn_layers[i]
        if self.mode == "module":
            return LayerPlan(i, "module", "mode='module': the model's own rope and a plain pool scatter", None, window)
        store_kernel = getattr(ks, "kv_store", None) if self.mode == "fused" and c.head_dim == c.v_head_dim else None
        store = None if store_kernel is None else store_kernel.last_bound()    # the layer's stream of launches

        def own(reason: str, rotates: bool = True) -> LayerPlan:
            return LayerPlan(i, "module", reason, None, window, rotates=rotates, store=store)

        if c.applies_rope is False:
            return own("the layer applies no RoPE", rotates=False)
        if rope_attr(attn) is None:
            return own("no rope module: any RoPE is the attention's own code", rotates=False)
        if ctx.attention == "mla":
            return LayerPlan(i, "module", "MLA: the pools hold the cached latent rows, which the kernel cannot "
                                          "produce", None, window)
        if c.dataflow_error:
            return own(c.dataflow_error)
        if self.mode == "fused" and ks.qk_norm_rope is not None:
            kernel, (qn, kn) = ks.qk_norm_rope, qk_norm_attrs(attn)
            q_norm, k_norm = getattr(attn, qn), getattr(attn, kn)
            # The layer's own stream of launches (kernel.last_bound): steady decode steps keep their
            # shapes, so each launches the last signature's plan directly.
            call = (lambda q, k, v, p, s, kp, vp, _k=kernel.last_bound(), _qn=q_norm, _kn=k_norm:
                    _k(q, k, v, p, s, kp, vp, _qn.weight, _kn.weight))
            return LayerPlan(i, "fused", f"q/k {ctx.qk_norm.source} + RoPE + cache write: {_impl(kernel)}", call,
                             window, kernel="qk_norm_rope_pool_fused", norms=((qn, q_norm), (kn, k_norm)),
                             attention=getattr(ks, "attention", None))
        if self.mode == "fused" and ks.rope is not None:
            kernel = ks.rope
            return LayerPlan(i, "fused", _impl(kernel), kernel.last_bound(), window,
                             attention=getattr(ks, "attention", None))
        if ctx.rope is not None and ctx.attention == "mha":
            cfg = ctx.rope
            call = (lambda q, k, v, p, s, kp, vp, _c=cfg: rope_pool_fused_reference(q, k, v, p, s, kp, vp, rope=_c))
            why = ("mode='reference'" if self.mode == "reference"
                   else f"kernel not selected: {ks.rejections.get('rope_pool_fused', '?')}")
            return LayerPlan(i, "reference", why, call, window)
        return own(ctx.rope_error or "RoPE not expressible")

    def _direct_forms(self, direct: bool) -> list[tuple[Any, type]]:
        """(attention, its direct class) of every fused/reference layer whose attention runs the llama
        form (direct_attention.direct_reason, on the layer's own mlx-lm cache class), marked in its
        plan; the engine's forwards run those classes."""
        forms = []
        for i, plan in self.plans.items():
            if plan.call is None or not direct:
                continue
            attn, entry = self.attn_layers[i], self.own_template[i]
            stock = cache_at(entry, self.kv_paths[i])
            plan.direct_reason = direct_attention.direct_reason(attn, lambda: copy.deepcopy(stock))
            if not plan.direct_reason:
                plan.direct = True
                forms.append((attn, direct_attention.direct_class(attn)))
        return forms

    def _batching(self, attn_layers: dict[int, Any], own: list) -> tuple[int, str]:
        """(mask rank for batched decode, reason decode runs one request at a time or "")."""
        for i in self.stateful:
            if not _mergeable(own[i]):
                return 4, f"layer {i}'s own cache ({type(own[i]).__name__}) cannot be batched"
        ranks = set()
        for i, attn in attn_layers.items():
            cls = direct_attention.base_class(attn)   # the mlx-lm class, also where make_prompt_cache made it direct
            mod = cls.__module__
            if hasattr(sys.modules.get(mod), "scaled_dot_product_attention"):
                ranks.add(4)
                continue
            rank = _MANUAL_MASK_RANK.get((mod, cls.__name__))
            if rank is None:
                return 4, (f"layer {i}'s {cls.__name__} computes attention itself; its batched mask "
                           f"layout is unknown")
            ranks.add(rank(attn))
        if len(ranks) > 1:
            return 4, "attention layers need different batched mask layouts"
        return (ranks.pop() if ranks else 4), ""

    def explain(self) -> str:
        lines = [f"slot engine: mode={self.mode}, pool {self.pool_size} slots per layer, decode "
                 + ("batched" if not self.batch_reason else f"one request at a time ({self.batch_reason})")]
        groups: dict[tuple, list[int]] = {}
        for i, p in self.plans.items():
            groups.setdefault((type(self.attn_layers[i]).__name__, p.path, p.what, p.reason, p.window, p.how),
                              []).append(i)
        for (cls, path, what, reason, window, how), layers in groups.items():
            lines.append(f"  layers {ranges(layers)} ({cls}{f', window {window}' if window else ''}): "
                         f"{path}: {what}{f', {how}' if how else ''} [{reason}]")
        if self.stateful:
            kinds = sorted({type(self.own_template[i]).__name__ for i in self.stateful})
            lines.append(f"  layers {ranges(self.stateful)}: model's own per-request state ({', '.join(kinds)})")
        return "\n".join(lines)

    # --------------------------------------------------------------------- requests and slots

    def add_request(self, prompt: list[int], max_new_tokens: int) -> int:
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise EngineError("add_request: prompt must be a non-empty list of token ids")
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or t < 0
               or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise EngineError(f"add_request: token ids {bad[:5]} out of range [0, {self.vocab_size})")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineError(f"add_request: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        need = len(prompt) + max_new_tokens - 1
        if need > self.pool_size:
            raise EngineError(f"add_request: the request needs {need} slots, the pool has {self.pool_size}")
        rid = self._next_rid
        self._next_rid += 1
        self.requests[rid] = Request(rid, [int(t) for t in prompt], max_new_tokens)
        self.waiting.append(rid)
        return rid

    def _take_slots(self, n: int) -> list[int]:
        if n > len(self.free):
            raise EngineError(f"slot pool exhausted: need {n} slots, {len(self.free)} free of {self.pool_size}; "
                              f"raise pool_size or admit fewer requests")
        return [self.free.pop() for _ in range(n)]

    def release(self, rid: int) -> None:
        """Give a request's slots back and drop its state (finished requests are released by step)."""
        r = self.requests.get(rid)
        if r is None:
            raise EngineError(f"release: no request {rid}")
        self.free.extend(reversed(r.slots))
        r.slots, r.state = [], None
        for q in (self.waiting, self.running):
            if rid in q:
                q.remove(rid)

    @property
    def free_slots(self) -> int:
        return len(self.free)

    # --------------------------------------------------------------------- forward

    def _assemble(self, template, path, layer: int, states: list):
        """The cache entry for `layer`: the engine's PoolCache at the KV position, each request's own
        state (merged into one batch when several) elsewhere."""
        if path == ():
            return self.pools[layer]
        if path is None:
            return states[0] if len(states) == 1 else _merge(states)
        subs = [self._assemble(t, path[1:] if j == path[0] else None, layer, [s.caches[j] for s in states])
                for j, t in enumerate(template.caches)]
        return type(template)(*subs)

    def _forward(self, reqs: list[Request], tokens: mx.array) -> mx.array:
        """Build the model's forward on `tokens` [B, L] (L new tokens per request, possibly a lazy
        array still being computed); returns the last logits [B, V], unevaluated."""
        B, L = tokens.shape
        offsets = [len(r.slots) for r in reqs]
        new_slots = self._take_slots(B * L)
        saved = [(r, len(r.slots), r.run) for r in reqs]
        snap = [_snapshot(r.state) for r in reqs] if self.stateful else None
        for b, r in enumerate(reqs):
            mine = new_slots[b * L:(b + 1) * L]
            first = r.slots[-1] + 1 if r.slots else mine[0]
            r.run = r.run and mine == list(range(first, first + L))
            r.slots.extend(mine)
        lens = [len(r.slots) for r in reqs]
        ctx_len = max(lens)
        qpos = None if B == 1 and reqs[0].run else np.asarray(offsets, np.int32)[:, None] + self._arange[:L][None]
        if B == 1:                                     # one request: no padding, masks from its offset
            r = reqs[0]
            if r.run:                                  # both progressions: made on the device, no host data
                positions = device_arange(offsets[0], L, 1, self._backend)
                slots = device_arange(new_slots[0], L, 1, self._backend)
                self.step_ctx = Step(B, L, offsets, ctx_len, positions, slots, (r.slots[0], ctx_len), None)
            else:
                positions, slots, table = device_indices(self._backend, qpos.reshape(-1), new_slots,
                                                         np.asarray(r.slots, np.int32)[None])
                self.step_ctx = Step(B, L, offsets, ctx_len, positions, slots, None, table)
        else:
            table = np.empty((B, ctx_len), np.int32)
            for b, r in enumerate(reqs):
                n = lens[b]
                table[b, :n] = r.slots
                table[b, n:] = r.slots[0]              # padding reads a valid slot; the mask hides it
            ar = self._arange[:ctx_len][None]
            kpos = np.where(ar < np.asarray(lens, np.int32)[:, None], ar, np.int32(-1))
            positions, slots, table, kpos, qpos, lens_d = device_indices(self._backend, qpos.reshape(-1), new_slots,
                                                                         table, kpos, qpos, lens)
            self.step_ctx = Step(B, L, offsets, ctx_len, positions, slots, None, table, kpos, qpos, lens_d)
        if self._static_caches is not None:
            caches = self._static_caches
        else:
            caches = [self._assemble(self.own_template[i], self.kv_paths.get(i), i, [r.state[i] for r in reqs])
                      for i in range(len(self.own_template))]
        # What the forward swaps in (hooks, direct classes) goes back to what was there before it, not to
        # what the engine saw when it was built: make_prompt_cache may have installed its switches since.
        owned = [(attn, attr, getattr(attn, attr)) for attn, attr, _ in self.hooks.values()]
        for attn, attr, hook in self.hooks.values():
            if isinstance(hook, RopeCapture):
                hook.reset()
            setattr(attn, attr, hook)
        classes = [(attn, attn.__class__) for attn, _ in self._direct]
        for attn, sub in self._direct:
            attn.__class__ = sub
        try:
            logits = self.model(tokens, cache=caches)[:, -1, :]
            for i, (attn, attr, hook) in self.hooks.items():
                if isinstance(hook, RopeCapture) and hook.calls:
                    raise EngineError(f"layer {i}: the attention called its rope but never wrote the cache")
            if B > 1:                                # hand each request its row of the merged states
                for i in self.stateful:
                    _split_into(caches[i], [r.state[i] for r in reqs])
        except BaseException:
            for j, (r, n, run) in enumerate(saved):  # leave the requests as they were
                del r.slots[n:]
                r.run = run
                if snap is not None:
                    _restore(r.state, snap[j])
            self.free.extend(reversed(new_slots))
            raise
        finally:
            for attn, cls in classes:
                attn.__class__ = cls
            for attn, attr, module in owned:
                setattr(attn, attr, module)
            for hook in self.hooks.values():
                if isinstance(hook[2], RopeCapture):
                    hook[2].reset()
        return logits

    def _launch(self, reqs: list[Request], logits: mx.array) -> "_InFlight":
        """Queue the greedy tokens (and recorded logits) of a forward with mx.async_eval: the device
        runs it while Python builds the next step; the tokens are read later (`_read`)."""
        nxt = mx.argmax(logits, axis=-1)
        kept = logits if self.record_logits else None
        if kept is not None:
            mx.async_eval(nxt, kept)
        else:
            mx.async_eval(nxt)
        g = _InFlight(reqs, nxt, kept)
        for b, r in enumerate(reqs):
            r.scheduled += 1
            r.last, r.last_row = g, b
        return g

    def _inputs(self, reqs: list[Request]) -> mx.array:
        """[B, 1] next inputs: each request's newest token, lazily (greedy feeds the argmax back, as
        mlx-lm does, without waiting for it). The previous batch unchanged is its token array as is."""
        g = reqs[0].last
        if len(g.reqs) == len(reqs) and all(r.last is g and r.last_row == b for b, r in enumerate(reqs)):
            col = g.tokens
        else:
            col = mx.concatenate([r.last.tokens[r.last_row:r.last_row + 1] for r in reqs])
        return col.astype(mx.int32)[:, None]

    @staticmethod
    def _read(groups: list["_InFlight"]) -> list[tuple[int, int]]:
        """Wait for queued forwards and hand their tokens (and logits) to their requests."""
        out = []
        for g in groups:
            toks = g.tokens.tolist()
            if g.logits is not None:
                for r, row in zip(g.reqs, np.array(g.logits.astype(mx.float32))):
                    r.logits.append(row)
            for r, t in zip(g.reqs, toks):
                r.generated.append(t)
                out.append((r.rid, t))
        return out

    def flush(self) -> list[tuple[int, int]]:
        """Read every queued decode step now; returns the (request id, token) pairs (step() does this
        by itself when nothing is left to run)."""
        groups, self._inflight = self._inflight, []
        return self._read(groups)

    def _outstanding(self, r: Request) -> int:
        """Slots `r` will still take: prompt + max_new_tokens - 1 in all (the last token is never written)."""
        return len(r.prompt) + r.max_new_tokens - 1 - len(r.slots)

    def step(self) -> list[tuple[int, int]]:
        """Admit and prefill waiting requests (one at a time, first come first served, while the pool
        can hold everything they and the running requests will still write), then queue one decode
        step for the requests that were already running (batched). Returns the (request id, token)
        pairs read: the prefills' first tokens, and the previous step's decode tokens.

        Pipelined like mlx-lm's generate_step: the decode step is queued with mx.async_eval on the
        previous step's tokens as lazy arrays, and only then are the previous step's tokens read, so
        the device computes step n while Python builds step n+1. A request leaves `running` (and
        gives its slots back) once its last forward is queued; its last tokens arrive with the next
        step, or now when nothing is left to run. Admission reserves whole requests, so a decode
        step never runs out of slots."""
        decode = [self.requests[rid] for rid in self.running]
        prev, self._inflight = self._inflight, []
        admitted: list[_InFlight] = []
        t0 = time.perf_counter()
        try:
            reserved = sum(self._outstanding(r) for r in decode)
            for rid in list(self.waiting):
                r = self.requests[rid]
                if self._outstanding(r) > len(self.free) - reserved:
                    break                                     # waits for running requests to finish
                reserved += self._outstanding(r) - len(r.prompt)
                r.state = make_own_cache(self.model) if self.stateful else [None] * len(self.own_template)
                admitted.append(self._launch([r], self._forward([r], mx.array([r.prompt], dtype=mx.int32))))
                self.timing["prefill_tokens"] += len(r.prompt)
                self.waiting.remove(rid)
                self.running.append(rid)
            if self.waiting and not decode and not self.running:
                r = self.requests[self.waiting[0]]
                raise EngineError(f"request {r.rid} needs {self._outstanding(r)} slots and only {len(self.free)} "
                                  f"of {self.pool_size} are free with nothing running")
            t1 = time.perf_counter()
            if decode:
                if self.batch_reason:
                    for r in decode:
                        self._inflight.append(self._launch([r], self._forward([r], self._inputs([r]))))
                else:
                    self._inflight.append(self._launch(decode, self._forward(decode, self._inputs(decode))))
        except BaseException:
            self._inflight = prev + self._inflight + admitted   # nothing queued is lost
            raise
        for rid in list(self.running):
            r = self.requests[rid]
            if r.scheduled >= r.max_new_tokens:
                self.release(rid)
        out = self._read(prev) + self._read(admitted)
        if not self.waiting and not self.running:
            out += self.flush()
        t2 = time.perf_counter()
        if decode:
            self.timing["prefill_s"] += t1 - t0
            self.timing["decode_s"] += t2 - t1
            self.timing["decode_tokens"] += len(decode)
            self.timing["decode_steps"] += 1
        else:
            self.timing["prefill_s"] += t2 - t0
        return out

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> dict:
        """Greedy decode `max_new_tokens` for each prompt; returns the tokens per request (in prompt
        order), timings and, with record_logits, each step's float32 logits per request [steps, V]."""
        before = dict(self.timing)
        rids = [self.add_request(p, max_new_tokens) for p in prompts]
        while self.waiting or self.running or self._inflight:
            self.step()
        reqs = [self.requests.pop(rid) for rid in rids]
        t = {k: self.timing[k] - before[k] for k in self.timing}
        out = {"tokens": [r.generated for r in reqs], **t,
               "decode_tokens_per_s": t["decode_tokens"] / t["decode_s"] if t["decode_s"] > 0 else 0.0}
        if self.record_logits:
            out["logits"] = [np.stack(r.logits) for r in reqs]
        return out


@dataclass(eq=False)
class _InFlight:
    """One queued forward: its requests, their greedy tokens [B] and (recording) logits [B, V]."""
    reqs: list[Request]
    tokens: mx.array
    logits: mx.array | None


# ----------------------------------------------------------------------------- helpers

def _impl(kernel) -> str:
    return kernel.implementation + (f" ({kernel.reason})" if kernel.reason else "")


def _vocab_size(model) -> int | None:
    args = getattr(model, "args", None)
    for obj in (args, getattr(args, "text_config", None)):
        v = obj.get("vocab_size") if isinstance(obj, dict) else getattr(obj, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _has_state(entry) -> bool:
    if entry is None or hasattr(entry, "update_and_fetch"):
        return False
    if hasattr(entry, "caches"):
        return any(_has_state(c) for c in entry.caches)
    return True


def _mergeable(entry) -> bool:
    """Per-request state the engine can batch: ArraysCache-like (a `cache` list of [B, ...] arrays),
    possibly inside a CacheList next to the layer's KV cache."""
    if entry is None or hasattr(entry, "update_and_fetch"):
        return True
    if hasattr(entry, "caches"):
        return all(_mergeable(c) for c in entry.caches)
    return isinstance(getattr(entry, "cache", None), list)


def _merge(states: list):
    """One ArraysCache-like object holding the requests' states along the batch axis."""
    first = states[0]
    merged = type(first).__new__(type(first))
    merged.__dict__.update(first.__dict__)
    merged.cache = [None if all(s.cache[j] is None for s in states) else
                    mx.concatenate([s.cache[j] for s in states], axis=0) for j in range(len(first.cache))]
    return merged


def _split_into(entry, states: list) -> None:
    if hasattr(entry, "caches"):
        for j, sub in enumerate(entry.caches):
            if not hasattr(sub, "update_and_fetch"):
                _split_into(sub, [s.caches[j] for s in states])
        return
    for b, s in enumerate(states):
        s.cache = [None if c is None else c[b:b + 1] for c in entry.cache]


def _snapshot(state):
    if state is None:
        return None
    return [None if e is None else _snap_entry(e) for e in state]


def _snap_entry(e):
    if hasattr(e, "caches"):
        return [_snap_entry(c) for c in e.caches]
    return list(e.cache) if isinstance(getattr(e, "cache", None), list) else None


def _restore(state, snap) -> None:
    if state is None or snap is None:
        return
    for e, s in zip(state, snap):
        _restore_entry(e, s)


def _restore_entry(e, s) -> None:
    if e is None or s is None:
        return
    if hasattr(e, "caches"):
        for c, cs in zip(e.caches, s):
            _restore_entry(c, cs)
    elif isinstance(getattr(e, "cache", None), list):
        e.cache = list(s)
