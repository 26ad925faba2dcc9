"""Probe (not a test): bf16 logits of the slot engine in each mode against mlx-lm's own bf16 path and
a float32 run of the same weights, per request, for the architectures named (default: laguna, an
MoE whose bf16 forward only runs on a GPU). Tells a kernel error (fused far off, module close) from
one the engine's own path or the model's routing makes (every mode alike). For MoE models it then
runs each request alone through the engine and counts, per MoE layer, the tokens whose expert choice
differs from the float32 run's (engine and mlx-lm's own bf16 path), with the float32 score margin
between the last expert chosen and the first one not chosen at the first such token.

    PYTHONPATH=. python3 tests/gpu/diag_bf16.py [arch ...]     (DIAG_DTYPE=float32: a dry run on the CPU)
"""
import os
import sys

import mlx.core as mx
import numpy as np

from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_model, import_mlx_lm_module
from registry.integrations.slot_engine import SlotEngine
from tests.test_engine import NEW_TOKENS, PROMPTS, forced_logits, model_of

RECORD: list | None = None


def hook_gates(module_name: str) -> bool:
    """Record every MoE gate call's (gate object, chosen experts, selection scores) while RECORD is a list."""
    mod = import_mlx_lm_module(module_name.rsplit(".", 1)[-1])
    gate_cls = getattr(mod, "MoEGate", None)
    if gate_cls is None or getattr(gate_cls, "_probe", False):
        return gate_cls is not None
    original = gate_cls.__call__

    def call(self, x):
        inds, weights = original(self, x)
        if RECORD is not None:
            logits = self.proj(x).astype(mx.float32)
            RECORD.append((id(self), inds.reshape(-1, inds.shape[-1]),
                           (mx.sigmoid(logits) + self.e_score_correction_bias).reshape(-1, logits.shape[-1])))
        return inds, weights

    gate_cls.__call__, gate_cls._probe = call, True
    return True


def routing(run) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Calls of `run()` recorded per gate: (sorted expert ids [tokens, k], scores [tokens, E]), in call order."""
    global RECORD
    RECORD = []
    run()
    rec, RECORD = RECORD, None
    out: dict[int, list] = {}
    for gid, inds, scores in rec:
        out.setdefault(gid, []).append((np.sort(np.array(inds), axis=-1), np.array(scores.astype(mx.float32))))
    return {g: (np.concatenate([a for a, _ in v]), np.concatenate([b for _, b in v])) for g, v in out.items()}


for arch in sys.argv[1:] or ["laguna"]:
    model = model_of(arch, os.environ.get("DIAG_DTYPE", "bfloat16"))   # float32: a dry run on the CPU
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
    if not hook_gates(type(model).__module__):
        continue
    gates = {}
    for i, prompt in enumerate(PROMPTS):           # each request alone: its gate calls are its own tokens'
        alone, engine = {}, SlotEngine(model, record_logits=True)      # its trace forward is not recorded
        r_eng = routing(lambda: alone.update(engine.generate([prompt], NEW_TOKENS)))
        toks = alone["tokens"][0]
        eng_err = np.abs(alone["logits"][0] - forced_logits(truth_model, prompt, toks)).max()
        r_mlx = routing(lambda: forced_logits(model, prompt, toks))
        r_f32 = routing(lambda: forced_logits(truth_model, prompt, toks))
        print(f"{arch} fused alone request {i}: engine err vs float32 {eng_err:.4f}", flush=True)
        for label, r in (("engine alone", r_eng), ("mlx-lm bf16", r_mlx)):
            for n, (g, g32) in enumerate(zip(r.values(), r_f32.values())):
                (ids, _), (ids32, s32) = g, g32
                m = min(len(ids), len(ids32))
                diff = np.nonzero((ids[:m] != ids32[:m]).any(axis=-1))[0]
                note = ""
                if diff.size:
                    t = int(diff[0])
                    k = ids.shape[-1]
                    srt = np.sort(s32[t])[::-1]
                    note = (f"; first at token {t}: float32 margin {srt[k - 1] - srt[k]:.3g} "
                            f"(scores ~{srt[k - 1]:.3f}, bf16 ulp there {2.0 ** (np.floor(np.log2(srt[k - 1])) - 7):.3g})")
                print(f"  {label:12s} MoE layer {n}: {diff.size}/{m} tokens route differently from float32{note}",
                      flush=True)
