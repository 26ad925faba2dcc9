"""The slot-pool engine on real mlx-lm 0.32.2 models: greedy-decode equivalence of (a) the engine on
the fused kernel, (b) the engine on the reference path and (c) mlx-lm's own model call with its
caches, for every architecture of the coverage table that the engine runs; the bf16 tolerance; and
the engine's own behaviour (slots, batching, continuous admission, errors, the command).
Runs on the default device (CPU in CI; the GPU host too)."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from registry import native
from registry.core import backend_of
from registry.integrations.coverage import ARCHS
from registry.integrations.engine import mlx_lm_greedy
from registry.integrations.mlx_lm import build_kernel_sets, build_model, import_mlx_lm_module, make_own_cache
from registry.integrations.tolerance import HALF_LOGIT_TOL
from registry.integrations.slot_engine import EngineError, SlotEngine, UnsupportedModelError
from registry.paths import PROJECT_ROOT
from tests._noise import NOISE_FACTOR, assert_tokens_match, compared_steps, logits_atol, noise_floor

PROMPTS = [[3, 17, 42, 99, 7], [11, 5], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]]   # different lengths
NEW_TOKENS = 16
ENGINE_ARCHS = list(ARCHS)                 # the engine runs every architecture of the coverage table

_MODELS: dict[tuple[str, str], object] = {}


def model_of(arch: str, dtype: str = "float32"):
    if (arch, dtype) not in _MODELS:
        mx.random.seed(0)
        _MODELS[(arch, dtype)] = build_model(ARCHS[arch], dtype=getattr(mx, dtype))
    return _MODELS[(arch, dtype)]


def forced_logits(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """mlx-lm's own model call + caches, fed `tokens` (teacher forcing): float32 logits [len(tokens), V]."""
    cache = make_own_cache(model)
    rows = [model(mx.array([prompt], dtype=mx.int32), cache=cache)[0, -1]]
    for t in tokens[:-1]:
        rows.append(model(mx.array([[t]], dtype=mx.int32), cache=cache)[0, -1])
    return np.array(mx.stack(rows).astype(mx.float32))


# ----------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_float32_greedy_tokens_identical(native_artifacts, arch):
    """(a) fused, (b) reference, (c) mlx-lm: identical tokens for 3 prompts x 16 tokens, batched decode."""
    model = model_of(arch)
    kernels = build_kernel_sets(model)
    fused_engine = SlotEngine(model, kernels=kernels, mode="fused", record_logits=True)
    ref_engine = SlotEngine(model, kernels=kernels, mode="reference", record_logits=True)
    fused = fused_engine.generate(PROMPTS, NEW_TOKENS)
    reference = ref_engine.generate(PROMPTS, NEW_TOKENS)
    assert not fused_engine.batch_reason, f"{arch}: decode should be batched: {fused_engine.batch_reason}"
    assert fused["decode_steps"] == NEW_TOKENS - 1 and fused["decode_tokens"] == len(PROMPTS) * (NEW_TOKENS - 1)
    for i, prompt in enumerate(PROMPTS):
        toks = mlx_lm_greedy(model, prompt, NEW_TOKENS)
        want = forced_logits(model, prompt, toks)
        floor = noise_floor(model, prompt, toks, want)          # mlx-lm against itself (tests/_noise.py)
        atol, n = logits_atol(floor), compared_steps(want, floor)
        m = min(n + 1, NEW_TOKENS)     # the step after the last compared token still shares its history
        for name, run in (("fused", fused), ("reference", reference)):
            assert run["tokens"][i][:n] == toks[:n], f"{arch}: request {i}: {name} engine vs mlx-lm"
            np.testing.assert_allclose(run["logits"][i][:m], want[:m], atol=atol, rtol=1e-3,
                                       err_msg=f"{arch} {name} (noise floor {floor:.3g})")
        # Fused against reference: the same GEMMs, only the kernel differs. Its own tolerance holds at the
        # kernel (the parity matrices of tests/test_native_*.py, on this device); through the model, the
        # kernel's last-bit differences grow like any other rounding: CPU_ATOL on the CPU, the
        # noise-derived bound where float32 matmuls run in TF32 (measured on the H200: up to 4.7e-4).
        if fused["tokens"][i][:m] == reference["tokens"][i][:m]:
            np.testing.assert_allclose(fused["logits"][i][:m], reference["logits"][i][:m], atol=atol,
                                       rtol=1e-3, err_msg=f"{arch}: fused vs reference")
    # Where the plan says fused, every layer call went through the kernel set's rope.
    fused_layers = [p for p in fused_engine.plans.values() if p.path == "fused"]
    assert fused_engine.calls["fused"] == len(fused_layers) * (len(PROMPTS) + NEW_TOKENS - 1)
    assert ref_engine.calls["fused"] == 0


