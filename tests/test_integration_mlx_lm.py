"""registry.integrations.mlx_lm on real mlx-lm 0.32.2 model code: finding attention layers, reading
their shapes, tracing what they do, one kernel set per layer configuration, and the committed
coverage table. Runs on the default device (CPU in CI; the GPU host too)."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from registry.integrations.coverage import ARCHS, render
from registry.integrations.mlx_lm import (attention_dims, build_kernel_sets, build_model, find_attention_layers,
                                          trace_attention)
from registry.paths import PROJECT_ROOT

_BUILT: dict[str, nn.Module] = {}


def model_of(arch: str):
    if arch not in _BUILT:
        mx.random.seed(0)
        _BUILT[arch] = build_model(ARCHS[arch])
    return _BUILT[arch]


def kernels_of(arch: str):
    return build_kernel_sets(model_of(arch))


def test_gemma3_has_one_kernel_set_per_layer_kind():
    kernels = kernels_of("gemma3")
    assert [c.layers for c in kernels.configs] == [[0], [1]]
    sliding, full = kernels.configs
    assert (sliding.window, full.window) == (8, None)         # from the model's own RotatingKVCache
    assert sliding.kernel_set.context.rope.base == 10000.0 and sliding.kernel_set.context.rope.pos_scale == 1.0
    assert full.kernel_set.context.rope.base == 1e6 and full.kernel_set.context.rope.pos_scale == 0.125
    assert kernels.by_layer[0] is sliding.kernel_set and kernels.by_layer[1] is full.kernel_set


def test_olmo3_sliding_and_full_layers_get_their_own_rope():
    kernels = kernels_of("olmo3 (sliding)")
    sources = {tuple(c.layers): (c.window, c.kernel_set.context.rope.source) for c in kernels.configs}
    assert sources == {(0, 1, 2): (8, "RoPE"), (3,): (None, "YarnRoPE")}


def test_hybrid_models_skip_layers_without_kv_attention():
    kernels = kernels_of("qwen3_next (hybrid)")
    assert kernels.non_attention_layers == [0, 1, 2] and list(kernels.by_layer) == [3]
    assert kernels.non_attention_caches == {0: "ArraysCache", 1: "ArraysCache", 2: "ArraysCache"}
    lfm2 = kernels_of("lfm2 (hybrid conv)")
    assert lfm2.non_attention_layers == [0, 2] and sorted(lfm2.by_layer) == [1, 3]
    # falcon_h1: every layer runs an SSM and attention side by side; the KV cache sits inside a CacheList
    falcon = kernels_of("falcon_h1 (parallel SSM)")
    assert falcon.non_attention_layers == [] and sorted(falcon.by_layer) == [0, 1]


@pytest.mark.parametrize("arch", [a for a in ARCHS if "MLA" not in a])
def test_static_dims_agree_with_the_traced_tensors(arch):
    """attention_dims reads attributes (several modules have no head_dim, some no kv heads); the trace
    reads the q/k/v arrays the module produces. They must agree wherever q is observable."""
    model = model_of(arch)
    attn_layers = find_attention_layers(model)[0]
    traces = trace_attention(model, attn_layers)
    for i, attn in attn_layers.items():
        t = traces[i]
        static = attention_dims(attn)
        assert static[1:] == (t.n_kv_heads, t.head_dim), (arch, i, static, t)
        if t.n_heads is not None:
            assert static[0] == t.n_heads, (arch, i, static, t)


def test_modules_without_head_dim_attribute():
    for arch, expected in [("qwen2", (4, 2, 16)), ("starcoder2", (4, 2, 16)), ("gpt_neox", (4, 4, 16)),
                           ("qwen3", (4, 2, 32)), ("qwen3_next (hybrid)", (4, 2, 16))]:
        attn_layers = find_attention_layers(model_of(arch))[0]
        attn = next(iter(attn_layers.values()))
        assert attention_dims(attn) == expected, arch
    # exaone's layer.attn is a wrapper; the attention proper is its `attention` child
    attn = find_attention_layers(model_of("exaone"))[0][0]
    assert type(attn).__name__ == "AttentionModule" and attention_dims(attn) == (4, 2, 16)


def test_nope_layers_are_found_by_tracing():
    # cohere2 keeps a rope on every layer but calls it only on sliding layers
    c2 = {tuple(c.layers): c.applies_rope for c in kernels_of("cohere2 (sliding, NoPE global)").configs}
    assert c2 == {(0, 2): True, (1, 3): False}
    # exaone4's global layer has no rope attribute at all; smollm3's NoPE layer has an identity rope module
    e4 = {tuple(c.layers): (c.applies_rope, c.kernel_set.rope is None) for c in
          kernels_of("exaone4 (sliding, NoPE global)").configs}
    assert e4 == {(0, 1, 2): (True, False), (3,): (None, True)}
    s3 = {tuple(c.layers): c.applies_rope for c in kernels_of("smollm3 (NoPE layers)").configs}
    assert s3 == {(0, 1, 2): True, (3,): False}


def test_trace_finds_attention_that_transforms_k_after_rope():
    for arch, layers in [("hunyuan_v1_dense (q/k norm after RoPE)", [0, 1]), ("gptj (rotated slice)", [0, 1])]:
        (config,) = kernels_of(arch).configs
        assert config.layers == layers
        assert config.kernel_set.rope is not None            # the registry sees a fusable rope module ...
        assert "not the rope's output" in config.dataflow_error  # ... the trace sees why it cannot be
        assert config.status.startswith("rope_pool_fused selected, but engines cannot fuse it here")


class _QScaledAfterRope(nn.Module):
    """llama's attention with one change: q is scaled after RoPE and before the cache write."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.rope = inner.rope
        self.n_heads, self.n_kv_heads, self.head_dim = inner.n_heads, inner.n_kv_heads, inner.head_dim

    def __call__(self, x, mask=None, cache=None):
        a = self.inner
        B, L, _ = x.shape
        q = a.q_proj(x).reshape(B, L, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(B, L, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        q = q * 1.5                                          # read before the cache write
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=a.scale, mask=mask)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def q_scaled_llama():
    mx.random.seed(0)
    model = build_model(ARCHS["llama"])
    for layer in model.layers:
        layer.self_attn = _QScaledAfterRope(layer.self_attn)
    return model


def test_trace_finds_attention_that_reads_q_between_rope_and_cache_write():
    """Only the NaN placeholders can see this one: the keys are untouched, q is read early."""
    (config,) = build_kernel_sets(q_scaled_llama()).configs
    assert config.kernel_set.rope is not None
    assert "reads q or k between its rope call and cache.update_and_fetch" in config.dataflow_error


def test_deepseek_v3_mla_is_rejected_with_reason():
    kernels = kernels_of("deepseek_v3 (MLA)")
    for c in kernels.configs:
        assert c.kernel_set.rope is None
        assert c.kernel_set.rejections["rope_pool_fused"].startswith("attention layout is mla")
        # what the cache really holds: one latent "head" of kv_lora_rank keys and the rope'd k_pe values
        assert (c.n_kv_heads, c.head_dim, c.v_head_dim) == (1, 32, 8)


def test_trace_false_reads_attributes_only():
    kernels = build_kernel_sets(model_of("qwen3"), trace=False)
    (config,) = kernels.configs
    assert not kernels.traced and config.applies_rope is None
    assert (config.n_heads, config.n_kv_heads, config.head_dim) == (4, 2, 32)


def test_build_model_errors_name_the_problem():
    with pytest.raises(ValueError, match="model_type 'no_such_arch'"):
        build_model({"model_type": "no_such_arch"})
    with pytest.raises(ValueError, match="'model_type' key"):
        build_model({"hidden_size": 64})


def _python(code: str) -> str:
    """Run `code` in a fresh interpreter (module import state matters here); its stripped stdout."""
    p = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_build_model_without_transformers():
    """mlx_lm/__init__ imports its tokenizer stack (transformers, huggingface_hub); without it the
    model modules still load through a bare package."""
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['huggingface_hub'] = None\n"
            "from registry.integrations.coverage import ARCHS\n"
            "from registry.integrations.mlx_lm import build_model\n"
            "m = build_model(ARCHS['qwen3'])\n"
            "import mlx_lm; assert not hasattr(mlx_lm, 'load'), 'expected the bare package'\n"
            "print(type(m).__module__)")
    assert _python(code) == "mlx_lm.models.qwen3"


