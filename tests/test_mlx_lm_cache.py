"""The drop-in fused caches (registry/integrations/mlx_lm_cache.py) inside mlx-lm 0.32.2's own
generate_step and BatchGenerator: equivalence with stock mlx-lm for every architecture of the
coverage table, which path each layer takes, growth, sliding windows, batching, save/load, the
capture's fallbacks. Runs on the default device (CPU in CI; the GPU host too)."""

from __future__ import annotations

import copy
import importlib

import mlx.core as mx
import numpy as np
import pytest

from registry.core import backend_of
from tests import _noise
from registry.integrations import mlx_lm_cache as mc
from registry.integrations.coverage import ARCHS
from registry.integrations.tolerance import HALF_LOGIT_TOL
from registry.integrations.mlx_lm import build_model, find_attention_layers, import_mlx_lm_module, make_prompt_cache

gen = importlib.import_module("mlx_lm.generate")
stock = import_mlx_lm_module("cache")

PROMPT = [3, 17, 42, 99, 7, 11, 5, 8, 200, 1]     # longer than the tiny sliding windows (8)
PROMPTS = [[3, 17, 42, 99, 7], [11, 5], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]]
NEW = 12
BF16_REL_TOL = HALF_LOGIT_TOL                       # docs/engine.md: the bf16 tolerance


def fresh_model(arch: str, dtype: str = "float32"):
    """A new model per test: make_prompt_cache installs its rope switches on the model."""
    mx.random.seed(0)
    return build_model(ARCHS[arch], dtype=getattr(mx, dtype))


def run(model, cache, prompt, n=NEW, **kw):
    """mlx-lm's own generate_step: (tokens, log-probs [n, V])."""
    toks, lps = [], []
    for (t, lp), _ in zip(gen.generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache, **kw),
                          range(n)):
        toks.append(int(t))
        lps.append(np.array(lp.astype(mx.float32)))
    return toks, np.stack(lps)


def batch_run(model, prompts, n=NEW, caches=None, **kw):
    """mlx-lm's own BatchGenerator: tokens and log-probs per prompt."""
    g = gen.BatchGenerator(model, stop_tokens=[], max_tokens=n, **kw)
    uids = g.insert(prompts, [n] * len(prompts), caches=caches)
    toks, lps = {u: [] for u in uids}, {u: [] for u in uids}
    while responses := g.next_generated():
        for r in responses:
            if r.finish_reason != "stop":
                toks[r.uid].append(r.token)
                lps[r.uid].append(np.array(r.logprobs))
    g.close()
    return [toks[u] for u in uids], [np.stack(lps[u]) for u in uids]


def assert_same_up_to_noise(model, prompts, got, want):
    """Per request, fused (got) against stock (want), both from BatchGenerator. On the CPU: tokens
    identical, log-probs within 1e-4. Elsewhere float32 matmuls may run in TF32 (CUDA), which turns a
    last-bit difference of the kernel's arithmetic into up to ~1e-3 in the logits, so tests/_noise.py's
    device-measured bounds apply, as for the engine: tokens identical up to stock's first near-tie,
    log-probs within twice its logit bound (a log-prob is a logit less the row's logsumexp)."""
    for i, (g, w, gl, wl) in enumerate(zip(got[0], want[0], got[1], want[1])):
        if mx.default_device() == mx.cpu:
            n, atol = len(w), 1e-4
        else:
            one = _noise.forced(model, [prompts[i]], w)[0]
            floor = _noise.noise_floor(model, prompts[i], w, one)
            n, atol = _noise.compared_steps(one, floor), 2 * _noise.logits_atol(floor)
        assert len(g) == len(w) and g[:n] == w[:n], f"request {i}: {g} vs stock {w} (compared {n} steps)"
        np.testing.assert_allclose(gl[:n], wl[:n], atol=atol, rtol=0, err_msg=f"request {i} (first {n} steps)")


def counts(model) -> dict[int, dict]:
    return {i: dict(f.calls) for i, f in mc.fused_model(model).fusions.items()}


# ----------------------------------------------------------------------------- equivalence

DIRECT_EXPECTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3")   # among others: the llama form


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "capture"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_float32_generate_step_matches_stock(native_artifacts, arch, direct):
    """Tokens identical, log-probs within 1e-4; every fused layer ran the kernel in every forward,
    through the direct forward where its attention is the llama form, else (and with direct=False)
    through the rope capture."""
    model = fresh_model(arch)
    want = run(model, stock.make_prompt_cache(model), PROMPT)
    cache = make_prompt_cache(model, direct=direct)
    fm = mc.fused_model(model)
    assert all(f.direct == (direct and not f.direct_reason) for f in fm.fusions.values())
    if arch in DIRECT_EXPECTED:
        assert all(f.direct == direct for f in fm.fusions.values()), fm.explain()
    got = run(model, cache, PROMPT)
    assert got[0] == want[0], arch
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0, err_msg=arch)
    totals = {f.calls["fused"] + f.calls["rotate_only"] for f in fm.fusions.values()}
    assert len(totals) <= 1 and all(t > NEW for t in totals), totals     # the same forwards in every layer
    for i, c in enumerate(cache):
        inner = c.caches[-1] if isinstance(c, stock.CacheList) else c
        if i in fm.fusions:
            assert isinstance(inner, mc._Fused) and inner.kernel.implementation == f"native-{backend_of(None)}"
            calls = fm.fusions[i].calls
            assert calls["stock"] == 0, (arch, i, calls)
            # rotating caches rotate-only in prefill (L > 1), write in place when decoding
            assert calls["rotate_only"] == (1 if type(inner).__name__ == "RotatingKVCache" else 0)
            # direct layers with per-head q/k norms right before RoPE run them in the norm kernel
            f = fm.fusions[i]
            assert ("_launch_norm" in inner.__dict__) == (f.direct and f.norm_kernel is not None), (arch, i)
            assert ("_launch" in inner.__dict__) == (not f.direct or f.norm_kernel is None), (arch, i)
        else:
            assert not isinstance(inner, mc._Fused) and c.kernel is None and c.reason, (arch, i)
    if direct and arch in ("qwen3", "gemma3"):
        assert all(f.norm_kernel is not None for f in fm.fusions.values())
    # the switches are permanent: mlx-lm's own caches still get mlx-lm's own rope
    assert run(model, stock.make_prompt_cache(model), PROMPT)[0] == want[0]
    assert all(v.get("stock", 0) == 0 for v in counts(model).values())


FUSED_EXPECTED = {"llama": [0, 1], "gemma3": [0, 1], "cohere2 (sliding, NoPE global)": [0, 2],
                  "qwen3_next (hybrid)": [3], "llama (dynamic)": [], "gptj (rotated slice)": [],
                  "deepseek_v3 (MLA)": [], "smollm3 (NoPE layers)": [0, 1, 2]}


