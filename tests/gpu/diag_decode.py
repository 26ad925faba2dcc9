"""Probe (not a test): where a real decode step's time goes, per slot-engine mode, on the current
device. A 1B-like llama (mlx-lm's own class, random bf16 weights), greedy decode at batch 1 and 8:
tokens/s, the launcher's counters (copies must be 0) and the split between building a step's graph
(Python) and evaluating it. Run it twice, with MLX_USE_CUDA_GRAPHS=1 and =0 (docs/benchmarks/).

    PYTHONPATH=. python3 tests/gpu/diag_decode.py [--layers 16] [--steps 32] [--json out.json]
"""
import argparse
import json
import os
import time

import mlx.core as mx

from registry import native
from registry.integrations.mlx_lm import build_kernel_sets, build_model, make_own_cache
from registry.integrations.slot_engine import SlotEngine

p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=16)
p.add_argument("--steps", type=int, default=32)
p.add_argument("--json")
args = p.parse_args()
cfg = dict(model_type="llama", hidden_size=2048, num_hidden_layers=args.layers, intermediate_size=8192,
           num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, vocab_size=128256,
           rope_theta=500000.0, tie_word_embeddings=True)
mx.random.seed(0)
model = build_model(cfg, dtype=mx.bfloat16)
kernels = build_kernel_sets(model)
rows = []


def mlx_lm_loop(batch: int, steps: int) -> float:
    """mlx-lm's generate_step pattern: async_eval the next token, read the previous one."""
    cache = make_own_cache(model)
    y = mx.argmax(model(mx.array([[1] * 128] * batch), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    t0 = time.perf_counter()
    for i in range(steps):
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
    y.tolist()
    return batch * steps / (time.perf_counter() - t0)


for batch in (1, 8):
    for mode in ("module", "fused", "reference", "mlx_lm"):
        for rnd in range(2):
            native.reset_stats()
            if mode == "mlx_lm":
                tps = mlx_lm_loop(batch, args.steps)
                rows.append(dict(mode=mode, batch=batch, round=rnd, tps=tps))
                continue
            engine = SlotEngine(model, kernels=kernels, mode=mode, pool_size=batch * (128 + args.steps + 8))
            out = engine.generate([[1] * 128] * batch, args.steps + 1)
            st = native.stats()
            rows.append(dict(mode=mode, batch=batch, round=rnd, tps=out["decode_tokens_per_s"],
                             copies=st["copies"], aliased=st["aliased"], syncs=st["syncs"]))
        print(rows[-1], flush=True)

# Build vs evaluate, per mode: one decode step's graph built in Python, then evaluated alone.
split = {}
for mode in ("module", "fused"):
    engine = SlotEngine(model, kernels=kernels, mode=mode, pool_size=4096)
    rid = engine.add_request([1] * 128, 64)
    engine.step()
    builds, evals = [], []
    for _ in range(24):
        r = engine.requests[rid]
        t0 = time.perf_counter()
        logits = engine._forward([r], [[r.generated[-1]]])
        nxt = mx.argmax(logits, axis=-1)
        t1 = time.perf_counter()
        mx.eval(nxt)
        t2 = time.perf_counter()
        r.generated.append(int(nxt.item()))
        builds.append(t1 - t0)
        evals.append(t2 - t1)
    split[mode] = dict(build_ms=1e3 * sorted(builds)[12], eval_ms=1e3 * sorted(evals)[12])
    print(mode, "b1 step:", split[mode], flush=True)
res = dict(graphs=os.environ.get("MLX_USE_CUDA_GRAPHS", "default"), device=str(mx.default_device()),
           layers=args.layers, steps=args.steps, rows=rows, step_split=split)
if args.json:
    json.dump(res, open(args.json, "w"), indent=1)