def test_build_model_with_the_full_mlx_lm_package():
    """Where mlx-lm's tokenizer stack is installed (CI's test extra pulls it in), the real package is used."""
    probe = subprocess.run([sys.executable, "-c", "import mlx_lm"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"`import mlx_lm` fails here ({probe.stderr.strip().splitlines()[-1]}); "
                    f"the bare-package path is tested above")
    code = ("from registry.integrations.coverage import ARCHS\n"
            "from registry.integrations.mlx_lm import build_model\n"
            "m = build_model(ARCHS['llama'])\n"
            "import mlx_lm; assert hasattr(mlx_lm, 'load'), 'expected the full package'\n"
            "print(type(m).__module__)")
    assert _python(code) == "mlx_lm.models.llama"


def test_committed_coverage_table_is_current():
    committed = (PROJECT_ROOT / "docs" / "coverage.md").read_text()
    assert committed == render(), "regenerate: python -m registry.integrations.coverage > docs/coverage.md"


def test_coverage_table_covers_the_issue_list():
    text = (PROJECT_ROOT / "docs" / "coverage.md").read_text()
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    archs = {r[0][2:] for r in rows}
    for needed in ["llama", "llama (llama3)", "llama (yarn)", "llama (linear)", "llama (dynamic)", "mistral",
                   "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3 (longrope, partial)", "phi", "gpt_neox",
                   "stablelm", "glm4 (partial, traditional)", "olmo2", "starcoder2", "qwen3_next (hybrid)",
                   "deepseek_v3 (MLA)"]:
        assert needed in archs, needed
    mla = [r for r in rows if r[0] == "| deepseek_v3 (MLA)"]
    assert mla and all(r[5].startswith("rejected: attention layout is mla") for r in mla)
    assert all(r[6].startswith("module rope + pool scatter (MLA: ") for r in mla)
    assert not any("does not build" in r[5] for r in rows)