@pytest.mark.parametrize("arch", list(FUSED_EXPECTED))
def test_which_layers_are_fused(arch):
    model = fresh_model(arch)
    cache = make_prompt_cache(model)
    fm = mc.fused_model(model)
    assert sorted(fm.fusions) == FUSED_EXPECTED[arch]
    for i, why in fm.reasons.items():
        assert cache[i].kernel is None and cache[i].reason == why and why
    assert "fused: rope_pool_fused" in fm.explain() or "fused: qk_norm_rope_pool_fused" in fm.explain() or not fm.fusions


def test_reasons_name_the_cause():
    fm = mc.fused_model(fresh_model("llama (dynamic)"))
    assert all("DynamicNTKScalingRoPE" in r for r in fm.reasons.values())
    fm = mc.fused_model(fresh_model("smollm3 (NoPE layers)"))
    assert fm.reasons == {3: "the layer applies no RoPE (NoPE)"}


def test_kernel_disabled_keeps_stock_caches(monkeypatch):
    monkeypatch.setenv("MLX_AOT_ROPE_POOL_FUSED", "0")
    model = fresh_model("qwen3")
    cache = make_prompt_cache(model)
    assert all(type(c) is stock.KVCache and "MLX_AOT_ROPE_POOL_FUSED=0" in c.reason for c in cache)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bfloat16_within_tolerance(native_artifacts, arch):
    """bf16: the same tokens fed to both (teacher forcing on the fused run's tokens); logits within
    docs/engine.md's tolerance. MoE models are skipped on the CPU (MLX's GatherMM is float32 only)."""
    model = fresh_model(arch, "bfloat16")
    try:
        mx.eval(model(mx.array([[1, 2]]), cache=stock.make_prompt_cache(model)))
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"mlx-lm's own bf16 forward fails on {mx.default_device()}: {e}")
    toks, _ = run(model, make_prompt_cache(model), PROMPT)
    inputs = [PROMPT] + [[t] for t in toks[:-1]]

    def logits(cache):
        return np.stack([np.array(model(mx.array([x]), cache=cache)[0, -1].astype(mx.float32)) for x in inputs])

    ours, theirs = logits(make_prompt_cache(model)), logits(stock.make_prompt_cache(model))
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= BF16_REL_TOL * scale, arch


# ----------------------------------------------------------------------------- cache behaviour

def test_growth_by_256_and_chunked_prefill(native_artifacts):
    """A 300-token prompt prefilled in chunks of 128 (growth at 256, from an unaligned offset): the
    head-major buffers grow exactly as mlx-lm's and hold the same rows."""
    model = fresh_model("llama")
    prompt = (np.arange(300) * 7 % 250).tolist()
    want = run(model, stock.make_prompt_cache(model), prompt, prefill_step_size=128)
    cache = make_prompt_cache(model)
    got = run(model, cache, prompt, prefill_step_size=128)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)
    ref = stock.make_prompt_cache(model)
    run(model, ref, prompt, prefill_step_size=128)
    # The same fused cache on the reference path (the kernels' own fp32 angles in pure MLX) on a
    # second copy of the model. Only the first layer sees bit-identical inputs on both paths: its key
    # rows must agree to the round-off of the kernel's fp32 rotation against MLX's cos/sin (bounded by
    # MLX's own trig error at these angles on this device, measured here). Deeper layers' inputs
    # differ by the earlier layers' round-off, which grows through attention and, on the H200, the
    # TF32 fp32 matmuls (tests/gpu/diag_trig.py there: layer 0 keys 2.4e-7 apart, layer 1 keys 5.7e-4
    # from position 173 on, while the kernel's cos/sin and MLX's both err by 6.9e-8 from float64);
    # they are held to the rows of stock mlx-lm, and the log-probs above to 1e-4.
    twin = fresh_model("llama")
    from registry.integrations.mlx_lm import build_kernel_sets
    from registry.kernels._rope import inv_freq
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_AOT_DISABLE_NATIVE", "1")
        ref_kernels = build_kernel_sets(twin)
    assert all(k.rope.implementation == "reference" for k in ref_kernels.by_layer.values() if k.rope is not None)
    exact = make_prompt_cache(twin, kernels=ref_kernels)
    run(twin, exact, prompt, prefill_step_size=128)
    rope_cfg = next(k.rope.rope for k in ref_kernels.by_layer.values() if k.rope is not None)
    angles = mx.arange(len(prompt) + NEW, dtype=mx.float32)[:, None] * rope_cfg.pos_scale * inv_freq(rope_cfg)[None]
    a64 = np.array(angles).astype(np.float64)
    trig = max(float(np.abs(np.array(mx.cos(angles)) - np.cos(a64)).max()),
               float(np.abs(np.array(mx.sin(angles)) - np.sin(a64)).max()))
    for layer, (ours, same, theirs) in enumerate(zip(cache, exact, ref)):
        assert ours.keys.shape == theirs.keys.shape == same.keys.shape and ours.offset == theirs.offset
        n = ours.offset
        mine, twin_rows, stock_rows = (np.array(c.keys[..., :n, :]) for c in (ours, same, theirs))
        mine_v, stock_v = (np.array(c.values[..., :n, :]) for c in (ours, theirs))
        if layer == 0:
            # a rotated pair (x1 c - x2 s, x1 s + x2 c) errs by at most (|x1| + |x2|) x the trig error
            np.testing.assert_allclose(mine, twin_rows, atol=1e-5 + 2 * trig * float(np.abs(twin_rows).max()),
                                       rtol=1e-5, err_msg=f"MLX's fp32 cos/sin error at these angles here: {trig:.3g}")
            np.testing.assert_array_equal(mine_v, stock_v)          # the same v_proj rows, stored as they are
        assert np.abs(mine - stock_rows).max() < 1e-2, layer              # and the rows are the same rows
        assert np.abs(mine_v - stock_v).max() < 1e-2, layer


def test_max_kv_size_rotating_cache_with_keep(native_artifacts):
    """max_kv_size: mlx-lm's RotatingKVCache(keep=4) for models without make_cache; wraps in decode."""
    model = fresh_model("qwen2")                    # no make_cache of its own (llama has one)
    want = run(model, stock.make_prompt_cache(model, max_kv_size=8), PROMPT, max_kv_size=8)
    cache = make_prompt_cache(model, max_kv_size=8)
    assert all(type(c).__name__ == "RotatingKVCache" and c.keep == 4 and c.kernel is not None for c in cache)
    got = run(model, cache, PROMPT)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)
    # decode from an empty rotating cache (no prefill chunk): in-place writes from the start
    want = run(model, stock.make_prompt_cache(model, max_kv_size=8), [5])
    assert run(model, make_prompt_cache(model, max_kv_size=8), [5])[0] == want[0]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "capture"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "cohere2 (sliding, NoPE global)", "qwen3_next (hybrid)"])
