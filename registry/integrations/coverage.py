"""Which mlx-lm 0.32.2 architectures get the fused kernel, per layer configuration.

    python -m registry.integrations.coverage > docs/coverage.md

Tiny configs with random weights (no downloads); tests/test_integration_mlx_lm.py checks that the
committed docs/coverage.md equals this command's output.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys

TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256, max_position_embeddings=4096)

ARCHS: dict[str, dict] = {
    "llama": dict(TINY, model_type="llama", rope_theta=10000.0),
    "llama (llama3)": dict(TINY, model_type="llama", rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama (yarn)": dict(TINY, model_type="llama", rope_theta=10000.0,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}),
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
                              rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def coverage_rows() -> list[tuple[str, str, str, str, str, str]]:
    """(architecture, layers, attention class, heads/kv/head_dim, rope, selection) per layer config."""
    import mlx.core as mx

    from .mlx_lm import build_kernel_sets, build_model

    rows = []
    for name, cfg in ARCHS.items():
        try:
            mx.random.seed(0)
            model = build_model(cfg)
            kernels = build_kernel_sets(model, dtype=mx.bfloat16)
        except Exception as e:  # an architecture that does not build is reported, not hidden
            rows.append((name, "-", "-", "-", "-", f"does not build: {type(e).__name__}: {e}"))
            continue
        for c in kernels.configs:
            ks = c.kernel_set
            selection = ("selected" if ks.rope is not None
                         else f"rejected: {ks.rejections.get('rope_pool_fused', 'not selected')}")
            from .mlx_lm import _ranges
            rows.append((name, _ranges(c.layers), c.attention_class, f"{c.n_heads}/{c.n_kv_heads}/{c.head_dim}",
                         c.rope_desc.replace("|", "/"), selection.replace("|", "/")))
        if kernels.non_attention_layers:
            from .mlx_lm import _ranges
            rows.append((name, _ranges(kernels.non_attention_layers), "(no attention)", "-", "-",
                         "not applicable (linear attention / recurrent state)"))
    return rows


def render() -> str:
    lines = ["# Kernel coverage over mlx-lm 0.32.2 architectures", "",
             "Generated by `python -m registry.integrations.coverage > docs/coverage.md` (tiny configs, random",
             "weights, bf16, default env; backend-independent except where a row says otherwise).",
             "One row per distinct attention configuration of a model.", "",
             "| architecture | layers | attention | heads/kv/head_dim | RoPE (normalised) | rope_pool_fused |",
             "|---|---|---|---|---|---|"]
    for row in coverage_rows():
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    logging.getLogger("registry").setLevel(logging.WARNING)
    with contextlib.redirect_stderr(io.StringIO()):
        text = render()
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
