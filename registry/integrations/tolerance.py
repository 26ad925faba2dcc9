"""The documented agreement bound, in half precision, between the drop-in caches (and the slot
engine) and mlx-lm's own path, in one place: `generate --check`, docs/engine.md ("Equivalence"), the
tests and `bench --e2e` read it. No imports, so the benchmarks CLI reads it without mlx-lm."""

# In bfloat16 and float16, teacher-forced on the same tokens: max |ours - mlx-lm| <= HALF_LOGIT_TOL x
# max |logit| (per step in `generate --check`, over a run in the tests). The kernel rotates q and k in
# float32 and rounds once where mlx-lm's rope rounds differently. Measured on the CPU
# (benchmarks/bf16_gap.py, 216 runs, docs/benchmarks/bf16-gap-cpu.txt): at most 0.116 per step and
# 0.066 at a step where the greedy tokens differ, the size of mlx-lm's own bf16 error against float32.
HALF_LOGIT_TOL = 0.15