def test_batch_generator(native_artifacts, arch, direct, monkeypatch):
    """BatchGenerator with per-request fused caches: merged into BatchKVCache/BatchRotatingKVCache
    (fused, same layer), tokens identical and log-probs within 1e-4 of stock BatchGenerator."""
    model = fresh_model(arch)
    mc.fused_model(model, direct=direct)
    want = batch_run(model, PROMPTS)
    writers = []
    original = mc._Fused._write

    def spy(self, *a, **kw):
        writers.append(type(self).__name__)
        return original(self, *a, **kw)

    monkeypatch.setattr(mc._Fused, "_write", spy)
    got = batch_run(model, PROMPTS, caches=[make_prompt_cache(model, direct=direct) for _ in PROMPTS])
    assert_same_up_to_noise(model, PROMPTS, got, want)
    assert "BatchKVCache" in writers or "BatchRotatingKVCache" in writers
    if arch in ("gemma3", "cohere2 (sliding, NoPE global)"):
        assert "BatchRotatingKVCache" in writers
    assert all(v.get("stock", 0) == 0 for v in counts(model).values())


def test_batch_cache_extract_and_deepcopy_stay_fused():
    model = fresh_model("gemma3")
    caches = [make_prompt_cache(model) for _ in range(2)]
    for c, p in zip(caches, PROMPTS[:2]):
        model(mx.array([p]), cache=c)
    merged = [c[0].merge([x[i] for x in caches]) for i, c in enumerate(zip(*caches))]
    assert [type(c).__name__ for c in merged] == ["BatchRotatingKVCache", "BatchKVCache"]
    assert all(isinstance(c, mc._Fused) and c.kernel is caches[0][i].kernel for i, c in enumerate(merged))
    back = [c.extract(1) for c in merged]
    assert [type(c).__name__ for c in back] == ["RotatingKVCache", "KVCache"] and all(c.kernel for c in back)
    dup = copy.deepcopy(merged)
    assert dup[1]._fusion is merged[1]._fusion and dup[1].keys is not merged[1].keys


def test_save_load_round_trip(native_artifacts, tmp_path):
    """save_prompt_cache of fused caches writes mlx-lm's own classes: stock load_prompt_cache reads
    it, and so does ours (fused again); both continue exactly as the uninterrupted run."""
    model = fresh_model("gemma3")
    full = run(model, make_prompt_cache(model), PROMPT + [9, 9])
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT + [9]]), cache=cache))
    path = str(tmp_path / "cache.safetensors")
    stock.save_prompt_cache(path, cache, {"who": "test"})
    plain = stock.load_prompt_cache(path)
    assert [type(c) for c in plain] == [stock.RotatingKVCache, stock.KVCache]
    fused, meta = mc.load_prompt_cache(path, model, return_metadata=True)
    assert meta == {"who": "test"} and all(isinstance(c, mc._Fused) for c in fused)
    for c in (plain, fused):
        assert run(model, c, [9])[0] == full[0], type(c[0])


# Attention-like code run as if it were an mlx-lm model module: only model code gets the
# offset objects the switch captures.
_ATTENTION_LIKE = """
def attend(attn, cache, q, k, v, extra_rope_call):
    qr = attn.rope(q, offset=cache.offset)
    kr = attn.rope(k, offset=cache.offset)
    extra = attn.rope(k, offset=cache.offset) if extra_rope_call else None
    keys, values = cache.update_and_fetch(kr, v)
    return qr, keys, extra
"""


def _attend(*args):
    ns = {"__name__": "mlx_lm.models.fake_arch"}
    exec(_ATTENTION_LIKE, ns)
    return ns["attend"](*args)


@pytest.mark.parametrize("extra_rope_call", [False, True])
def test_capture_and_its_fallback_give_mlx_lm_results(native_artifacts, extra_rope_call):
    """Model code's two rope calls are fused; a forward that breaks the contract (a third rope
    call) is resolved with the module's own rope and written the stock way."""
    model = fresh_model("llama")
    cache = make_prompt_cache(model)
    attn = model.model.layers[0].self_attn
    q, k, v = (mx.random.normal((1, h, 3, 16)) for h in (4, 2, 2))
    qr, keys, extra = _attend(attn, cache[0], q, k, v, extra_rope_call)
    want_q, want_k = attn.rope.rope(q, offset=0), attn.rope.rope(k, offset=0)
    np.testing.assert_allclose(np.array(qr), np.array(want_q), atol=1e-5)
    np.testing.assert_allclose(np.array(keys), np.array(want_k), atol=1e-5)
    f = mc.fused_model(model).fusions[0]
    if extra_rope_call:
        np.testing.assert_allclose(np.array(extra), np.array(want_k), atol=1e-6)
        assert "3 times" in f.fallback and f.calls["stock"] == 1
    else:
        assert f.calls["fused"] == 1 and not f.fallback
    assert cache[0].offset == 3


# ----------------------------------------------------------------------------- the direct forward

def test_direct_forward_is_checked_per_layer(native_artifacts):
    """The llama form is checked by running it: a module whose forward differs (here: its output
    scaled) keeps the rope capture with the reason, and still gives its own results."""
    llama = import_mlx_lm_module("llama")
    model = fresh_model("llama")
    attn0 = model.model.layers[0].self_attn

    class Scaled(llama.Attention):
        def __call__(self, x, mask=None, cache=None):
            return 2 * super().__call__(x, mask, cache)

    attn0.__class__ = Scaled
    want = run(model, stock.make_prompt_cache(model), PROMPT)
    got = run(model, make_prompt_cache(model), PROMPT)
    fm = mc.fused_model(model)
    assert not fm.fusions[0].direct and "differs from the llama form" in fm.fusions[0].direct_reason
    assert type(attn0) is Scaled and "rope capture (its forward differs" in fm.explain()
    attn1 = model.model.layers[1].self_attn
    assert fm.fusions[1].direct and type(attn1).__name__ == "Attention" and isinstance(attn1, llama.Attention)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)
    assert fm.fusions[0].calls["fused"] > NEW and fm.fusions[1].calls["fused"] > NEW


def test_direct_update_of_another_layers_cache_runs_the_stock_step(native_artifacts):
    """A fused cache handed to another layer's attention (here: the two layers' caches swapped) is
    written the stock way there, so the model computes what stock mlx-lm computes with that list."""
    model = fresh_model("llama")
    ref = stock.make_prompt_cache(model)
    want = run(model, [ref[1], ref[0]], PROMPT)
    cache = make_prompt_cache(model)
    got = run(model, [cache[1], cache[0]], PROMPT)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)
    assert all(v["stock"] > NEW and not v.get("fused") for v in counts(model).values())


