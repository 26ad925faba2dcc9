"""Which mlx-lm 0.32.2 architectures get the fused kernel, per layer configuration, and how the slot
engine runs each one.

    python -m registry.integrations.coverage > docs/coverage.md

Tiny configs with random weights (no downloads), evaluated on the CPU so that the table does not
depend on the machine; tests/test_integration_mlx_lm.py checks that the committed docs/coverage.md
equals this command's output.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys

TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, max_position_embeddings=4096)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
         "beta_slow": 1}

# Architectures the issue names first, then every other one that builds from a small config.
ARCHS: dict[str, dict] = {
    "llama": dict(TINY, model_type="llama", rope_theta=10000.0),
    "llama (llama3)": dict(TINY, model_type="llama", rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama (yarn)": dict(TINY, model_type="llama", rope_theta=10000.0,
                         rope_scaling=dict(_YARN, mscale=1.0, mscale_all_dim=0.0)),
    "llama (linear)": dict(TINY, model_type="llama", rope_theta=10000.0,
                           rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama (dynamic)": dict(TINY, model_type="llama", rope_theta=10000.0,
                            rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "mistral": dict(TINY, model_type="mistral", rope_theta=1e6),
    "qwen2": dict(TINY, model_type="qwen2", rope_theta=1e6, tie_word_embeddings=True),
    "qwen3": dict(TINY, model_type="qwen3", head_dim=32, rope_theta=1e6, tie_word_embeddings=True),
    "gemma": dict(TINY, model_type="gemma", head_dim=16),
    "gemma2": dict(TINY, model_type="gemma2", head_dim=16, query_pre_attn_scalar=16.0),
    "gemma3": dict(model_type="gemma3", vocab_size=256,
                   text_config=dict(TINY, model_type="gemma3_text", head_dim=32, sliding_window=8,
                                    sliding_window_pattern=2, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "phi3 (longrope, partial)": dict(TINY, model_type="phi3", partial_rotary_factor=0.75,
                                     max_position_embeddings=131072, original_max_position_embeddings=4096,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0] * 6,
                                                   "long_factor": [1.5] * 6}),
    "phi": dict(TINY, model_type="phi", layer_norm_eps=1e-5, partial_rotary_factor=0.5),
    "gpt_neox": dict(TINY, model_type="gpt_neox", layer_norm_eps=1e-5, rotary_emb_base=10000, rotary_pct=0.25,
                     use_parallel_residual=True),
    "stablelm": dict(TINY, model_type="stablelm", layer_norm_eps=1e-5, use_qkv_bias=False,
                     partial_rotary_factor=0.25, rope_theta=10000.0),
    "glm4 (partial, traditional)": dict(TINY, model_type="glm4", head_dim=16, attention_bias=True,
                                        partial_rotary_factor=0.5, rope_theta=10000.0),
    "olmo2": dict(TINY, model_type="olmo2", rope_theta=10000.0),
    "starcoder2": dict(TINY, model_type="starcoder2", norm_epsilon=1e-5, rope_theta=10000.0),
    "qwen3_next (hybrid)": dict(TINY, model_type="qwen3_next", num_hidden_layers=4, head_dim=16,
                                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
                                mlp_only_layers=[], moe_intermediate_size=32, partial_rotary_factor=0.25,
                                full_attention_interval=4, rope_theta=10000.0),
    "deepseek_v3 (MLA)": dict(TINY, model_type="deepseek_v3", kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
                              num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                              rope_scaling=dict(_YARN, type="yarn", mscale=1.0, mscale_all_dim=1.0)),
    # --- others that build cleanly
    "cohere": dict(TINY, model_type="cohere", head_dim=16, layer_norm_eps=1e-5),
    "cohere2 (sliding, NoPE global)": dict(TINY, model_type="cohere2", num_hidden_layers=4, head_dim=16,
                                           sliding_window=8, sliding_window_pattern=2, layer_norm_eps=1e-5),
    "exaone4 (sliding, NoPE global)": dict(TINY, model_type="exaone4", num_hidden_layers=4, head_dim=16,
                                           rope_theta=10000.0, tie_word_embeddings=False, rope_scaling=None,
                                           sliding_window=8, sliding_window_pattern="LLLG"),
    "smollm3 (NoPE layers)": dict(TINY, model_type="smollm3", num_hidden_layers=4, rope_theta=10000.0),
    "olmo3 (sliding)": dict(TINY, model_type="olmo3", num_hidden_layers=4, sliding_window=8, rope_theta=10000.0,
                            rope_scaling=dict(_YARN, attention_factor=1.0)),
    "gpt_oss (sinks, sliding)": dict(TINY, model_type="gpt_oss", head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=8, rope_theta=10000,
                                     rope_scaling=_YARN),
    "ministral3 (position-scaled q)": dict(TINY, model_type="ministral3", head_dim=16, tie_word_embeddings=False,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "llama_4_scaling_beta": 0.5,
                                                            "original_max_position_embeddings": 4}),
    "mixtral (MoE)": dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6),
    "qwen2_moe": dict(TINY, **_MOE, model_type="qwen2_moe", shared_expert_intermediate_size=32, rope_theta=1e6),
    "qwen3_moe": dict(TINY, **_MOE, model_type="qwen3_moe", head_dim=16, decoder_sparse_step=1, mlp_only_layers=[],
                      rope_theta=1e6, tie_word_embeddings=False, norm_topk_prob=True),
    "olmoe": dict(TINY, **_MOE, model_type="olmoe", rope_theta=10000.0),
    "phimoe": dict(TINY, model_type="phimoe", num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0),
    "internlm2": dict(TINY, model_type="internlm2", rope_theta=10000.0),
    "internlm3": dict(TINY, model_type="internlm3", head_dim=16, rope_theta=10000.0),
    "granite": dict(TINY, model_type="granite", logits_scaling=2.0, attention_multiplier=0.25,
                    embedding_multiplier=2.0, residual_multiplier=0.5, attention_bias=False, mlp_bias=False,
                    rope_theta=10000.0),
    "minicpm": dict(TINY, model_type="minicpm", dim_model_base=32, scale_depth=1.4, scale_emb=2.0,
                    rope_theta=10000.0),
    "exaone": dict(TINY, model_type="exaone", num_layers=2, layer_norm_epsilon=1e-5, rope_theta=10000.0),
    "apertus": dict(TINY, model_type="apertus", mlp_bias=False, attention_bias=False, rope_theta=10000.0,
                    post_norm=False, qk_norm=True, tie_word_embeddings=False),
    "helium": dict(TINY, model_type="helium", head_dim=16, attention_bias=False, mlp_bias=False,
                   rope_theta=10000.0, tie_word_embeddings=False),
    "ernie4_5": dict(TINY, model_type="ernie4_5", head_dim=16, rope_theta=10000.0, use_bias=False,
                     tie_word_embeddings=False),
    "glm": dict(TINY, model_type="glm", head_dim=16),
    "mimo": dict(TINY, model_type="mimo", rope_theta=10000.0),
    "seed_oss": dict(TINY, model_type="seed_oss", head_dim=16, rope_theta=10000.0),
    "nemotron (partial)": dict(TINY, model_type="nemotron", hidden_act="relu2", norm_eps=1e-5,
                               partial_rotary_factor=0.5, rope_theta=10000.0),
    "telechat3": dict(TINY, model_type="telechat3", rope_theta=10000.0),
    "hunyuan_v1_dense (q/k norm after RoPE)": dict(TINY, model_type="hunyuan_v1_dense", use_qk_norm=True,
                                                    rope_theta=10000.0),
    # --- per-head q/k norm -> RoPE -> cache: qk_norm_rope_pool_fused (qwen3, qwen3_moe, gemma3, exaone4,
    # apertus, lfm2 and qwen3_next above too); across heads or not an RMSNorm: rope_pool_fused only
    "glm4_moe (q/k norm, partial)": dict(TINY, model_type="glm4_moe", head_dim=16, moe_intermediate_size=32,
                                         norm_topk_prob=True, n_group=1, topk_group=1, n_shared_experts=1,
                                         n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
                                         first_k_dense_replace=1, rope_theta=10000.0, rope_scaling=None,
                                         use_qk_norm=True, tie_word_embeddings=False, attention_bias=False,
                                         partial_rotary_factor=0.5),
    "dots1": dict(TINY, model_type="dots1", head_dim=16, first_k_dense_replace=1, moe_intermediate_size=32,
                  n_routed_experts=4, n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=2,
                  rope_theta=10000.0, routed_scaling_factor=1.0),
    "plamo3 (1 + w q/k norm)": dict(model_type="plamo3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                                    rms_norm_eps=1e-5),
    "step3p5 (zero-centred q/k norm)": dict(model_type="step3p5", hidden_size=64, num_hidden_layers=2, vocab_size=256,
                                            num_attention_heads=4, num_attention_groups=2, head_dim=16,
                                            intermediate_size=128),
    "bailing_moe (q/k norm)": dict(TINY, **_MOE, model_type="bailing_moe", num_shared_experts=1, norm_topk_prob=True,
                                   rope_theta=10000.0, first_k_dense_replace=1, use_qk_norm=True),
    "Klear": dict(TINY, model_type="Klear", attention_bias=False, mlp_only_layers=[], num_experts=4,
                  num_experts_per_tok=2, decoder_sparse_step=1, n_shared_experts=1, moe_intermediate_size=32,
                  rope_theta=10000.0, norm_topk_prob=True),
    "openelm (q/k norm)": dict(model_type="openelm", head_dim=16, num_transformer_layers=2, model_dim=64,
                               vocab_size=256, ffn_dim_divisor=16, num_query_heads=[4, 4], num_kv_heads=[2, 2],
                               ffn_multipliers=[1.0, 1.0], normalize_qk_projections=True),
    "afmoe (q/k norm, NoPE global)": dict(TINY, model_type="afmoe", layer_types=["sliding_attention", "full_attention"]),
    "laguna": dict(TINY, model_type="laguna"),
    "minimax (q/k norm across heads)": dict(TINY, model_type="minimax", num_experts_per_tok=2, num_local_experts=4,
                                            shared_intermediate_size=32, rope_theta=10000.0, rotary_dim=16,
                                            use_qk_norm=True),
    "cohere (q/k LayerNorm)": dict(TINY, model_type="cohere", head_dim=16, layer_norm_eps=1e-5, use_qk_norm=True),
    "stablelm (q/k LayerNorm)": dict(TINY, model_type="stablelm", layer_norm_eps=1e-5, use_qkv_bias=False,
                                     partial_rotary_factor=0.25, rope_theta=10000.0, qk_layernorm=True),
    "gptj (rotated slice)": dict(model_type="gptj", n_embd=64, n_head=4, n_layer=2, n_positions=4096,
                                 rotary_dim=8, vocab_size=256, layer_norm_epsilon=1e-5),
    "nanochat (function RoPE)": dict(TINY, model_type="nanochat", num_key_value_heads=4),
    "lfm2 (hybrid conv)": dict(TINY, model_type="lfm2", num_hidden_layers=4, norm_eps=1e-5, conv_bias=False,
                               conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                               block_auto_adjust_ff_dim=False, rope_theta=10000.0,
                               layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "falcon_h1 (parallel SSM)": dict(TINY, model_type="falcon_h1", head_dim=16, mamba_d_conv=4, mamba_d_head=16,
                                     mamba_d_ssm=64, mamba_d_state=16, mamba_n_heads=4, mamba_chunk_size=8,
                                     rope_theta=10000.0),
}


def arch_vocab(cfg: dict) -> int:
    return cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]


def _engine_column(plan, batch_reason: str) -> str:
    text = f"fused: {plan.what}" if plan.path == "fused" else f"{plan.what} ({plan.reason})"
    return text + (f"; decode one request at a time ({batch_reason})" if batch_reason else "")


def coverage_rows() -> list[tuple[str, ...]]:
    """(architecture, layers, attention, heads/kv/head_dim, rope, kernel, slot engine) per layer config."""
    import mlx.core as mx

    from .mlx_lm import build_kernel_sets, build_model, ranges
    from .slot_engine import SlotEngine, UnsupportedModelError

    rows = []
    for name, cfg in ARCHS.items():
        try:
            mx.random.seed(0)
            model = build_model(cfg)
            kernels = build_kernel_sets(model, dtype=mx.bfloat16)
        except Exception as e:  # an architecture that does not build is reported, not hidden
            rows.append((name, "-", "-", "-", "-", f"does not build: {type(e).__name__}: {e}", "-"))
            continue
        try:
            engine = SlotEngine(model, kernels=kernels)
            unsupported = None
        except UnsupportedModelError as e:
            engine, unsupported = None, str(e)
        for c in kernels.configs:
            dims = f"{c.n_heads}/{c.n_kv_heads}/{c.head_dim}" + (f" (v {c.v_head_dim})" if c.v_head_dim != c.head_dim
                                                                   else "")
            registry = c.status
            if engine is None:
                eng = "not supported: " + unsupported.split(": ", 1)[1]
            else:
                eng = _engine_column(engine.plans[c.layers[0]], engine.batch_reason)
            rows.append((name, ranges(c.layers), c.label, dims, c.rope_desc, registry, eng))
        if kernels.non_attention_layers:
            kinds = ", ".join(sorted(set(kernels.non_attention_caches.values())))
            rows.append((name, ranges(kernels.non_attention_layers), f"(no KV attention: {kinds})", "-", "-",
                         "not applicable", "the model's own per-request state"))
    return [tuple(cell.replace("|", "/") for cell in row) for row in rows]


HEADER = """# Kernel coverage over mlx-lm 0.32.2 architectures