# bf16: the kernel rotates q/k in fp32 and rounds once; mx.fast.rope on bf16 input rounds its output
# differently (YarnRoPE / SuScaledRoPE also round their mscale product in bf16 first). That is up to
# one bf16 ulp (2^-8 relative) per q/k element, which attention and the later layers amplify; greedy
# tokens can then flip on near-ties, so logits are compared with the same tokens fed to both sides
# (mlx-lm teacher-forced on the engine's tokens). Measured on CPU over the table: at most 0.026 of the
# largest logit, and each side's distance to a float32 run of the same bf16 weights is of the same size.
# The documented bound (registry/integrations/tolerance.py, docs/engine.md) is the drop-in cache's too.
BF16_REL_TOL = HALF_LOGIT_TOL


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_bfloat16_logits_within_tolerance(native_artifacts, arch):
    model = model_of(arch, "bfloat16")
    try:
        mx.eval(model(mx.array([[1, 2]], dtype=mx.int32), cache=make_own_cache(model)))
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"mlx-lm's own bf16 forward fails on {mx.default_device()}: {e}")
    out = SlotEngine(model, record_logits=True).generate(PROMPTS, NEW_TOKENS)
    mx.random.seed(0)
    truth_model = build_model(ARCHS[arch], dtype=mx.bfloat16)        # the same bf16 weights (same seed) ...
    truth_model.set_dtype(mx.float32)                                # ... computed in float32
    rows = []
    for i, prompt in enumerate(PROMPTS):
        toks = out["tokens"][i]
        mlx_lm = forced_logits(model, prompt, toks)
        truth = forced_logits(truth_model, prompt, toks)
        # mlx-lm's own bf16 noise: the same prompt as row 0 of a batch of 3 (tests/_noise.py). The engine
        # batches requests, and mlx-lm at another batch shape is as valid a bf16 answer as at batch 1.
        floor = NOISE_FACTOR * noise_floor(model, prompt, toks, mlx_lm)
        rows.append((np.abs(mlx_lm).max(), np.abs(out["logits"][i] - mlx_lm).max(),
                     np.abs(out["logits"][i] - truth).max(), np.abs(mlx_lm - truth).max(), floor))
    # mlx-lm's bf16 error is taken over the same requests, not per request: in MoE models one bf16
    # rounding flips an expert choice wherever the float32 scores of the last chosen and the first
    # unchosen expert are closer than a bf16 ulp, and which requests meet such a near-tie differs
    # between two valid bf16 computations. Measured on the H200 (laguna, tests/gpu/diag_bf16.py, each
    # request alone): request 0 flips one token's experts in the engine (float32 margin 1.2e-3, bf16 ulp
    # 3.9e-3) and none in mlx-lm, errors 0.113 and 0.020; request 2 flips in both (4 and 3 tokens,
    # margin 2.7e-5), errors 0.122 and 0.116.
    mlx_worst = max(r[3] for r in rows)
    for i, (scale, diff, eng_err, mlx_err, floor) in enumerate(rows):
        # Not less accurate than mlx-lm's own bf16 path, against float32 ...
        assert eng_err <= 2 * (mlx_worst + floor) + 1e-3 * scale, \
            f"{arch}: request {i}: engine err {eng_err:.4g} vs mlx-lm {mlx_err:.4g}, worst {mlx_worst:.4g} " \
            f"(bf16 noise floor x2 {floor:.4g})"
        # ... and close to mlx-lm, unless the engine is nearer float32 than mlx-lm's worst request (then
        # the difference is mlx-lm's own error).
        assert diff <= BF16_REL_TOL * scale + floor or eng_err <= mlx_worst, \
            f"{arch}: request {i}: |engine - mlx-lm| {diff:.4g} > {BF16_REL_TOL} x {scale:.4g} + {floor:.4g} (errors " \
            f"vs float32: engine {eng_err:.4g}, mlx-lm {mlx_err:.4g}, worst {mlx_worst:.4g})"