def test_direct_switch_and_stock_model(monkeypatch):
    """MLX_AOT_DIRECT_ATTENTION=0 (or direct=False) keeps every layer on the capture; direct=True
    installs it again; stock_model takes out everything make_prompt_cache installed, for a block."""
    llama = import_mlx_lm_module("llama")
    model = fresh_model("llama")
    attn = model.model.layers[0].self_attn
    monkeypatch.setenv("MLX_AOT_DIRECT_ATTENTION", "0")
    make_prompt_cache(model)
    assert type(attn) is llama.Attention and not any(f.direct for f in mc.fused_model(model).fusions.values())
    make_prompt_cache(model, direct=True)
    assert type(attn) is not llama.Attention and all(f.direct for f in mc.fused_model(model).fusions.values())
    switch, cls = attn.rope, type(attn)
    with mc.stock_model(model):
        assert type(attn) is llama.Attention and attn.rope is switch.rope
    assert type(attn) is cls and attn.rope is switch
    monkeypatch.setenv("MLX_AOT_DIRECT_ATTENTION", "maybe")
    with pytest.raises(Exception, match="MLX_AOT_DIRECT_ATTENTION='maybe'"):
        make_prompt_cache(model)
    for bad in ("no", 0, 1):                       # a string is truthy: only True, False and None
        with pytest.raises(TypeError, match=f"make_prompt_cache: direct must be True, False or None.*got {bad!r}"):
            make_prompt_cache(model, direct=bad)
        with pytest.raises(TypeError, match="fused_model: direct must be"):
            mc.fused_model(model, direct=bad)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])   # gemma3: sliding layers on the rope capture too
def test_restore_model_undoes_make_prompt_cache(native_artifacts, arch):
    """restore_model takes out for good what make_prompt_cache installed (the direct classes, the rope
    switches, the q/k/v packs, the per-model state): stock mlx-lm then computes exactly what it did
    before, a cache made before keeps working, and make_prompt_cache installs everything again."""
    from mlx.utils import tree_flatten

    from registry.integrations import direct_attention as da
    from registry.integrations.mlx_lm import find_attention_layers, restore_model
    model = fresh_model(arch)
    layers = find_attention_layers(model)[0]
    before = {i: (type(a), a.rope) for i, a in layers.items()}
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    want = run(model, stock.make_prompt_cache(model), PROMPT)
    old = make_prompt_cache(model)
    fused = set(mc.fused_model(model).fusions)
    assert fused and any(da.packed(layers[i]) for i in fused)
    restore_model(model)
    assert {i: (type(a), a.rope) for i, a in layers.items()} == before
    assert not any(da._PACK_ATTR in a.__dict__ for a in layers.values()) and mc._STATE_ATTR not in model.__dict__
    assert {k: np.array(v) for k, v in tree_flatten(model.parameters())}.keys() == params.keys()
    for k, v in tree_flatten(model.parameters()):
        np.testing.assert_array_equal(np.array(v), params[k])
    again = run(model, stock.make_prompt_cache(model), PROMPT)
    assert again[0] == want[0]
    np.testing.assert_array_equal(again[1], want[1])
    got = run(model, old, PROMPT)                    # a drop-in cache of before: mlx-lm's own update now
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)
    make_prompt_cache(model)
    assert set(mc.fused_model(model).fusions) == fused and any(type(layers[i]) is not before[i][0] for i in fused)
    restore_model(model)
    restore_model(model)                             # nothing installed: nothing to do
    assert {i: (type(a), a.rope) for i, a in layers.items()} == before


# ----------------------------------------------------------------------------- q/k/v in one projection

def _spy_packs(model) -> dict[int, list[int]]:
    """Per packed layer, the token count L of every call of its packed projection (from now on)."""
    from registry.integrations import direct_attention as da
    seen = {}
    for i, layer in enumerate(model.model.layers):
        pack = layer.self_attn.__dict__.get(da._PACK_ATTR)
        if pack is None:
            continue
        calls = seen[i] = []

        def spy(x, proj=pack.proj, calls=calls):
            calls.append(x.shape[1])
            return proj(x)
        pack.proj = spy
    return seen


QKV = ("q_proj", "k_proj", "v_proj")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])   # qwen2: q/k/v biases; qwen3: the norm kernel
def test_decode_steps_project_q_k_v_once(native_artifacts, arch, tmp_path):
    """make_prompt_cache packs each direct layer's q/k/v projections into one whose rows are theirs,
    the modules keep views of those rows (save_weights writes them as before); every decode step (and
    no prefill) runs the one projection, with stock's tokens, and stock mlx-lm on the packed model
    computes exactly what it did before."""
    from registry.integrations import direct_attention as da
    model = fresh_model(arch)
    before = {(i, n, k): np.array(v) for i, layer in enumerate(model.model.layers) for n in QKV
              for k, v in layer.self_attn[n].items()}
    want = run(model, stock.make_prompt_cache(model), PROMPT)
    cache = make_prompt_cache(model)
    fm = mc.fused_model(model)
    assert fm.fusions and all(f.direct and not f.pack_reason for f in fm.fusions.values()), fm.explain()
    assert "q/k/v in one projection" in fm.explain()
    for i in fm.fusions:
        attn = model.model.layers[i].self_attn
        assert da.packed(attn)
        proj = attn.__dict__[da._PACK_ATTR].proj
        assert type(proj) is type(attn.q_proj) and set(proj) == set(attn.q_proj)
        for k in proj:
            np.testing.assert_array_equal(np.array(proj[k]), np.concatenate([before[(i, n, k)] for n in QKV]))
            for n in QKV:
                np.testing.assert_array_equal(np.array(attn[n][k]), before[(i, n, k)])
    model.save_weights(str(tmp_path / "w.safetensors"))
    saved = mx.load(str(tmp_path / "w.safetensors"))
    for (i, n, k), v in before.items():
        np.testing.assert_array_equal(np.array(saved[f"model.layers.{i}.self_attn.{n}.{k}"]), v)
    seen = _spy_packs(model)
    got = run(model, cache, PROMPT)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)
    assert set(seen) == set(fm.fusions)
    for i, ls in seen.items():                 # one prefill forward, then decode steps of one token
        assert ls == [1] * (fm.fusions[i].calls["fused"] - 1) and len(ls) >= NEW - 1, (i, ls)
    again = run(model, stock.make_prompt_cache(model), PROMPT)
    assert again[0] == want[0]
    np.testing.assert_array_equal(again[1], want[1])


