"""A small slot-pool decode engine over unmodified mlx-lm models (docs/engine.md).

Per attention layer: K/V pools [S, Hkv, D]. Each request owns a list of pool slots (one per token);
prefill writes its prompt's K/V into fresh slots, every decode step batches the requests (different
lengths, their own positions) and writes one slot each. Attention reads each request's slots.

How the model's own attention code is driven (no model code is copied or patched):
  - the layer's `rope` is swapped for a hook that returns q and k unchanged and remembers q;
  - the layer's cache is a PoolCache whose update_and_fetch(k, v) runs the kernel set's `rope`
    (one fused call: q and k rotation + both pool stores), rebinds the attention's `queries` to
    the rotated q (`q[...] = q_rot`, which MLX applies to that very array object), and returns the
    request's K/V gathered from the pools; make_mask gives the matching causal/window/padding mask.
  - Layers whose RoPE cannot be fused run the module's own rope and a plain scatter into the pools.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from .mlx_lm import ModelKernels, attention_dims, attention_of, build_kernel_sets, model_layers


@dataclass
class StepContext:
    """What every layer needs for one forward: the new tokens' positions and slots (token-major,
    request by request), and each request's context slots for attention."""
    batch: int
    length: int                       # new tokens per request in this step
    positions: mx.array               # int32 [batch * length]
    slots: mx.array                   # int32 [batch * length]
    offsets: list[int]                # tokens already cached per request
    table: mx.array                   # int32 [batch, ctx]: slots to attend (padded)
    key_pos: mx.array                 # int32 [batch, ctx]: position of each context slot (-1: padding)
    query_pos: mx.array               # int32 [batch, length]


class RopeHook:
    """Stands in for an attention module's rope during engine forwards."""

    def __init__(self, rope: Any, fused: bool):
        self.rope = rope
        self.fused = fused
        self.ctx: StepContext | None = None
        self.pending_q: mx.array | None = None
        self.calls = 0

    def __call__(self, x: mx.array, offset: Any = 0, **kw) -> mx.array:
        self.calls += 1
        if self.fused:
            if self.calls % 2 == 1:
                self.pending_q = x        # rotated later, in PoolCache.update_and_fetch, with k
            return x
        return self._module_rope(x)

    def _module_rope(self, x: mx.array) -> mx.array:
        """The module's own rope at per-request offsets (its classes accept an int or a [B] offset;
        DynamicNTKScalingRoPE only an int, hence the per-request fallback)."""
        offsets = self.ctx.offsets
        if len(set(offsets)) == 1:
            return self.rope(x, offset=offsets[0])
        try:
            return self.rope(x, offset=mx.array(offsets, dtype=mx.int32))
        except (ValueError, TypeError):
            return mx.concatenate([self.rope(x[b:b + 1], offset=o) for b, o in enumerate(offsets)], axis=0)


