"""Probe (not a test): the float32 noise floor of mlx-lm against itself on this device, per
architecture of the coverage table: forced-decode logits of one prompt at batch 1 against the same
prompt in a batch of 3 (other GEMM shapes), next to the engine's difference from mlx-lm and mlx-lm's
top-2 margins. tests/_noise.py derives the engine tolerance from this floor.

    PYTHONPATH=. python3 tests/gpu/diag_noise.py [--json out.json]
"""
import json
import sys

import mlx.core as mx
import numpy as np

from registry.integrations.coverage import ARCHS
from registry.integrations.slot_engine import SlotEngine
from tests._noise import noise_floor
from tests.test_engine import NEW_TOKENS, PROMPTS, forced_logits, mlx_lm_greedy, model_of

out = {}
for arch in ARCHS:
    try:
        model = model_of(arch)
        eng = SlotEngine(model, record_logits=True).generate(PROMPTS, NEW_TOKENS)
    except Exception as e:  # noqa: BLE001 - a probe reports and goes on
        out[arch] = dict(error=str(e)[:200])
        continue
    rows = []
    for i, prompt in enumerate(PROMPTS):
        toks = mlx_lm_greedy(model, prompt, NEW_TOKENS)
        want = forced_logits(model, prompt, toks)
        top2 = np.sort(want, axis=-1)[:, -2:]
        diff = float(np.abs(eng["logits"][i] - want).max()) if eng["tokens"][i] == toks else None
        rows.append(dict(floor=noise_floor(model, prompt, toks), engine_diff=diff,
                         tokens_equal=eng["tokens"][i] == toks, min_margin=float((top2[:, 1] - top2[:, 0]).min()),
                         first_diff=next((j for j, (a, b) in enumerate(zip(eng["tokens"][i], toks)) if a != b), None),
                         margins=[float(m) for m in top2[:, 1] - top2[:, 0]]))
    out[arch] = rows
    print(arch, [(round(r["floor"], 6), r["engine_diff"] and round(r["engine_diff"], 6), r["first_diff"]) for r in rows],
          flush=True)
json.dump(out, open(sys.argv[sys.argv.index("--json") + 1], "w") if "--json" in sys.argv else sys.stdout, indent=1)