def test_replaced_projections_run_unpacked_until_packed_again(native_artifacts):
    """load_weights replacing a packed projection's weight after make_prompt_cache: that layer's
    decode runs three projections (the new weight, stock's results) and the next make_prompt_cache
    packs it again."""
    from registry.integrations import direct_attention as da
    model = fresh_model("llama")
    cache = make_prompt_cache(model)
    attn0 = model.model.layers[0].self_attn
    new_q = attn0.q_proj.weight * 0.5
    model.load_weights([("model.layers.0.self_attn.q_proj.weight", new_q)], strict=False)
    assert not da.packed(attn0) and da.packed(model.model.layers[1].self_attn)
    want = run(model, stock.make_prompt_cache(model), PROMPT)
    seen = _spy_packs(model)
    got = run(model, cache, PROMPT)
    assert got[0] == want[0] and seen[0] == [] and seen[1], seen
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)
    fresh = make_prompt_cache(model)
    assert da.packed(attn0)
    np.testing.assert_array_equal(np.array(attn0.__dict__[da._PACK_ATTR].proj.weight[: new_q.shape[0]]),
                                  np.array(new_q))
    got = run(model, fresh, PROMPT)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)


def test_which_projections_pack(native_artifacts, monkeypatch):
    """Three nn.QuantizedLinear of one quantisation pack (stock's tokens); mixed classes do not (the
    reason names them) and MLX_AOT_PACK_QKV=0 takes packs out at the next make_prompt_cache."""
    import mlx.nn as nn
    from registry.integrations import direct_attention as da
    model = fresh_model("llama")
    nn.quantize(model, group_size=32, bits=8)
    want = run(model, stock.make_prompt_cache(model), PROMPT)
    cache = make_prompt_cache(model)
    fm = mc.fused_model(model)
    assert all(f.direct and not f.pack_reason for f in fm.fusions.values()), fm.explain()
    assert type(model.model.layers[0].self_attn.__dict__[da._PACK_ATTR].proj) is nn.QuantizedLinear
    got = run(model, cache, PROMPT)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=0)

    monkeypatch.setenv("MLX_AOT_PACK_QKV", "0")
    make_prompt_cache(model)
    assert not any(da.packed(layer.self_attn) for layer in model.model.layers)
    assert "q/k/v as three projections: MLX_AOT_PACK_QKV=0" in fm.explain()
    monkeypatch.delenv("MLX_AOT_PACK_QKV")

    mixed = fresh_model("llama")
    nn.quantize(mixed, group_size=32, bits=8, class_predicate=lambda path, m: path.endswith("k_proj"))
    want = run(mixed, stock.make_prompt_cache(mixed), PROMPT)
    got = run(mixed, make_prompt_cache(mixed), PROMPT)
    fm = mc.fused_model(mixed)
    assert all(f.direct and f.pack_reason == "q/k/v_proj are Linear, QuantizedLinear, Linear: only three "
               "nn.Linear or three nn.QuantizedLinear pack" for f in fm.fusions.values()), fm.explain()
    assert got[0] == want[0]
    attn = fresh_model("llama").model.layers[0].self_attn
    assert da.pack_reason(attn) == ""
    attn.q_proj.bias = mx.zeros((attn.q_proj.weight.shape[0],))
    assert da.pack_reason(attn) == "the q/k/v projections hold different arrays (a bias on some only)"


def test_offsets_outside_model_code_are_plain():
    """mlx-lm's cache module (state, to_quantized, merge), its generate loop and user code read
    plain ints: a captured offset object cannot leak into another cache."""
    model = fresh_model("qwen3")                    # head_dim 32: quantizable in groups of 32
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT]), cache=cache)
    assert type(cache[0].offset) is int and type(cache[0].state[2]) is int
    assert type(cache[0].to_quantized(32, 8).offset) is int
    assert not model.model.layers[0].self_attn.rope._expected


def test_switch_rope_passes_other_offsets_through():
    model = fresh_model("llama")
    make_prompt_cache(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.rope, mc.SwitchRope) and attn.rope.dims == attn.rope.rope.dims
    x = mx.random.normal((1, 4, 2, 16))
    for off in (0, 5, mx.array([3])):
        np.testing.assert_array_equal(np.array(attn.rope(x, offset=off)), np.array(attn.rope.rope(x, offset=off)))
    assert not attn.rope.calls
    # the kernel sets can be rebuilt on a model with switches installed
    from registry.integrations.mlx_lm import build_kernel_sets
    assert build_kernel_sets(model).by_layer[0].rope is not None


def test_bad_arguments():
    model = fresh_model("llama")
    with pytest.raises(ValueError, match="max_kv_size"):
        make_prompt_cache(model, max_kv_size=0)
    with pytest.raises(ValueError, match="2 layers"):
        mc.bind_prompt_cache(model, [stock.KVCache()])


def test_batch_decode_slots_are_made_on_the_device(native_artifacts):
    """A batch decode step's slots (b * S + idx) are one Arange every layer shares, not host data:
    on CUDA an array made from host data is managed memory, which the GPU faults in with a copy per
    step (ncu: ~200 us at batch 32, e2e-root-cause.md, "Host memory on CUDA"). Rows of the merged buffers land
    where the stock cache puts them."""
    from benchmarks.graph_count import count
    from registry.native import device_arange
    device_arange.cache_clear()                       # a memo hit evaluated earlier is a constant: no graph
    model = fresh_model("llama")
    caches = [make_prompt_cache(model) for _ in PROMPTS]
    for c, p in zip(caches, PROMPTS):
        model(mx.array([p]), cache=c)
    merged = [c[0].merge([x[i] for x in caches]) for i, c in enumerate(zip(*caches))]
    calls = []
    original = mc._Fused._write

    def spy(self, q, k, values, positions, slots, weights=None):
        calls.append(slots)
        return original(self, q, k, values, positions, slots, weights)

    mc._Fused._write = spy
    try:
        step = merged[0]._idx
        y = model(mx.array([[3]] * len(PROMPTS)), cache=merged)
    finally:
        mc._Fused._write = original
    S = merged[0].keys.shape[2]
    assert len(calls) == len(merged) and all(s is calls[0] for s in calls)   # one array for every layer
    nodes = count([calls[0]])
    assert nodes["Arange"] == 1 and set(nodes) <= {"Arange", "Slice", "Contiguous"}, nodes
    assert calls[0].tolist() == [b * S + step for b in range(len(PROMPTS))]
    want = []
    for p in PROMPTS:
        c = [import_mlx_lm_module("cache").KVCache() for _ in model.layers]
        model(mx.array([p]), cache=c)
        want.append(c)
    stock = [c[0].merge([x[i] for x in want]) for i, c in enumerate(zip(*want))]
    model(mx.array([[3]] * len(PROMPTS)), cache=stock)
    mx.eval(y)
    for f, st in zip(merged, stock):                  # float32: the rope's last bits may differ
        assert f._idx == st._idx and f.keys.shape == st.keys.shape
        for a, b in ((f.keys, st.keys), (f.values, st.values)):
            assert mx.allclose(a[..., :f._idx, :], b[..., :f._idx, :], atol=1e-4).item()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_single_request_decode_indices_are_made_on_the_device(native_artifacts, arch, monkeypatch):
    """generate_step's decode with the drop-in KVCache (position = row: one array for both) and
    RotatingKVCache (past its window: the ring row): each layer's position and slot are Aranges on
    the device, one per value for all layers, holding the row the cache wrote (no host data, so
    nothing on CUDA that a kernel reads from managed memory)."""
    from benchmarks.graph_count import count
    from registry.native import device_arange
    model = fresh_model(arch)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))        # 10 tokens: past gemma3's window of 8
    seen = []
    original = mc._Fused._write

    def spy(self, q, k, values, positions, slots, weights=None):
        seen.append((self, positions, slots))
        return original(self, q, k, values, positions, slots, weights)

    monkeypatch.setattr(mc._Fused, "_write", spy)
    for step in range(2):
        device_arange.cache_clear()                     # a hit evaluated by the last step has no graph
        seen.clear()
        model(mx.array([[5]]), cache=cache)
        arrays = [a for _, p, s in seen for a in (p, s)]
        nodes = count(arrays)
        distinct = {id(a) for a in arrays}
        assert nodes["Arange"] == len(distinct) and set(nodes) <= {"Arange", "Slice", "Contiguous"}, nodes
        assert len(seen) == len(cache)
        for c, pos, slot in seen:
            row = c._idx - 1 if isinstance(c, stock.RotatingKVCache) else c.offset - 1
            assert (pos.tolist(), slot.tolist()) == ([c.offset - 1], [row]), type(c).__name__
            assert (pos is slot) == (type(c).__name__ == "KVCache"), type(c).__name__
        assert len(distinct) == (1 if arch == "llama" else 2)   # gemma3: the position and the ring row