# ----------------------------------------------------------------------------- which path runs

def test_engine_uses_the_native_kernel_where_selected(native_artifacts):
    engine = SlotEngine(model_of("llama (llama3)"))
    for plan in engine.plans.values():
        assert plan.path == "fused" and plan.reason.startswith(f"native-{backend_of(None)}")
    shapes = []

    def spied(call):
        def spy(q, *a):
            shapes.append(q.shape)
            return call(q, *a)
        return spy

    for plan in engine.plans.values():
        plan.call = spied(plan.call)
    native.reset_stats()
    engine.generate(PROMPTS[:2], 3)
    launches = native.stats()["launches"]
    # 2 layers x (2 prefills + 2 batched decode steps), one fused call per layer each
    assert len(shapes) == 2 * (2 + 2)
    # q as the attention holds it, [B, H, L, D]: the kernel reads it in place (strided)
    assert shapes[0] == (1, 4, 5, 16) and shapes[2] == (1, 4, 2, 16) and shapes[-1] == (2, 4, 1, 16)
    # each one launch of the native kernel, plus decode_attention's where it is selected (CUDA):
    # one per direct layer of each batched decode step
    assert launches == len(shapes) + engine.calls["decode_attention"]
    if backend_of(None) == "cuda":
        assert engine.calls["decode_attention"] == 2 * 2


def test_rejected_rope_runs_the_module_rope():
    engine = SlotEngine(model_of("llama (dynamic)"))
    assert {p.path for p in engine.plans.values()} == {"module"}
    assert all("DynamicNTKScalingRoPE" in p.reason for p in engine.plans.values())


def test_kernel_not_selected_runs_the_reference_path(monkeypatch):
    monkeypatch.setenv("MLX_AOT_ROPE_POOL_FUSED", "0")
    monkeypatch.setenv("MLX_AOT_QK_NORM_ROPE_POOL_FUSED", "0")   # qwen3's q/k norm -> RoPE would take it
    engine = SlotEngine(model_of("qwen3"))
    assert {p.path for p in engine.plans.values()} == {"reference"}
    assert all("MLX_AOT_ROPE_POOL_FUSED=0" in p.reason for p in engine.plans.values())
    out = engine.generate(PROMPTS, 4)
    assert out["tokens"] == [mlx_lm_greedy(model_of("qwen3"), p, 4) for p in PROMPTS]


def test_layers_that_cannot_be_fused_run_their_own_rope():
    for arch in ["hunyuan_v1_dense (q/k norm after RoPE)", "gptj (rotated slice)", "nanochat (function RoPE)"]:
        engine = SlotEngine(model_of(arch))
        assert {p.path for p in engine.plans.values()} == {"module"}, arch
    engine = SlotEngine(model_of("cohere2 (sliding, NoPE global)"))
    assert {i: p.path for i, p in engine.plans.items()} == {0: "fused", 1: "module", 2: "fused", 3: "module"}


def test_runtime_check_refuses_a_fused_plan_the_trace_would_have_refused():
    """Force the fused path onto hunyuan (q/k normed after RoPE): the cache write sees keys that are
    not the rope's output and the engine stops instead of storing wrong keys."""
    model = model_of("hunyuan_v1_dense (q/k norm after RoPE)")
    kernels = build_kernel_sets(model)
    for c in kernels.configs:
        c.dataflow_error = ""
    engine = SlotEngine(model, kernels=kernels)
    assert engine.plans[0].path == "fused"
    free = engine.free_slots
    with pytest.raises(EngineError, match="not the rope's output"):
        engine.generate(PROMPTS[:1], 2)
    assert engine.free_slots == free                      # the failed forward gave its slots back


