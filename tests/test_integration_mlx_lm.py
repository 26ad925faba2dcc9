"""Engines on real mlx-lm 0.32.2 model code: kernel sets per layer configuration, the committed
coverage table, and greedy-decode equivalence of the slot engine (fused kernel / reference path)
with mlx-lm's own model call and KVCache. Runs on the default device (CPU in CI; GPU host too)."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from registry.core import backend_of
from registry.integrations.coverage import ARCHS, render
from registry.integrations.mlx_lm import attention_dims, build_kernel_sets, build_model, import_mlx_lm_module, model_layers
from registry.integrations.slot_engine import SlotEngine
from registry.paths import PROJECT_ROOT

PROMPTS = [[3, 17, 42, 99, 7], [11, 5], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]]   # different lengths
NEW_TOKENS = 16
# Architectures the engine runs; deepseek_v3 (MLA) is covered by the rejection test below.
ENGINE_ARCHS = [a for a in ARCHS if "MLA" not in a]


def mlx_lm_greedy(model, prompt, n):
    """mlx-lm's own path: the model call with its make_prompt_cache caches, batch 1."""
    cache = import_mlx_lm_module("cache").make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    toks, rows = [], []
    for _ in range(n):
        t = mx.argmax(logits, axis=-1)
        rows.append(np.array(logits.astype(mx.float32))[0])
        toks.append(t.item())
        logits = model(t[None], cache=cache)[:, -1, :]
    return toks, np.stack(rows)


@pytest.fixture(scope="module")
def models():
    built = {}
    for name in ENGINE_ARCHS:
        mx.random.seed(0)
        built[name] = build_model(ARCHS[name])
    return built


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_float32_greedy_tokens_identical(native_artifacts, models, arch, monkeypatch):
    model = models[arch]
    fused = SlotEngine(model).generate(PROMPTS, NEW_TOKENS, collect_logits=True)
    monkeypatch.setenv("MLX_AOT_DISABLE_NATIVE", "1")
    reference = SlotEngine(model).generate(PROMPTS, NEW_TOKENS, collect_logits=True)
    # CPU: exact tokens, logits to fp32 round-off. GPU: float32 matmuls may run in TF32 and a batch of
    # 3 decode rows takes another GEMM path than mlx-lm's batch of 1, so logits differ by up to ~5e-3;
    # tokens must agree up to the first step where mlx-lm's own top-2 margin is below that noise.
    atol = 2e-4 if backend_of(None) == "cpu" else 1e-2
    for i, prompt in enumerate(PROMPTS):
        toks, logits = mlx_lm_greedy(model, prompt, NEW_TOKENS)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        near_tie = np.nonzero(top2[:, 1] - top2[:, 0] < 2 * atol)[0]
        n = NEW_TOKENS if backend_of(None) == "cpu" or not len(near_tie) else int(near_tie[0])
        for name, run in (("fused", fused), ("reference", reference)):
            assert run["tokens"][i][:n] == toks[:n], f"{arch}: request {i} {name} engine vs mlx-lm"
            # Logits of the step after the last compared token still share its history.
            m = min(n + 1, NEW_TOKENS)
            np.testing.assert_allclose(run["logits"][i][:m], logits[:m], atol=atol, rtol=1e-3,
                                       err_msg=f"{arch} {name}")


def test_engine_uses_the_fused_kernel_where_selected(native_artifacts, models):
    engine = SlotEngine(models["llama (llama3)"])
    kset = engine.kernels.by_layer[0]
    assert kset.rope is not None and kset.rope.implementation == f"native-{backend_of(None)}"
    calls = []
    original = type(kset.rope).__call__

    def counting(self, *a, **kw):
        calls.append(a[0].shape)
        return original(self, *a, **kw)
    type(kset.rope).__call__ = counting
    try:
        engine.generate(PROMPTS[:2], 3)
    finally:
        type(kset.rope).__call__ = original
    layers = len(model_layers(models["llama (llama3)"]))
    # prefill of each request + 2 batched decode steps, one fused call per layer each
    assert len(calls) == layers * (2 + 2)
    assert calls[-1][0] == 2   # a decode step batches both requests: T = 2 tokens


def test_engine_falls_back_where_rejected(models):
    engine = SlotEngine(models["llama (dynamic)"])
    assert all(ks.rope is None for ks in engine.kernels.by_layer.values())
    assert "DynamicNTKScalingRoPE" in engine.kernels.configs[0].kernel_set.rejections["rope_pool_fused"]


def test_bfloat16_logits_within_tolerance(native_artifacts):
    """bf16: activations and pools round to 8 mantissa bits, and the fused kernel rounds q/k once
    from fp32 while mlx-lm rounds after mx.fast.rope, so greedy tokens may flip on near-ties; the
    logits must stay within a few bf16 ulps of the logit scale."""
    mx.random.seed(0)
    model = build_model(ARCHS["qwen3"], dtype=mx.bfloat16)
    out = SlotEngine(model).generate(PROMPTS, 4, collect_logits=True)
    for i, prompt in enumerate(PROMPTS):
        toks, logits = mlx_lm_greedy(model, prompt, 4)
        # Compare step 0 (same inputs on both sides) and later steps while the tokens agree.
        steps = 1 + next((s for s in range(1, 4) if out["tokens"][i][s - 1] != toks[s - 1]), 3)
        scale = np.abs(logits[:steps]).max()
        assert np.abs(out["logits"][i][:steps] - logits[:steps]).max() <= 0.05 * scale + 0.05


def test_gemma3_has_one_kernel_set_per_layer_kind(models):
    kernels = build_kernel_sets(models["gemma3"])
    assert len(kernels.configs) == 2
    bases = sorted(c.kernel_set.context.rope.base for c in kernels.configs)
    assert bases == [10000.0, 1e6]


def test_hybrid_model_skips_non_attention_layers(models):
    kernels = build_kernel_sets(models["qwen3_next (hybrid)"])
    assert kernels.non_attention_layers == [0, 1, 2] and list(kernels.by_layer) == [3]


def test_deepseek_v3_mla_is_rejected_with_reason():
    mx.random.seed(0)
    kernels = build_kernel_sets(build_model(ARCHS["deepseek_v3 (MLA)"]))
    for c in kernels.configs:
        assert c.kernel_set.rope is None
        assert c.kernel_set.rejections["rope_pool_fused"].startswith("attention layout is mla")


def test_head_dim_is_read_robustly(models):
    # qwen2 and starcoder2 have no head_dim attribute; gpt_neox has no kv-heads attribute.
    for arch, expected in [("qwen2", (4, 2, 16)), ("starcoder2", (4, 2, 16)), ("gpt_neox", (4, 4, 16)),
                           ("qwen3", (4, 2, 32))]:
        layer = model_layers(models[arch])[0]
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention")
        assert attention_dims(attn) == expected, arch


def test_committed_coverage_table_is_current():
    committed = (PROJECT_ROOT / "docs" / "coverage.md").read_text()
    assert committed == render(), "regenerate: python -m registry.integrations.coverage > docs/coverage.md"


def test_engine_command_runs():
    p = subprocess.run([sys.executable, "-m", "registry.integrations.engine", "--arch", "qwen3", "--prompts", "3",
                        "--tokens", "4"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "tokens/s" in p.stdout and "rope_pool_fused" in p.stdout and "request 2:" in p.stdout
