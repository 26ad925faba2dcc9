"""The q/k-norm and NoPE side of the mlx-lm integration: the trace finds layers whose q/k run per-head
norm -> RoPE -> cache (and refuses the others, checked on the logits), the selection context says
which layers apply no RoPE, and the slot engine runs qk_norm_rope_pool_fused / kv_pool_store there,
natively where the artifact is built. Runs on the default device (CPU in CI; the GPU host too)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from registry import native
from registry.core import backend_of
from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_kernel_sets, build_model, import_mlx_lm_module, trace_attention
from registry.integrations.slot_engine import SlotEngine
from registry.norm import NormConfig

PROMPTS = [[3, 17, 42, 99, 7], [11, 5]]


def model_of(arch: str, dtype=None):
    mx.random.seed(0)
    return build_model(ARCHS[arch], dtype=dtype)


@pytest.mark.parametrize("arch, offset", [("qwen3", 0.0), ("gemma3", 1.0), ("plamo3 (1 + w q/k norm)", 1.0),
                                          ("exaone4 (sliding, NoPE global)", 0.0)])
def test_norm_then_rope_layers_get_the_fused_norm_kernel(arch, offset):
    kernels = build_kernel_sets(model_of(arch))
    fused = [c for c in kernels.configs if c.kernel_set.qk_norm_rope is not None]
    assert fused, kernels.explain()
    for c in fused:
        assert c.kernel_set.context.qk_norm.weight_offset == offset
        assert c.status.startswith("qk_norm_rope_pool_fused")


@pytest.mark.parametrize("arch, why", [
    ("olmo2", "a norm across heads"),
    ("minimax (q/k norm across heads)", "a norm across heads"),
    ("cohere (q/k LayerNorm)", "LayerNorm2D has no 1-D weight"),
    ("hunyuan_v1_dense (q/k norm after RoPE)", "not the rope's output"),
])
def test_other_q_k_norms_are_left_out_with_the_reason(arch, why):
    for c in build_kernel_sets(model_of(arch)).configs:
        assert c.kernel_set.qk_norm_rope is None
        assert why in c.kernel_set.rejections["qk_norm_rope_pool_fused"]


def test_the_trace_checks_the_order_on_the_logits():
    """An attention that adds to q between its norm and its rope: the modules are per-head RMSNorms,
    but moving the norm to the cache write would change the logits, so the trace refuses it."""
    qwen3 = import_mlx_lm_module("qwen3")

    class Shifted(qwen3.Attention):
        def __call__(self, x, mask=None, cache=None):
            B, L, _ = x.shape
            q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1)).transpose(0, 2, 1, 3) + 0.5
            k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
            out = qwen3.scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    model = model_of("qwen3")
    assert all(t.qk_norm_fusable for t in trace_attention(model).values())
    for layer in model.model.layers:
        layer.self_attn.__class__ = Shifted
    traces = trace_attention(model)
    assert not any(t.qk_norm_fusable for t in traces.values())
    assert all("does not run per-head norm -> RoPE -> cache" in t.qk_norm_error for t in traces.values())
    (config,) = build_kernel_sets(model).configs
    assert config.kernel_set.qk_norm_rope is None and config.kernel_set.rope is not None
    # ... and the engine then runs rope_pool_fused after the model's own norm, still exact in fp32
    engine = SlotEngine(model)
    assert {p.what for p in engine.plans.values()} == {"rope_pool_fused"}


def test_requires_can_say_no_rope_is_applied():
    """cohere2's global layers own a rope module they never call: rope is a valid RopeConfig there, so
    only `applies_rope` keeps the RoPE kernels off them; kv_pool_store serves their cache write."""
    kernels = build_kernel_sets(model_of("cohere2 (sliding, NoPE global)"))
    nope = next(c for c in kernels.configs if c.applies_rope is False)
    ks = nope.kernel_set
    assert ks.context.rope is not None and ks.context.applies_rope is False
    assert ks.rope is None and ks.rejections["rope_pool_fused"] == "the layer applies no RoPE"
    assert ks.kv_store is not None


def test_engine_runs_the_new_kernels_natively(native_artifacts):
    """qwen3: qk_norm_rope_pool_fused on every layer (the q/k norms bypassed in the forward, applied by
    the kernel); cohere2: kv_pool_store on its NoPE layers. Tokens equal mlx-lm's own greedy decode."""
    from registry.integrations.engine import mlx_lm_greedy

    backend = backend_of(None)
    for arch, kernel, attr in [("qwen3", "qk_norm_rope_pool_fused", "qk_norm_rope"),
                               ("cohere2 (sliding, NoPE global)", "kv_pool_store", "kv_store")]:
        model = model_of(arch, mx.float32)
        engine = SlotEngine(model)
        plans = [p for p in engine.plans.values() if kernel in p.what]
        assert plans, engine.explain()
        kset = engine.kernels.by_layer[plans[0].layer]
        impl = getattr(kset, attr)
        assert impl.implementation == f"native-{backend}", impl.reason
        calls = {"ours": 0, "all": 0}

        def counted(fn, ours):
            def count(*a):
                calls["all"] += 1
                calls["ours"] += ours
                return fn(*a)
            return count

        for p in engine.plans.values():           # every layer's kernel entry (cohere2's sliding: rope)
            for attr_name in ("call", "store"):
                if getattr(p, attr_name) is not None:
                    setattr(p, attr_name, counted(getattr(p, attr_name), any(p is q for q in plans)))
        native.reset_stats()
        out = engine.generate(PROMPTS, 4)
        assert calls["ours"] == len(plans) * (len(PROMPTS) + 3)    # every prefill and batched decode step
        # each call one native launch, plus decode_attention's in batched decode steps where it is
        # selected (CUDA)
        assert native.stats()["launches"] == calls["all"] + engine.calls["decode_attention"]
        for i, prompt in enumerate(PROMPTS):
            assert out["tokens"][i] == mlx_lm_greedy(model, prompt, 4), arch
        # the norms are back in place after the forwards
        attn = engine.attn_layers[plans[0].layer]
        assert type(getattr(attn, "q_norm", None)).__name__ != "NormBypass"


def test_norm_config_reaches_expressions():
    from registry.expr import compile_requirement

    req = compile_requirement("qk_norm is not None and qk_norm.weight_offset == 1 and applies_rope != False")
    assert req.holds({"qk_norm": NormConfig(1e-6, 1.0), "applies_rope": None})
    assert not req.holds({"qk_norm": NormConfig(1e-6, 0.0), "applies_rope": True})
    assert not req.holds({"qk_norm": None, "applies_rope": True})