def test_decode_writes_the_buffer_in_place(native_artifacts):
    """Under generate_step's async_eval pipelining the kernel writes the same KV buffer every
    decode step (no copy of the cache per step; growth is the only one)."""
    model = fresh_model("llama")
    cache = make_prompt_cache(model)
    ptrs = set()
    for (tok, _), n in zip(gen.generate_step(mx.array(PROMPT), model, max_tokens=NEW, prompt_cache=cache), range(NEW)):
        if n >= 1:
            mx.eval(cache[1].keys, cache[1].values)
            ptrs.add((np.asarray(cache[1].keys).__array_interface__["data"][0],
                      np.asarray(cache[1].values).__array_interface__["data"][0]))
    assert cache[1].keys.shape[2] == 256 and len(ptrs) == 1, ptrs


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "capture"])
def test_prefill_and_growth_never_wait(native_artifacts, direct):
    """The buffers a fused cache grows (mx.zeros, then mx.concatenate every 256 rows) are taken in
    place without computing them first: a prefill and a decode past a growth wait for nothing."""
    from registry import native
    model = fresh_model("llama")
    cache = make_prompt_cache(model, direct=direct)
    native.reset_stats()
    mx.eval(model(mx.array([PROMPT * 25]), cache=cache))           # 250 rows
    for _ in range(10):                                             # grows at 256
        mx.eval(model(mx.array([[5]]), cache=cache))
    st = native.stats()
    assert cache[0].keys.shape[2] == 512 and st["launches"] == 2 * 11
    assert st["syncs"] == 0 and st["first_use_checks"] == 0 and st["copies"] == 0, st


# Prompts of different lengths (left padding 0, 7 and 4 in the batch) and which one finishes first:
# a filter that drops the longest prompt shifts the whole batch left by the padding all others share.
# The last case decodes two requests at a time: the others join (extend) while one is decoding.
BATCH_PROMPTS = [[3, 17, 42, 99, 7, 8, 9, 10, 11], [11, 5], [200, 1, 2, 3, 4], [7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 12]]
FINISHING = {"longest prompt first": ([3, 10, 6], {}), "shortest prompt first": ([10, 3, 6], {}),
             "middle prompt first": ([6, 10, 3], {}), "two at once, then the longest": ([3, 3, 10], {}),
             "longest prompt last": ([10, 6, 3], {}),
             "joining while others decode": ([3, 10, 6, 4], {"completion_batch_size": 2, "prefill_batch_size": 1})}


@pytest.mark.parametrize("order", list(FINISHING))
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batch_generation_never_waits(native_artifacts, arch, order):
    """BatchGenerator starts decoding with its batch caches' filter (`keys[indices]`, a gather), and
    filters again each time a request finishes, shifting the buffers left when every request left
    has padding (mlx-lm slices the gathered buffer there: a view). The launcher takes the filtered
    buffers in place as they are (docs/native.md), so a batch generation waits for nothing and
    copies nothing whichever request finishes first, with stock's tokens. Before, a shifted view
    cost a wait and a copy per fused pool (and a warning that did not apply to cache users)."""
    from registry import native
    model = fresh_model(arch)
    max_tokens, kw = FINISHING[order]
    prompts = BATCH_PROMPTS[:len(max_tokens)]

    def generate(caches=None):
        g = gen.BatchGenerator(model, stop_tokens=[], max_tokens=max(max_tokens), **kw)
        uids = g.insert(prompts, max_tokens, caches=caches)
        toks, lps = {u: [] for u in uids}, {u: [] for u in uids}
        while responses := g.next_generated():
            for r in responses:
                toks[r.uid].append(r.token)
                lps[r.uid].append(np.array(r.logprobs))
        g.close()
        return [toks[u] for u in uids], [np.stack(lps[u]) for u in uids]

    want = generate()
    native.reset_stats()
    got = generate([make_prompt_cache(model) for _ in prompts])
    st = native.stats()
    assert [len(t) for t in got[0]] == max_tokens and st["launches"] > 0, (got[0], st)
    assert st["syncs"] == 0 and st["first_use_checks"] == 0 and st["copies"] == 0, st
    assert_same_up_to_noise(model, prompts, got, want)


def test_batch_rotating_cache_past_its_window_is_never_copied_behind_a_guard(native_artifacts):
    """BatchGenerator on gemma3 (window 8) with a 12-token prompt: the first decode trims the merged
    buffer to the window, and the kernel then writes a buffer of its own in place (mlx-lm's batch
    _trim keeps a view, which the launcher could only write through a copy), with stock's tokens."""
    from registry import native
    model = fresh_model("gemma3")
    want = batch_run(model, PROMPTS)
    native.reset_stats()
    got = batch_run(model, PROMPTS, caches=[make_prompt_cache(model) for _ in PROMPTS])
    st = native.stats()
    assert st["launches"] > 0 and st["copies"] == 0, st
    assert_same_up_to_noise(model, PROMPTS, got, want)