def test_mla_runs_on_latent_pools():
    """deepseek_v3: the kernel is rejected (no per-head K/V); the engine's pools hold the cached latent
    (keys [S, 1, kv_lora_rank], values [S, 1, qk_rope_head_dim]) and the module runs its own rope."""
    engine = SlotEngine(model_of("deepseek_v3 (MLA)"))
    assert {p.path for p in engine.plans.values()} == {"module"}
    assert all(p.reason.startswith("MLA: the pools hold the cached latent rows") for p in engine.plans.values())
    engine.generate(PROMPTS[:1], 2)
    assert engine.pools[0].k_pool.shape == (engine.pool_size, 1, 32)
    assert engine.pools[0].v_pool.shape == (engine.pool_size, 1, 8)


def test_cache_semantics_the_engine_cannot_emulate_are_refused():
    """A RotatingKVCache that keeps its first tokens (what mlx-lm builds for max_kv_size) is not a plain
    window: the engine says so instead of attending differently."""
    cache_mod = import_mlx_lm_module("cache")
    mx.random.seed(0)
    model = build_model(ARCHS["gemma3"])
    model.make_cache = lambda: [cache_mod.RotatingKVCache(max_size=8, keep=4), cache_mod.KVCache()]
    with pytest.raises(UnsupportedModelError, match=r"layers 0 \(Attention\): RotatingKVCache\(keep=4\) keeps its "
                                                    r"first 4 tokens \(attention sinks\): not supported"):
        SlotEngine(model)


def test_module_mode_needs_no_trace():
    model = model_of("gemma3")
    engine = SlotEngine(model, mode="module", kernels=build_kernel_sets(model, trace=False))
    for i, (p, toks) in enumerate(zip(PROMPTS, engine.generate(PROMPTS, 4)["tokens"])):
        assert_tokens_match(model, p, toks, f"request {i}")
    with pytest.raises(ValueError, match="need traced kernel sets"):
        SlotEngine(model, kernels=build_kernel_sets(model, trace=False))


# ----------------------------------------------------------------------------- the engine itself

