"""Probe (not a test): bf16 logits of the slot engine in each mode against mlx-lm's own bf16 path and
a float32 run of the same weights, per request, for the architectures named (default: laguna, an
MoE whose bf16 forward only runs on a GPU). Tells a kernel error (fused far off, module close) from
one the engine's own path or the model's routing makes (every mode alike).

    PYTHONPATH=. python3 tests/gpu/diag_bf16.py [arch ...]
"""
import sys

import mlx.core as mx
import numpy as np

from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_model
from registry.integrations.slot_engine import SlotEngine
from tests.test_engine import NEW_TOKENS, PROMPTS, forced_logits, model_of

for arch in sys.argv[1:] or ["laguna"]:
    model = model_of(arch, "bfloat16")
    mx.random.seed(0)
    truth_model = build_model(ARCHS[arch], dtype=mx.bfloat16)
    truth_model.set_dtype(mx.float32)
    for mode in ("fused", "reference", "module"):
        out = SlotEngine(model, mode=mode, record_logits=True).generate(PROMPTS, NEW_TOKENS)
        for i, prompt in enumerate(PROMPTS):
            toks = out["tokens"][i]
            mlx_lm, truth = forced_logits(model, prompt, toks), forced_logits(truth_model, prompt, toks)
            eng = out["logits"][i]
            per_step = np.abs(eng - truth).max(axis=-1)
            print(f"{arch} {mode:9s} request {i}: |engine - mlx-lm| {np.abs(eng - mlx_lm).max():.4f}, "
                  f"errors vs float32: engine {per_step.max():.4f} (worst step {int(per_step.argmax())}), "
                  f"mlx-lm {np.abs(mlx_lm - truth).max():.4f}; scale {np.abs(mlx_lm).max():.3f}", flush=True)