def test_quantized_kv_after_fused_prefill_and_slot_engine_still_work(native_artifacts):
    """generate_step(kv_bits=...) turns the fused KVCache into the drop-in QuantizedKVCache (mlx-lm's
    class name and state: the to_quantized override, mlx_lm_quant_cache.py) and gives stock mlx-lm's
    tokens; the slot engine runs on a model with switches."""
    from registry.integrations.engine import mlx_lm_greedy
    from registry.integrations.slot_engine import SlotEngine

    model = fresh_model("qwen3")
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=4)
    try:
        want = run(model, stock.make_prompt_cache(model), PROMPT, **kw)
    except RuntimeError as e:   # MLX 0.32.4's CUDA quantized_matmul has no kernel for this shape/dtype
        if "No implementation for problem shape" not in str(e):
            raise
        pytest.skip(f"stock mlx-lm's quantized KV cache does not run on {mx.default_device()}: {e}")
    cache = make_prompt_cache(model)
    assert run(model, cache, PROMPT, **kw)[0] == want[0]
    from registry.integrations.mlx_lm_quant_cache import QuantizedKVCache

    assert all(type(c) is QuantizedKVCache and isinstance(c, stock.QuantizedKVCache) for c in cache)
    out = SlotEngine(model).generate(PROMPTS[:2], 4)
    assert out["tokens"] == [mlx_lm_greedy(model, p, 4) for p in PROMPTS[:2]]


# ----------------------------------------------------------------------------- decode attention

@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_batch_decode_attention_matches_stock(native_artifacts, arch, monkeypatch):
    """With decode_attention selected (forced on here: its `prefer` picks CUDA only), the batch caches'
    decode steps attend through it, reading the left padding (BatchKVCache) and the ring
    (BatchRotatingKVCache, gemma3's sliding layers, prompts past the window) per row: BatchGenerator's
    tokens identical and log-probs within 1e-4 of stock's."""
    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION", "1")
    model = fresh_model(arch)
    mc.fused_model(model)
    want = batch_run(model, PROMPTS, n=20)
    got = batch_run(model, PROMPTS, n=20, caches=[make_prompt_cache(model) for _ in PROMPTS])
    assert_same_up_to_noise(model, PROMPTS, got, want)
    fm = mc.fused_model(model)
    attended = {i: f.calls.get("attention", 0) for i, f in fm.fusions.items() if f.direct}
    assert attended and all(n > 0 for n in attended.values()), attended
    assert all(f.attention is not None for f in fm.fusions.values() if f.direct)
    assert "batch-cache decode attention: decode_attention" in fm.explain()


def test_lone_cache_keeps_mlx_attention(native_artifacts, monkeypatch):
    """A lone KVCache's decode passes no mask, which MLX's fused attention kernel takes: it stays."""
    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION", "1")
    model = fresh_model("llama")
    cache = make_prompt_cache(model)
    want = run(model, None, PROMPT)
    assert run(model, cache, PROMPT)[0] == want[0]
    assert all(f.calls.get("attention", 0) == 0 for f in mc.fused_model(model).fusions.values())


def test_attention_not_selected_says_why():
    model = fresh_model("llama")
    fm = mc.fused_model(model)
    if backend_of() != "cuda":
        assert "attention: MLX's sdpa (not faster here: on cpu, MLX's own attention" in fm.explain()


# ----------------------------------------------------------------------------- snapshots (docs/native.md)

def _numpy(tree) -> list[np.ndarray]:
    """Every array of a (nested) state as a numpy copy, in order."""
    out = []
    for x in tree:
        if isinstance(x, (list, tuple)):
            out.extend(_numpy(x))
        elif isinstance(x, mx.array):
            out.append(np.array(x))
    return out


def _assert_kept(before: list[np.ndarray], after: list[np.ndarray]):
    assert len(before) == len(after) > 0
    for i, (b, a) in enumerate(zip(before, after)):
        np.testing.assert_array_equal(a, b, err_msg=f"array {i} of the snapshot changed")


def _decode(model, caches, n: int, B: int = 1) -> np.ndarray:
    """n decode steps of B rows (tokens 5, 6, ...), each evaluated: the last position's logits."""
    return np.stack([np.array(model(mx.array([[5 + i]] * B), cache=caches)[:, -1]) for i in range(n)])


def _prefilled(model, prompts, steps: int, make=make_prompt_cache, merged: bool | None = None):
    """(caches, rows) after a prefill per request and `steps` decode steps: one request's caches, or
    (merged, default: with several requests) theirs merged into the batch classes as BatchGenerator
    merges them."""
    parts = []
    for p in prompts:
        c = make(model)
        mx.eval(model(mx.array([p]), cache=c))
        parts.append(c)
    merged = len(prompts) > 1 if merged is None else merged
    caches = [c[0].merge(list(c)) for c in zip(*parts)] if merged else parts[0]
    _decode(model, caches, steps, len(prompts))
    return caches, len(prompts)


@pytest.mark.parametrize("api", ["state", "copy.deepcopy"])
@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])      # gemma3: a rotating layer (window 8) too
def test_state_and_deepcopy_are_snapshots(native_artifacts, arch, batch, api):
    """cache.state and copy.deepcopy(cache) of KVCache, RotatingKVCache, BatchKVCache and
    BatchRotatingKVCache hand out values that the cache's later steps (written in place, past the
    window too) never change; the cache decodes on exactly as without the snapshot, and the
    snapshot's one copy is the cache's own concatenate: no copy-on-write in the launcher, no wait."""
    from registry import native
    model = fresh_model(arch)
    prompts = [PROMPT, PROMPT[:4]] if batch else [PROMPT]
    want = _decode(model, _prefilled(model, prompts, 2)[0], 10, len(prompts))
    caches, B = _prefilled(model, prompts, 2)
    held = [c.state for c in caches] if api == "state" else copy.deepcopy(caches)
    snapshot = (lambda: held) if api == "state" else (lambda: [c.state for c in held])
    before = _numpy(snapshot())
    native.reset_stats()
    got = _decode(model, caches, 10, B)
    st = native.stats()
    _assert_kept(before, _numpy(snapshot()))
    np.testing.assert_array_equal(got, want)
    assert st["launches"] > 0 and st["copies"] == 0 and st["syncs"] == 0, st


EXTRACT_CASES = {"llama, two requests": ("llama", [PROMPT, PROMPT[:4]], 2),
                 "gemma3, two requests": ("gemma3", [PROMPT, PROMPT[:4]], 2),
                 # the rows fill the buffer (window full, not wrapped): mlx-lm's mx.contiguous is a view
                 "gemma3, one request filling its window": ("gemma3", [PROMPT[:5]], 3)}