class PoolCache:
    """The cache object a layer sees during engine forwards."""

    def __init__(self, engine: "SlotEngine", layer: int, hook: RopeHook, kernel, n_kv: int, head_dim: int,
                 pool_size: int, dtype):
        self.engine = engine
        self.layer = layer
        self.hook = hook
        self.kernel = kernel                       # kernel_set.rope, or None for the unfused path
        self.k_pool = mx.zeros((pool_size, n_kv, head_dim), dtype=dtype)
        self.v_pool = mx.zeros((pool_size, n_kv, head_dim), dtype=dtype)

    @property
    def offset(self) -> int:
        return max(self.engine.ctx.offsets)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **_):
        ctx = self.engine.ctx
        q = ctx.query_pos[:, :, None]             # [B, L, 1]
        k = ctx.key_pos[:, None, :]               # [B, 1, ctx]
        mask = (k >= 0) & (k <= q)
        if window_size is not None:
            mask = mask & (k > q - window_size)
        # One request: [L, ctx], the shape mlx-lm's own masks have (attention code that reshapes its
        # scores relies on it). Batches: [B, 1, L, ctx] for mx.fast.scaled_dot_product_attention.
        return mask[0] if ctx.batch == 1 else mask[:, None]

    @staticmethod
    def _tokens(x: mx.array) -> mx.array:         # [B, H, L, D] -> [B*L, H, D]
        B, H, L, D = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B * L, H, D)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        ctx = self.engine.ctx
        B, _, L, D = keys.shape
        k_tok, v_tok = self._tokens(keys), self._tokens(values)
        if self.kernel is not None:
            queries = self.hook.pending_q
            q_rot, _, self.k_pool, self.v_pool = self.kernel(
                self._tokens(queries), k_tok, v_tok, ctx.positions, ctx.slots, self.k_pool, self.v_pool,
                check_slots=False)                 # the engine validated the slots once for the step
            Hq = queries.shape[1]
            queries[...] = q_rot.reshape(B, L, Hq, D).transpose(0, 2, 1, 3)
            self.hook.pending_q = None
        else:                                      # keys were rotated by the module's own rope
            self.k_pool[ctx.slots] = k_tok
            self.v_pool[ctx.slots] = v_tok
        kk = self.k_pool[ctx.table].transpose(0, 2, 1, 3)   # [B, Hkv, ctx, D]
        vv = self.v_pool[ctx.table].transpose(0, 2, 1, 3)
        return kk, vv


@dataclass
class Request:
    rid: int
    tokens: list[int]
    slots: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)