Generated by `python -m registry.integrations.coverage > docs/coverage.md`; do not edit by hand
(tests/test_integration_mlx_lm.py fails when this file differs from the command's output).

Tiny configs (hidden 64, 2-4 layers, vocab 256), random weights, bf16, default environment, selection
evaluated for the CPU backend (CUDA selects the same; on Metal the manifest's `prefer` rejects the
kernel until a benchmark shows a win). One row per distinct attention configuration of a model:
same attention class, heads, head_dim, RoPE, sliding window, and traced behaviour. The attention
columns come from tracing one short forward (registry/integrations/mlx_lm.py): heads and head_dim
are read off the q/k/v arrays, NoPE layers are those that never call their rope, and layers whose
attention reads q or k between RoPE and the cache write cannot be fused by an engine that drives
the model's own attention code.

- **kernel**: which kernel the registry selects (kernels.yaml) for the layer's RoPE and cache write:
  `qk_norm_rope_pool_fused` where the attention runs a per-head q/k RMSNorm right before its RoPE
  (checked by the trace), else `rope_pool_fused`, else why not; `kv_pool_store` for the cache write
  of layers that apply no RoPE or rotate with their own code.
- **slot engine**: what `registry.integrations.slot_engine.SlotEngine` runs for those layers
  (docs/engine.md): `fused: <kernel>` (one call: q/k norm and/or RoPE + both pool writes),
  `rope_pool_fused_reference` (pure MLX), or the module's own rope (if any) and `kv_pool_store` or a
  plain pool scatter for the cache write.

Left out of `qk_norm_rope_pool_fused` (they get `rope_pool_fused` after the model's own norm, or the
module path), with the reason the table gives:
- q/k normalised **across heads** (one RMSNorm over `n_heads * head_dim` before the head split):
  olmo2, olmoe, olmo3, olmo_hybrid, minimax. The kernel normalises one head row; a norm across heads
  needs a reduction over a token's heads, another kernel.
- q/k normalised **after RoPE**: hunyuan_v1_dense and hunyuan (norm after the rope), afm7
  (`q_norm(rope(q))`). The engine cannot rotate at the cache write at all there (the trace sees q/k
  read between RoPE and the cache write), so even rope_pool_fused does not run; the module's rope and
  `kv_pool_store` do.
- **LayerNorm**, not RMSNorm (mean subtraction, a bias or a [heads, head_dim] weight): cohere
  (`LayerNorm2D`), stablelm (`LayerNormPerHead`).
- Not in the table (no small config here yet): gemma3n and gemma4_text (per-head norm -> RoPE, but
  layers that share another layer's KV skip the k norm), bailing_hybrid, exaone_moe, gear, mellum,
  lfm2_moe, hunyuan, afm7.

| architecture | layers | attention | heads/kv/head_dim | RoPE (normalised) | kernel | slot engine |
|---|---|---|---|---|---|---|
"""


def render() -> str:
    import mlx.core as mx

    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        rows = coverage_rows()
    finally:
        mx.set_default_device(previous)
    return HEADER + "".join("| " + " | ".join(row) + " |\n" for row in rows)


def main() -> int:
    logging.getLogger("registry").setLevel(logging.WARNING)
    with contextlib.redirect_stderr(io.StringIO()):
        text = render()
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