@pytest.mark.parametrize("case", list(EXTRACT_CASES))
def test_extract_is_a_snapshot(native_artifacts, case):
    """BatchKVCache / BatchRotatingKVCache.extract(i) (BatchGenerator's finished responses,
    extract_cache, remove(return_prompt_caches=True)) gives stock mlx-lm's caches, as buffers of their
    own: the batch's later steps never change them, evaluated or not, and they decode on without a
    wait or a copy-on-write."""
    from registry import native
    arch, prompts, steps = EXTRACT_CASES[case]
    model = fresh_model(arch)
    ref, _ = _prefilled(model, prompts, steps, stock.make_prompt_cache, merged=True)
    want = [[c.extract(i) for c in ref] for i in range(len(prompts))]
    caches, B = _prefilled(model, prompts, steps, merged=True)
    got = [[c.extract(i) for c in caches] for i in range(B)]
    evaluated = _numpy([c.state for c in got[0]])               # request 0's: evaluated now, the others lazy
    for g, w in zip(got, want):
        for gc, wc in zip(g, w):
            assert type(gc).__name__ == type(wc).__name__ and gc.kernel is not None
            assert gc.offset == wc.offset and gc.keys.shape == wc.keys.shape
            assert getattr(gc, "_idx", None) == getattr(wc, "_idx", None)
            for a, b in ((gc.keys, wc.keys), (gc.values, wc.values)):
                np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=0)
    lazy = [[c.extract(i) for c in caches] for i in range(B)]
    lazy_want = _numpy([[c.state for c in g] for g in got])
    native.reset_stats()
    _decode(model, caches, 10, B)                                # past the window: every ring slot rewritten
    _assert_kept(evaluated, _numpy([c.state for c in got[0]]))
    _assert_kept(lazy_want, _numpy([[c.state for c in g] for g in lazy]))
    _decode(model, lazy[-1], 3)
    st = native.stats()
    assert st["copies"] == 0 and st["syncs"] == 0, st


def test_trimmed_copy_decodes_without_changing_the_original(native_artifacts):
    """The server's prompt-cache reuse: copy.deepcopy of a stored cache, trim_prompt_cache on the copy,
    decode it and the original in turn; a state snapshot taken before stays as it was through a trim
    of the original too (the next steps overwrite the trimmed rows in place). Both decode as stock
    mlx-lm's caches after the same calls, with no copy-on-write and no wait."""
    from registry import native
    model = fresh_model("llama")                 # KVCache: trimmable (a full rotating window is not)

    def flow(make):
        cache, _ = _prefilled(model, [PROMPT], 2, make)
        snap = [c.state for c in cache]
        before = _numpy(snap)
        dup = copy.deepcopy(cache)
        assert stock.trim_prompt_cache(dup, 3) == 3
        native.reset_stats()
        steps = [_decode(model, c, 4) for c in (dup, cache, dup)]
        assert stock.trim_prompt_cache(cache, 5) == 5
        steps.append(_decode(model, cache, 4))
        return np.concatenate(steps), before, _numpy(snap), native.stats()

    want = flow(stock.make_prompt_cache)[0]
    got, before, after, st = flow(make_prompt_cache)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    _assert_kept(before, after)
    assert st["launches"] > 0 and st["copies"] == 0 and st["syncs"] == 0, st


def test_batch_generate_returns_prompt_caches_as_snapshots(native_artifacts):
    """batch_generate(return_prompt_caches=True) with the drop-in caches: each request's cache as stock
    returns it (taken when the request finished, while the others kept decoding), fused, and
    generate_step continues it as stock's."""
    from types import SimpleNamespace
    model = fresh_model("gemma3")
    tokenizer = SimpleNamespace(eos_token_ids=[], decode=lambda ids: "")
    prompts, kw = BATCH_PROMPTS[:3], dict(max_tokens=[3, 10, 6], return_prompt_caches=True)
    want = gen.batch_generate(model, tokenizer, prompts, **kw)
    got = gen.batch_generate(model, tokenizer, prompts, prompt_caches=[make_prompt_cache(model) for _ in prompts],
                             **kw)
    # The CPU computes both the same to 1e-4. Elsewhere float32 matmuls may run in TF32 (CUDA), and the
    # drop-in's one q/k/v projection sums in another order than stock's three: the cached keys and
    # values then differ by up to ~3e-3 (measured on the H200), as in assert_same_up_to_noise.
    atol = 1e-4 if mx.default_device() == mx.cpu else 1e-2
    for g, w in zip(got.caches, want.caches):
        for gc, wc in zip(g, w):
            assert type(gc).__name__ == type(wc).__name__ and gc.kernel is not None and gc.offset == wc.offset
            for a, b in zip(_numpy(gc.state), _numpy(wc.state)):
                np.testing.assert_allclose(a, b, atol=atol, rtol=0)
    assert run(model, got.caches[0], [9], 4)[0] == run(model, want.caches[0], [9], 4)[0]


def test_a_snapshot_of_a_buffer_not_yet_computed_is_copied_with_advice_for_cache_users(native_artifacts, caplog):
    """A state snapshot taken between two forwards with no evaluation refers to buffers the cache can
    not yet copy itself: the launcher writes through its copy-on-write (the snapshot keeps its values)
    and warns with what applies to a drop-in cache user, naming the layer, not a kernel caller's advice."""
    from registry import native
    model = fresh_model("llama")
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    model(mx.array([[4]]), cache=cache)
    snap = [c.state for c in cache]
    native.reset_stats()
    with caplog.at_level("WARNING", logger="registry"):
        model(mx.array([[5]]), cache=cache)
    st = native.stats()
    ref = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=ref))
    mx.eval(model(mx.array([[4]]), cache=ref))
    _assert_kept(_numpy([c.state for c in ref]), _numpy(snap))
    assert st["copies"] == 2 * len(cache), st
    messages = [r.getMessage() for r in caplog.records if "copy-on-write" in r.getMessage()]
    assert len(messages) == 1 and "layer 0's KVCache buffer of the drop-in cache" in messages[0], messages
    assert "Rebind the returned pools" not in messages[0]


def test_lone_cache_windowed_mask_attends_through_the_kernel(native_artifacts, monkeypatch):
    """A lone KVCache handed an array mask with a window (mlx-lm's make_mask(window_size=...)):
    decode_attention reads the buffer with the window as data and gives MLX's masked result."""
    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION", "1")
    model = fresh_model("llama")
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    c, attn = cache[0], find_attention_layers(model)[0][0]
    mask = c.make_mask(1, return_array=False, window_size=4)
    H, D = c.keys.shape[1], c.keys.shape[-1]
    keys, values = c.update_and_fetch(mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D)))
    q = mx.random.normal((1, attn.n_heads, 1, D))
    got = c.direct_attend(attn, q, mask)
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    assert got is not None and mask.shape == (1, len(PROMPT) + 1)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=0)
