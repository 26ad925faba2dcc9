"""The quantized drop-in cache in mlx-lm 0.32.2's BatchGenerator (registry/integrations/mlx_lm_quant_cache.py,
BatchQuantizedKVCache): per-request make_prompt_cache(model, kv_bits=...) caches merged, extended,
filtered and extracted by mlx-lm's own loop; f32 greedy tokens of each request as it gets alone
through generate_step (and on mlx-lm's own QuantizedKVCache where stock runs); decode attention on
decode_attention_quantized with each row's valid range; no pool copy and no wait whichever request
finishes first; snapshots. Runs on the default device (CPU in CI; the GPU host too)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from registry.core import backend_of
from registry.integrations import mlx_lm_cache as mc
from registry.integrations import mlx_lm_quant_cache as mq
from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_model, import_mlx_lm_module, make_prompt_cache
from tests.test_mlx_lm_cache import FINISHING, _assert_kept, _numpy, run
from tests.test_mlx_lm_quant_cache import LOGPROB_ATOL, WIDE, assert_close, stock_quantized

gen = importlib.import_module("mlx_lm.generate")
stock = import_mlx_lm_module("cache")

# Left padding 0, 7 and 4 in the batch; the first prompt's prefill (8 tokens) goes to the decode
# attention kernel, a 12-token one's (11 > 8) to the fallback attention.
PROMPTS = [[3, 17, 42, 99, 7, 8, 9, 10, 11], [11, 5], [200, 1, 2, 3, 4], [7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 12, 13]]
FALLBACK = "dequantized" if backend_of(None) == "cuda" else "mlx-lm"


def model_of(arch: str):
    """A wide tiny model (every group size divides head_dim 64) with its matrices times 4: at mlx-lm's
    init scale these models repeat one token, which makes token comparisons weak (tests/_model_dir.py)."""
    mx.random.seed(0)
    model = build_model(dict(ARCHS[arch], **WIDE), dtype=mx.float32)
    model.update(tree_unflatten([(k, v * 4 if v.ndim >= 2 else v) for k, v in tree_flatten(model.parameters())]))
    return model


def generate(model, prompts, max_tokens, caches=None, **kw):
    """mlx-lm's own BatchGenerator: (tokens, log-probs) per prompt, and the finished requests' caches."""
    g = gen.BatchGenerator(model, stop_tokens=[], max_tokens=max(max_tokens), **kw)
    uids = g.insert(prompts, max_tokens, caches=caches)
    toks, lps, done = {u: [] for u in uids}, {u: [] for u in uids}, {}
    while responses := g.next_generated():
        for r in responses:
            toks[r.uid].append(r.token)
            lps[r.uid].append(np.array(r.logprobs))
            if r.finish_reason is not None:
                done[r.uid] = r.prompt_cache
    g.close()
    return [toks[u] for u in uids], [np.stack(lps[u]) for u in uids], [done[u] for u in uids]


def quantized(model, bits, gs):
    return lambda: make_prompt_cache(model, kv_bits=bits, kv_group_size=gs)


def alone(model, prompts, max_tokens, make):
    """Each request through generate_step on its own caches."""
    return [run(model, make(), p, n=n) for p, n in zip(prompts, max_tokens)]


def assert_as_alone(got, want, atol=1e-4):
    """Batched against alone, on the same caches' kernels. Quantizing a row depends on that row only
    and the attention reads each row's valid range, so on the CPU the tokens are the same and the
    log-probs within 1e-4 (the attention's summation order; the prompts are chosen so that each
    request's prefill takes the same attention path batched and alone: a last-bit difference of a
    key can move its quantized value one step, ~1e-3 in these models). On a GPU the batch's GEMMs and
    the lone run's GEMVs are other kernels, whose last-bit differences (full float32: tests/conftest.py
    turns MLX's TF32 off) can move a quantized value: tokens up to the first near-tie of the lone run
    (top-2 log-probs within NEAR_TIE), log-probs within GPU_ATOL up to there."""
    for i, (toks, lps, (wt, wl)) in enumerate(zip(got[0], got[1], want)):
        n = len(wt)
        if mx.default_device() != mx.cpu:
            top2 = -np.sort(-wl, axis=1)[:, :2]
            ties = np.flatnonzero(top2[:, 0] - top2[:, 1] < NEAR_TIE)
            n, atol = (int(ties[0]) if len(ties) else n), GPU_ATOL
        assert len(toks) == len(wt) and toks[:n] == wt[:n], f"request {i}: {toks} vs alone {wt} (compared {n})"
        np.testing.assert_allclose(lps[:n + 1], wl[:n + 1], atol=atol, rtol=0, err_msg=f"request {i}")


# H200, 93f061c: at most 0.029 apart (smollm3, 8 bits, from the 5th token on: a moved quantized value).
# The CPU holds batching to 1e-4; here the bound is about 3x what was seen. A near-tie is a top-2 gap
# that two such differences can close.
GPU_ATOL = 0.1
NEAR_TIE = 2 * GPU_ATOL


def plan(model, bits, gs):
    return mc.fused_model(model).quant[(bits, gs)]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "capture"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("bits, gs", [(8, 64), (4, 32)])
def test_batch_generator_gives_each_requests_tokens(native_artifacts, monkeypatch, arch, bits, gs, direct):
    """BatchGenerator merges the per-request quantized caches into BatchQuantizedKVCache: every forward
    writes through rope_quant_pool_fused (the norm form for qwen3) in place, through the direct
    forward or the rope capture (the batch's offset array as the rope's offset), the decode steps
    attend through decode_attention_quantized, the long prefill chunk through the fallback; each
    request's f32 greedy tokens are those it gets alone (log-probs within 1e-4) and those of mlx-lm's
    own QuantizedKVCache (where stock runs: not on CUDA)."""
    monkeypatch.setenv("MLX_AOT_DIRECT_ATTENTION", "1" if direct else "0")
    model = model_of(arch)
    n = [6, 9, 7, 8]
    want = alone(model, PROMPTS, n, quantized(model, bits, gs))
    for q in plan(model, bits, gs).values():
        q.calls.clear()
        q.fusion.calls.clear()
    writers = []
    original = mc._Fused._write

    def spy(self, *a, **kw):
        writers.append(type(self).__name__)
        return original(self, *a, **kw)

    monkeypatch.setattr(mc._Fused, "_write", spy)
    got = generate(model, PROMPTS, n, [quantized(model, bits, gs)() for _ in PROMPTS])
    assert_as_alone(got, want)
    assert set(writers) == {"BatchQuantizedKVCache"}
    for i, q in plan(model, bits, gs).items():
        # one prefill chunk (11 tokens: the fallback), then decode steps of every request left: the kernel
        assert q.calls[FALLBACK] == 1 and q.calls["attention"] >= max(n) and q.calls["stock"] == 0, (i, q.calls)
        assert q.fusion.calls["fused"] == q.calls["attention"] + 1 and q.fusion.calls["stock"] == 0
        assert q.attention.implementation == f"native-{backend_of(None)}"
        assert (q.fusion.norm_kernel is not None) == (arch == "qwen3") and q.fusion.direct == direct
    if backend_of(None) != "cuda":      # MLX 0.32.4's CUDA quantized_matmul has no kernel for stock's attention
        for (toks, lps), p, m in zip(want, PROMPTS, n):
            assert_close((toks, lps), run(model, stock_quantized(model, bits, gs), p, n=m))


@pytest.mark.parametrize("order", list(FINISHING))
def test_requests_finish_in_any_order_without_copies_or_waits(native_artifacts, order):
    """Whichever request finishes first (filter, shifting the buffers past the padding the others
    share), or joins while others decode (extend): the launcher writes the batch buffers in place as
    they are, with no copy and no wait; each request's tokens are its own alone, and each finished
    request gets its rows (extract) as a QuantizedKVCache of the layer."""
    from registry import native
    model = model_of("llama")
    max_tokens, kw = FINISHING[order]
    prompts = PROMPTS[:len(max_tokens)]
    make = quantized(model, 8, 64)
    want = alone(model, prompts, max_tokens, make)
    native.reset_stats()
    got = generate(model, prompts, max_tokens, [make() for _ in prompts], **kw)
    st = native.stats()
    assert st["launches"] > 0 and st["syncs"] == 0 and st["first_use_checks"] == 0 and st["copies"] == 0, st
    assert_as_alone(got, want)
    for p, m, cache in zip(prompts, max_tokens, got[2]):
        # the step that yields a request's last token has fed it: the prompt and m tokens
        assert all(type(c) is mq.QuantizedKVCache and c.kernel is not None for c in cache)
        assert [c.offset for c in cache] == [len(p) + m] * len(cache)


def _merged(model, prompts, steps: int, bits=8, gs=64):
    """Per-request caches prefilled, merged as BatchGenerator merges them, then `steps` decode steps."""
    parts = []
    for p in prompts:
        c = make_prompt_cache(model, kv_bits=bits, kv_group_size=gs)
        mx.eval(model(mx.array([p]), cache=c))
        parts.append(c)
    caches = [c[0].merge(list(c)) for c in zip(*parts)]
    assert all(type(c) is mq.BatchQuantizedKVCache and c.kernel is not None for c in caches)
    return caches, _decode(model, caches, steps, len(prompts))


def _decode(model, caches, n: int, B: int) -> np.ndarray:
    return np.stack([np.array(model(mx.array([[5 + i]] * B), cache=caches)[:, -1]) for i in range(n)])


def test_extract_and_state_are_snapshots(native_artifacts):
    """extract(i) gives request i's rows as a QuantizedKVCache of the layer (mlx-lm's state: its offset
    and the rows without the padding), and state hands out the batch buffers: the batch's later
    in-place writes never change either, with no copy and no wait; the extracted cache decodes on as
    the request's lone cache; from_state rebuilds the batch (mlx-lm's quantized update, unbound)."""
    from registry import native
    model = model_of("qwen3")
    prompts = [PROMPTS[0], PROMPTS[1]]
    caches, _ = _merged(model, prompts, 2)
    held = [c.state for c in caches]
    kept = _numpy(held)
    got = [[c.extract(i) for c in caches] for i in range(2)]
    evaluated = _numpy([c.state for c in got[0]])
    lazy = _numpy([c.state for c in got[1]])
    assert [c.offset for c in got[1]] == [len(prompts[1]) + 2] * len(caches)
    assert got[1][0].keys[0].shape[2] == len(prompts[1]) + 2 and got[1][0].bits == 8
    twin = [mq.BatchQuantizedKVCache.from_state(s) for s in held]
    native.reset_stats()
    after = _decode(model, caches, 5, 2)
    st = native.stats()
    assert st["launches"] > 0 and st["copies"] == 0 and st["syncs"] == 0, st
    _assert_kept(kept, _numpy(held))
    _assert_kept(evaluated, _numpy([c.state for c in got[0]]))
    _assert_kept(lazy, _numpy([c.state for c in got[1]]))
    np.testing.assert_allclose(_decode(model, twin, 5, 2), after, atol=1e-3, rtol=0)
    lone = make_prompt_cache(model, kv_bits=8, kv_group_size=64)
    mx.eval(model(mx.array([prompts[1]]), cache=lone))
    _decode(model, lone, 2, 1)
    np.testing.assert_allclose(_decode(model, got[1], 4, 1), _decode(model, lone, 4, 1), atol=1e-4, rtol=0)


def test_filter_keeps_rows_without_copies(native_artifacts):
    """filter([0, 2]) (the longest prompt gone: the kept rows' shared padding shifted off) keeps those
    rows' decode exactly as the unfiltered batch's, its buffers new arrays the kernels write in place."""
    from registry import native
    model = model_of("llama")
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[2]]      # left padding 10, 0, 7
    want = _decode(model, _merged(model, prompts, 2)[0], 4, 3)[:, [0, 2]]
    caches, _ = _merged(model, prompts, 2)
    for c in caches:
        c.filter([0, 2])
    assert all(c._idx == len(PROMPTS[3]) + 2 - 7 and c.left_padding.tolist() == [3, 0] for c in caches)
    native.reset_stats()
    got = _decode(model, caches, 4, 2)
    st = native.stats()
    assert st["launches"] > 0 and st["copies"] == 0 and st["syncs"] == 0, st
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["decode attention off", "cuda attention path", "NoPE layer: the store",
                                  "3 bits: mlx-lm's writes"])
def test_batches_without_the_fused_paths(native_artifacts, monkeypatch, case):
    """The batch cache's other paths, each request's tokens as alone: the fallback attention with the
    batch's array mask (mlx-lm's quantized attention; on CUDA the valid rows dequantized and MLX's sdpa,
    forced here on any device), kv_quant_pool_store at the batch's slots (smollm3's NoPE layer 3), and
    a format no kernel implements (mlx-lm's mx.quantize and slice assignment)."""
    arch, bits, gs = "llama", 8, 64
    if case == "decode attention off":
        monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION_QUANTIZED", "0")
    elif case == "cuda attention path":
        monkeypatch.setattr(mq, "_backend", lambda quant: "cuda")
    elif case.startswith("NoPE"):
        arch = "smollm3 (NoPE layers)"
    else:
        bits = 3
    model = model_of(arch)
    n, prompts = [5, 7, 6], PROMPTS[:3]
    if case in ("decode attention off", "cuda attention path"):     # every prefill past 8 tokens: the fallback
        prompts = [PROMPTS[3], PROMPTS[0] + [1, 2], PROMPTS[3][:10]]
    want = alone(model, prompts, n, quantized(model, bits, gs))
    for q in plan(model, bits, gs).values():
        q.calls.clear()
    got = generate(model, prompts, n, [quantized(model, bits, gs)() for _ in prompts])
    assert_as_alone(got, want, atol=1e-4 if bits == 8 else 1e-3)
    layers = plan(model, bits, gs)
    if case == "decode attention off":
        assert all(q.calls["mlx-lm" if backend_of(None) != "cuda" else "dequantized"] > max(n) for q in layers.values())
    elif case == "cuda attention path":
        assert all(q.calls["dequantized"] == 1 and q.calls["attention"] >= max(n) and q.calls["mlx-lm"] == 0
                   for q in layers.values())
    elif case.startswith("NoPE"):
        assert layers[3].fusion is None and layers[3].calls["store"] > max(n) and layers[3].calls["stock"] == 0
    else:
        assert all(q.calls["stock"] > max(n) for q in layers.values())


def test_generate_step_keeps_the_quantized_drop_in(native_artifacts):
    """generate_step(kv_bits=...) on caches that are quantized already (the drop-in's): mlx-lm's
    maybe_quantize_kv_cache converts only caches with to_quantized, so they stay the same objects
    and the tokens are those without kv_bits."""
    model = model_of("llama")
    want = run(model, make_prompt_cache(model, kv_bits=8, kv_group_size=64), PROMPTS[0])
    cache = make_prompt_cache(model, kv_bits=8, kv_group_size=64)
    before = list(cache)
    got = run(model, cache, PROMPTS[0], kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    assert got[0] == want[0] and all(a is b for a, b in zip(cache, before))
    assert not hasattr(mq.BatchQuantizedKVCache, "to_quantized") and not hasattr(mq.QuantizedKVCache, "to_quantized")


def test_finished_caches_save_and_load_in_mlx_lms_own_format(native_artifacts, tmp_path):
    """A request's cache from BatchGenerator (extract: QuantizedKVCache) saves as mlx-lm's file, which
    stock load_prompt_cache reads and ours binds again; it continues as the unsaved one does."""
    model = model_of("qwen3")
    got = generate(model, PROMPTS[:2], [3, 5], [quantized(model, 8, 64)() for _ in PROMPTS[:2]])
    cache = got[2][1]
    path = str(tmp_path / "q.safetensors")
    stock.save_prompt_cache(path, cache)
    plain = stock.load_prompt_cache(path)
    assert [type(c) for c in plain] == [stock.QuantizedKVCache] * len(cache)
    assert [c.offset for c in plain] == [c.offset for c in cache]
    loaded = mc.load_prompt_cache(path, model)
    assert all(type(c) is mq.QuantizedKVCache and c.kernel is not None for c in loaded)
    assert_close(run(model, loaded, [5, 6], n=4), run(model, cache, [5, 6], n=4), atol=1e-5)


def test_merge_checks_formats_and_merges_empty_caches(native_artifacts):
    """merge of caches of different formats names them; merge of empty caches is an empty batch of
    those rows (BatchGenerator's fresh requests), which the first prefill fills."""
    model = model_of("llama")
    a, b = make_prompt_cache(model, kv_bits=8, kv_group_size=64), make_prompt_cache(model, kv_bits=4, kv_group_size=64)
    with pytest.raises(ValueError, match=r"BatchQuantizedKVCache.merge: the caches have different formats "
                                         r"\(4-bit, group size 64, 8-bit, group size 64\)"):
        a[0].merge([a[0], b[0]])
    empty = a[0].merge([a[0], make_prompt_cache(model, kv_bits=8, kv_group_size=64)[0]])
    assert empty.empty() and empty.offset.tolist() == [0, 0] and empty._quant is a[0]._quant
    assert (empty.bits, empty.group_size) == (8, 64) and empty.nbytes == 0