class SlotEngine:
    """Greedy generation for several requests through per-layer slot pools."""

    def __init__(self, model, *, pool_size: int = 4096, kernels: ModelKernels | None = None, use_fused: bool = True):
        self.model = model
        self.kernels = kernels or build_kernel_sets(model)
        layers = model_layers(model)
        self.dtype = self._compute_dtype(model)
        self.pool_size = pool_size
        self.free = list(range(pool_size - 1, -1, -1))
        self.requests: dict[int, Request] = {}
        self.ctx: StepContext | None = None
        own = model.make_cache() if hasattr(model, "make_cache") else [None] * len(layers)
        self._own_per_request: dict[int, list] = {}
        self.caches: list[Any] = []
        self.hooks: list[tuple[Any, RopeHook]] = []
        for i, layer in enumerate(layers):
            attn = attention_of(layer)
            if attn is None:
                self.caches.append(own[i])         # e.g. a hybrid model's linear-attention state
                continue
            kset = self.kernels.by_layer.get(i)
            kernel = kset.rope if (kset is not None and use_fused) else None
            rope_attr = "rope" if hasattr(attn, "rope") else "rotary_emb"
            hook = RopeHook(getattr(attn, rope_attr), fused=kernel is not None)
            self.hooks.append((attn, hook, rope_attr))
            _, n_kv, head_dim = attention_dims(attn)
            self.caches.append(PoolCache(self, i, hook, kernel, n_kv, head_dim, pool_size, self.dtype))
        self.hybrid = any(c is not None and not isinstance(c, PoolCache) for c in self.caches)
        # Attention code that does not go through mlx-lm's scaled_dot_product_attention (gemma2's
        # soft-capped attention) shapes masks its own way: step such models one request at a time.
        manual = [type(a).__name__ for a, _, _ in self.hooks
                  if not hasattr(sys.modules.get(type(a).__module__), "scaled_dot_product_attention")]
        self.per_request = self.hybrid or bool(manual)

    @staticmethod
    def _compute_dtype(model):
        from mlx.utils import tree_flatten
        for _, v in tree_flatten(model.parameters()):
            if v.dtype in (mx.float16, mx.bfloat16, mx.float32):
                return v.dtype
        return mx.float32

    # --------------------------------------------------------------------- requests and slots

    def add_request(self, tokens: list[int]) -> int:
        if not tokens:
            raise ValueError("add_request: a prompt needs at least one token")
        rid = len(self.requests)
        self.requests[rid] = Request(rid, list(tokens))
        return rid

    def _take_slots(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"slot pool exhausted: need {n} slots, {len(self.free)} free of {self.pool_size}; "
                               f"raise pool_size or finish requests")
        return [self.free.pop() for _ in range(n)]

    def release(self, rid: int) -> None:
        self.free.extend(reversed(self.requests[rid].slots))
        self.requests[rid].slots = []

    # --------------------------------------------------------------------- forward

    def _forward(self, reqs: list[Request], new_tokens: list[list[int]]) -> mx.array:
        """Run the model on `new_tokens` (same count per request) for `reqs`; returns last logits [B, V]."""
        B, L = len(reqs), len(new_tokens[0])
        offsets = [len(r.slots) for r in reqs]
        new_slots = [self._take_slots(L) for _ in reqs]
        for r, s in zip(reqs, new_slots):
            r.slots.extend(s)
        ctx_len = max(len(r.slots) for r in reqs)
        table = np.zeros((B, ctx_len), np.int32)
        kpos = np.full((B, ctx_len), -1, np.int32)
        for b, r in enumerate(reqs):
            n = len(r.slots)
            table[b, :n] = r.slots
            table[b, n:] = r.slots[0]              # padding reads a valid slot; the mask hides it
            kpos[b, :n] = np.arange(n)
        qpos = np.array([[o + j for j in range(L)] for o in offsets], np.int32)
        self.ctx = StepContext(B, L, mx.array(qpos.reshape(-1)), mx.array(np.array(new_slots, np.int32).reshape(-1)),
                               offsets, mx.array(table), mx.array(kpos), mx.array(qpos))
        for attn, hook, rope_attr in self.hooks:
            hook.ctx, hook.calls, hook.pending_q = self.ctx, 0, None
            setattr(attn, rope_attr, hook)
        caches = self.caches
        if self.hybrid:   # recurrent layers carry per-request state: one own-cache list per request
            assert B == 1, "hybrid models are stepped one request at a time"
            own = self._own_per_request.setdefault(reqs[0].rid, self.model.make_cache())
            caches = [c if isinstance(c, PoolCache) else own[i] for i, c in enumerate(self.caches)]
        try:
            logits = self.model(mx.array(new_tokens, dtype=mx.int32), cache=caches)
        finally:
            for attn, hook, rope_attr in self.hooks:
                setattr(attn, rope_attr, hook.rope)
        return logits[:, -1, :]

    def generate(self, prompts: list[list[int]], max_new_tokens: int, collect_logits: bool = False) -> dict:
        """Greedy decode: prefill each prompt, then batched decode steps. Returns the generated tokens,
        timings and, with collect_logits, each step's float32 logits per request ([steps, vocab])."""
        rids = [self.add_request(p) for p in prompts]
        reqs = [self.requests[r] for r in rids]
        logits_log: list[list[np.ndarray]] = [[] for _ in reqs]
        t0 = time.perf_counter()
        rows = [self._forward([r], [r.tokens]) for r in reqs]   # prefill, one request at a time
        logits = mx.concatenate(rows)
        nxt = mx.argmax(logits, axis=-1)
        mx.eval(nxt, logits)
        t1 = time.perf_counter()
        for step in range(max_new_tokens):
            if collect_logits:
                for b, row in enumerate(np.array(logits.astype(mx.float32))):
                    logits_log[b].append(row)
            ids = nxt.tolist()
            for r, t in zip(reqs, ids):
                r.generated.append(t)
            if step + 1 == max_new_tokens:
                break
            if self.per_request:                                   # hybrid or self-made attention: one at a time
                logits = mx.concatenate([self._forward([r], [[t]]) for r, t in zip(reqs, ids)])
            else:
                logits = self._forward(reqs, [[t] for t in ids])
            nxt = mx.argmax(logits, axis=-1)
            mx.eval(nxt, logits)
        t2 = time.perf_counter()
        decoded = len(reqs) * max(0, max_new_tokens - 1)
        out = {"tokens": [r.generated for r in reqs], "prefill_s": t1 - t0, "decode_s": t2 - t1,
               "decode_tokens_per_s": decoded / (t2 - t1) if t2 > t1 and decoded else 0.0}
        if collect_logits:
            out["logits"] = [np.stack(x) for x in logits_log]
        return out