def test_sliding_window_is_applied_past_the_window():
    """gemma3's sliding layer (window 8) with a 12-token prompt + 16 tokens: without the window mask
    the tokens differ from mlx-lm's RotatingKVCache run."""
    model = model_of("gemma3")
    want = [mlx_lm_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    for i, (p, toks) in enumerate(zip(PROMPTS, SlotEngine(model).generate(PROMPTS, NEW_TOKENS)["tokens"])):
        assert_tokens_match(model, p, toks, f"request {i}")
    engine = SlotEngine(model)
    for pool in engine.pools.values():                     # attend over everything instead
        pool.window = None
        pool.make_mask = lambda N, window_size=None, _mask=pool.make_mask, **kw: _mask(N, None, **kw)
    assert engine.generate(PROMPTS, NEW_TOKENS)["tokens"] != want


def test_continuous_batching_and_slot_reuse():
    model = model_of("qwen3_next (hybrid)")
    engine = SlotEngine(model, pool_size=64)
    a = engine.add_request(PROMPTS[0], 6)
    engine.step()                                          # prefill a
    engine.step()                                          # decode a
    b = engine.add_request(PROMPTS[2], 3)                  # joins while a is running
    for _ in range(6):
        engine.step()
    assert not engine.running and not engine.waiting
    assert engine.requests[a].generated == mlx_lm_greedy(model, PROMPTS[0], 6)
    assert engine.requests[b].generated == mlx_lm_greedy(model, PROMPTS[2], 3)
    assert engine.free_slots == 64                         # finished requests gave their slots back
    # the freed slots are reused and hold the new requests' keys
    out = engine.generate([PROMPTS[1]] * 3, 5)
    assert out["tokens"] == [mlx_lm_greedy(model, PROMPTS[1], 5)] * 3
    assert engine.free_slots == 64


def test_admission_waits_for_slots():
    """Pool of 20 slots: a 12-token prompt + 4 tokens takes 15, a 10-token one 13; the second waits
    until the first finishes and frees its slots, then runs on them."""
    model = model_of("llama")
    engine = SlotEngine(model, pool_size=20)
    a = engine.add_request(list(range(12)), 4)
    b = engine.add_request(list(range(10)), 4)
    engine.step()
    assert engine.running == [a] and engine.waiting == [b] and engine.free_slots == 8
    steps = 1
    while engine.waiting or engine.running:
        engine.step()
        steps += 1
    assert steps == 4 + 4                                  # a: prefill + 3 decodes; b after it
    assert engine.requests[a].generated == mlx_lm_greedy(model, list(range(12)), 4)
    assert engine.requests[b].generated == mlx_lm_greedy(model, list(range(10)), 4)
    assert engine.free_slots == 20


def test_bad_requests_are_clear_errors():
    model = model_of("llama")
    engine = SlotEngine(model, pool_size=20)
    with pytest.raises(EngineError, match="needs 30 slots, the pool has 20"):
        engine.add_request(list(range(15)), 16)
    with pytest.raises(EngineError, match=r"token ids \[256\] out of range \[0, 256\)"):
        engine.add_request([1, 256], 2)
    with pytest.raises(EngineError, match="non-empty list"):
        engine.add_request([], 2)
    with pytest.raises(EngineError, match="max_new_tokens must be a positive int"):
        engine.add_request([1], 0)
    with pytest.raises(EngineError, match="no request 7"):
        engine.release(7)
    with pytest.raises(ValueError, match="mode must be one of"):
        SlotEngine(model, mode="fast")
    with pytest.raises(ValueError, match="pool_size must be a positive int"):
        SlotEngine(model, pool_size=0)


def test_explain_names_each_layer_path():
    text = SlotEngine(model_of("cohere2 (sliding, NoPE global)")).explain()
    assert "decode batched" in text
    assert "layers 0,2 (Attention, window 8): fused: rope_pool_fused" in text
    assert "layers 1,3 (Attention): module: kv_pool_store [the layer applies no RoPE]" in text


def test_engine_command_runs():
    p = subprocess.run([sys.executable, "-m", "registry.integrations.engine", "--arch", "gemma3", "--prompts", "3",
                        "--tokens", "16", "--check"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "rope_pool_fused: selected" in out and "slot engine: mode=fused" in out
    assert "request 2: prompt 11 tokens ->" in out and "tokens/s" in out
    assert "check: all 3 requests match mlx-lm's own greedy decode" in out
    p = subprocess.run([sys.executable, "-m", "registry.integrations.engine", "--arch", "gemma9"],
                       cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--arch 'gemma9': choose from" in p.stderr


def test_decode_is_pipelined_one_step_late():
    """Each decode step is queued on the previous step's lazy tokens before those are read: after a
    decode step the request has one more token scheduled than read, and the step returns the previous
    step's token. Nothing is lost at the end, and the tokens are mlx-lm's."""
    model = model_of("llama")
    engine = SlotEngine(model)
    want = mlx_lm_greedy(model, PROMPTS[0], 4)
    a = engine.add_request(PROMPTS[0], 4)
    r = engine.requests[a]
    assert engine.step() == [(a, want[0])]                 # prefill: its first token is read at once
    assert engine.step() == [] and (r.scheduled, len(r.generated)) == (2, 1)
    assert engine.step() == [(a, want[1])] and (r.scheduled, len(r.generated)) == (3, 2)
    # the last forward is queued, a leaves `running`, and with nothing left to run the step reads all
    assert engine.step() == [(a, want[2]), (a, want[3])]
    assert not engine.running and not engine._inflight and r.generated == want
    assert engine.free_slots == engine.pool_size


def test_a_failed_step_keeps_the_queued_tokens():
    model = model_of("llama")
    engine = SlotEngine(model)
    a = engine.add_request(PROMPTS[0], 4)
    engine.step()
    engine.step()                                          # decode 1 queued, not read
    engine.add_request([1, 2], 2)
    original = engine._forward

    def boom(reqs, tokens):
        raise EngineError("injected")

    engine._forward = boom
    with pytest.raises(EngineError, match="injected"):
        engine.step()
    engine._forward = original
    assert len(engine._inflight) == 1                      # decode 1 is still queued, and is read later
    while engine.waiting or engine.running or engine._inflight:
        engine.step()
    assert engine.requests[a].generated == mlx_lm_greedy(model, PROMPTS[0], 4)


def _record_masks(engine: SlotEngine) -> list:
    """(step, window, mask) of every make_mask call of the engine's forwards."""
    seen = []
    for pool in engine.pools.values():
        def make_mask(N, window_size=None, _pool=pool, _orig=pool.make_mask, **kw):
            mask = _orig(N, window_size, **kw)
            seen.append((engine.step_ctx, window_size or _pool.window, mask))
            return mask
        pool.make_mask = make_mask
    return seen


@pytest.mark.parametrize("mode", ["fused", "module"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_lone_request_reads_a_slice_with_mlx_lms_masks(arch, mode):
    """One request at a time, its slots consecutive: every step has a span instead of a slot table
    (attention reads a slice of each pool), and the masks are mlx-lm's own forms while the context
    fits the window (None for one query, "causal" for the prompt), arrays past it (gemma3's sliding
    layers, window 8: a 12-token prompt + 16 tokens). With its slots scattered by an earlier batch,
    the same request reads through the table. Its tokens are mlx-lm's either way. A decode token
    past the window reads only the window's last slots, with no mask (what a RotatingKVCache holds
    and mlx-lm's mask for it: MLX's fused attention takes it, not an array mask on CUDA)."""
    model = model_of(arch)
    engine = SlotEngine(model, pool_size=64, mode=mode)        # module: the run written as a slice update
    seen = _record_masks(engine)
    rows = []                                                  # (step, window, slots read) per layer
    for pool in engine.pools.values():
        def read(_pool=pool, _orig=pool._read):
            kv = _orig()
            rows.append((engine.step_ctx, _pool.window, kv[0].shape[2]))
            return kv
        pool._read = read
    toks = engine.generate([PROMPTS[2]], NEW_TOKENS)["tokens"][0]
    assert_tokens_match(model, PROMPTS[2], toks, f"{arch}: lone request")
    assert seen and all(s.span == (0, s.context) and s.table is None for s, _, _ in seen)
    for s, window, mask in seen:
        if not window or s.context <= window:
            assert (mask is None) if s.length == 1 else (mask == "causal"), (s.context, window, mask)
        elif s.length == 1:
            assert mask is None, (s.context, window, mask)
        else:
            assert isinstance(mask, mx.array), (s.context, window, mask)
    for s, window, n in rows:
        assert n == (window if s.length == 1 and window and s.context > window else s.context), (s.context, window, n)
    assert any(window and n == window < s.context for s, window, n in rows) == (arch == "gemma3")
    fits = {not w or s.context <= w for s, w, _ in seen}
    assert fits == ({True, False} if arch == "gemma3" else {True})

    engine.generate([PROMPTS[0], PROMPTS[1]], 6)            # batched decode interleaves their slots
    seen.clear()
    toks = engine.generate([PROMPTS[2]], NEW_TOKENS)["tokens"][0]
    assert_tokens_match(model, PROMPTS[2], toks, f"{arch}: lone request on scattered slots")
    assert all(s.span is None and s.table is not None for s, _, _ in seen)
    assert engine.free_slots == 64


# A lone request's step against mlx-lm's own: the nodes the engine may add per KV layer (each costs host
# time on CUDA whatever its size: docs/benchmarks/e2e-root-cause.md). Both modes read each
# pool as one strided view (Flatten + AsStrided where mlx-lm slices its buffer); `module` writes a
# slice of the slot-major pool from the head-major k/v (a reshape more per tensor).
EXTRA_PER_LAYER = {"fused": 2, "module": 4}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_lone_request_step_is_mlx_lms_graph_plus_the_pool_views(native_artifacts, arch, monkeypatch):
    """A lone request's decode step builds no gather, scatter or mask, and at most EXTRA_PER_LAYER
    nodes per layer more than mlx-lm's step: `module` against mlx-lm's own caches, `fused` against
    the drop-in cache with q/k/v as three projections, as the slot engine runs them."""
    from benchmarks.graph_count import count
    from registry.integrations.mlx_lm import make_prompt_cache

    monkeypatch.setenv("MLX_AOT_PACK_QKV", "0")

    model = model_of(arch)
    kernels = build_kernel_sets(model)
    own = {}
    for name, make in (("module", make_own_cache), ("fused", make_prompt_cache)):
        cache = make(model)
        mx.eval(model(mx.array([PROMPTS[0]]), cache=cache))
        own[name] = count([model(mx.array([[1]]), cache=cache)[:, -1, :]])
    for mode in ("module", "fused"):
        engine = SlotEngine(model, kernels=kernels, mode=mode, pool_size=64)
        rid = engine.add_request(PROMPTS[0], 4)
        engine.step()
        step = count([engine._forward([engine.requests[rid]], mx.array([[1]], dtype=mx.int32))])
        extra = step - own[mode]
        masks_or_tables = {"Gather", "Scatter", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd"}
        assert not masks_or_tables & set(extra), f"{arch} {mode}: {extra}"
        layers = len(engine.pools)
        assert sum(step.values()) - sum(own[mode].values()) <= EXTRA_PER_LAYER[mode] * layers, \
            f"{arch} {mode}: {sum(step.values())} nodes against mlx-lm's {sum(own[mode].values())}: {extra}"


@pytest.mark.parametrize("arch,norm_kernel", [("llama", True), ("qwen3", True), ("qwen3", False), ("gemma3", True)])
def test_direct_forward_and_rope_capture_agree(monkeypatch, arch, norm_kernel):
    """Layers whose attention is the llama form run the plan's call in that form during the engine's
    forwards (the capture sees no rope call); MLX_AOT_DIRECT_ATTENTION=0 (or direct=False) takes every
    layer through the capture. Both give the same tokens and logits, with qwen3's q/k norms in the
    kernel and, without qk_norm_rope_pool_fused, as the module's own; after a forward the model's
    attention classes are its own again."""
    model = model_of(arch)
    if not norm_kernel:
        monkeypatch.setenv("MLX_AOT_QK_NORM_ROPE_POOL_FUSED", "0")
    kernels = build_kernel_sets(model)
    assert all((p.kernel == "qk_norm_rope_pool_fused") == (norm_kernel and arch != "llama")
               for p in SlotEngine(model, kernels=kernels).plans.values())
    direct = SlotEngine(model, kernels=kernels, record_logits=True)
    monkeypatch.setenv("MLX_AOT_DIRECT_ATTENTION", "0")
    captured = SlotEngine(model, kernels=kernels, record_logits=True)
    assert all(p.how == "direct forward" for p in direct.plans.values() if p.call is not None)
    assert all(p.how == "rope capture" for p in captured.plans.values() if p.call is not None)
    assert "direct forward [" in direct.explain() and "rope capture [" in captured.explain()
    classes = {i: type(a) for i, a in direct.attn_layers.items()}
    a, b = direct.generate(PROMPTS, NEW_TOKENS), captured.generate(PROMPTS, NEW_TOKENS)
    assert {i: type(a_) for i, a_ in direct.attn_layers.items()} == classes
    assert a["tokens"] == b["tokens"]
    for x, y in zip(a["logits"], b["logits"]):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    fused = sum(p.path == "fused" for p in direct.plans.values())
    assert direct.calls["fused"] == captured.calls["fused"] == fused * (len(PROMPTS) + NEW_TOKENS - 1)
    with pytest.raises(ValueError, match="direct must be True, False or None"):
        SlotEngine(model, kernels=kernels, direct="yes")


def test_a_model_the_drop_in_cache_made_direct_still_decodes_batched():
    """make_prompt_cache swaps fused layers' attention classes for direct subclasses (module
    registry.integrations.direct_attention) for good: the engine built on that model afterwards still
    knows them as mlx-lm's classes and batches its decode steps (it once decoded one request at a time
    there, 4-6x slower at batch 8 on the H200), with mlx-lm's tokens."""
    from registry.integrations.mlx_lm import make_prompt_cache

    mx.random.seed(0)
    model = build_model(ARCHS["llama"], dtype=mx.float32)      # its own: the swap stays on the model
    make_prompt_cache(model)
    assert all(type(a).__module__ == "registry.integrations.direct_attention"
               for a in SlotEngine(model).attn_layers.values())
    engine = SlotEngine(model)
    assert engine.batch_reason == "" and "decode batched" in engine.explain()
    out = engine.generate(PROMPTS, 6)
    assert out["decode_steps"] == 5 and out["decode_tokens"] == len(PROMPTS) * 5
    for i, (p, toks) in enumerate(zip(PROMPTS, out["tokens"])):
        assert_tokens_match(model, p, toks, f"request {i}")


def test_an_engine_forward_leaves_the_drop_in_caches_switches_in_place():
    """The engine's forwards put back what the attention held before them, not what it held when the
    engine was built: an engine built before make_prompt_cache leaves the drop-in cache's rope
    switches on the model, so a drop-in cache made before the engine's forward stays fused after it."""
    from mlx_lm.generate import generate_step

    from registry.integrations.mlx_lm import make_prompt_cache
    from registry.integrations.mlx_lm_cache import SwitchRope

    mx.random.seed(0)
    model = build_model(ARCHS["llama"], dtype=mx.float32)      # its own: the switches stay on the model
    engine = SlotEngine(model, mode="module")                   # its hooks wrap the model's own rope
    cache = make_prompt_cache(model)
    attns = list(engine.attn_layers.values())
    assert all(isinstance(a.rope, SwitchRope) for a in attns)
    engine.generate([PROMPTS[0]], 3)
    assert all(isinstance(a.rope, SwitchRope) for a in attns)
    toks = [int(t) for t, _ in generate_step(mx.array(PROMPTS[0]), model, max_tokens=4, prompt_cache=cache)]
    assert cache[0]._fusion.calls["fused"] > 0 and cache[0]._fusion.calls["stock"] == 0
    assert_tokens_match(model, PROMPTS[0], toks, "drop-in cache after an engine forward")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_batched_decode_attends_through_the_kernel(native_artifacts, arch, monkeypatch):
    """decode_attention selected (forced on: its `prefer` picks CUDA only): a batch's decode steps read
    the pool through the slot table with no per-layer gather, each request's length and the sliding
    window as data (gemma3's window 8 < its 12-token prompt); tokens identical to mlx-lm's."""
    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION", "1")
    mx.random.seed(0)
    model = build_model(ARCHS[arch], dtype=mx.float32)
    engine = SlotEngine(model, kernels=build_kernel_sets(model), mode="fused")
    assert all(p.attention is not None for p in engine.plans.values() if p.path == "fused" and p.direct)
    gathers = []
    original = type(next(iter(engine.pools.values())))._read
    monkeypatch.setattr(type(next(iter(engine.pools.values()))), "_read",
                        lambda self: gathers.append(self.engine.step_ctx.length) or original(self))
    out = engine.generate(PROMPTS, NEW_TOKENS)
    for i, p in enumerate(PROMPTS):
        assert_tokens_match(model, p, out["tokens"][i], f"{arch} request {i}")
    direct = [p for p in engine.plans.values() if p.path == "fused" and p.direct]
    assert engine.calls["decode_attention"] == len(direct) * (NEW_TOKENS - 1)
    assert 1 not in gathers                                  # decode steps gathered nothing
