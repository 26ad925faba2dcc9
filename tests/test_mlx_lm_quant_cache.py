"""The drop-in cache's quantized form (registry/integrations/mlx_lm_quant_cache.py) inside mlx-lm 0.32.2's
own generate_step: make_prompt_cache(kv_bits=...) and generate_step(kv_bits=...) give mlx-lm's
QuantizedKVCache class with the kernels' writes and attention; f32 greedy tokens and log-probs as
mlx-lm's own QuantizedKVCache; unfused (NoPE) layers on the plain quantized store; the CUDA
attention path (dequantize + fused sdpa) on any device; save/load in mlx-lm's file; BatchGenerator
batching the drop-in where stock's QuantizedKVCache cannot (tests/test_mlx_lm_quant_batch.py: the
batch cache itself). Runs on the default device (CPU in CI; the GPU host too)."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest

from registry.core import backend_of
from registry.integrations import mlx_lm_cache as mc
from registry.integrations import mlx_lm_quant_cache as mq
from registry.integrations.coverage import ARCHS
from registry.integrations.mlx_lm import build_model, import_mlx_lm_module, make_prompt_cache
from tests.test_mlx_lm_cache import NEW, PROMPT, PROMPTS, batch_run, run

stock = import_mlx_lm_module("cache")
FORWARDS = NEW + 2       # generate_step: a prefill chunk, then one forward per token and one ahead
# head_dim 64: every group size divides it (the coverage table's tiny models have 16 or 32)
WIDE = dict(hidden_size=128, num_attention_heads=4, head_dim=64)
ON_CPU = backend_of(None) == "cpu"


def model_of(arch: str, dtype=mx.float32):
    mx.random.seed(0)
    return build_model(dict(ARCHS[arch], **WIDE), dtype=dtype)


def stock_quantized(model, bits, gs):
    """mlx-lm's own quantized caches from the first token (what make_prompt_cache(kv_bits=...) mirrors)."""
    return [stock.QuantizedKVCache(group_size=gs, bits=bits) if type(c) is stock.KVCache else c
            for c in stock.make_prompt_cache(model)]


def stock_or_skip(model, cache, **kw):
    try:
        return run(model, cache, PROMPT, **kw)
    except RuntimeError as e:   # MLX 0.32.4's CUDA quantized_matmul has no kernel for these shapes
        if "No implementation for problem shape" not in str(e):
            raise
        pytest.skip(f"stock mlx-lm's quantized KV cache does not run on {mx.default_device()}: {e}")


# A last-bit difference of a rotated key (the kernel's fp32 RoPE against mx.fast.rope) can move a
# quantized value by one step (the group's range / 255 at 8 bits), which moves the log-probs by up to
# ~1e-3 in these tiny models (3e-4 measured, gemma3 at 8 bits): tokens must match exactly.
LOGPROB_ATOL = 2e-3


def assert_close(got, want, atol=LOGPROB_ATOL):
    assert got[0] == want[0], (got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("bits, gs", [(8, 32), (8, 64), (4, 64)])
def test_greedy_tokens_match_mlx_lms_quantized_cache(native_artifacts, arch, bits, gs):
    """f32: the tokens of mlx-lm's own QuantizedKVCache, log-probs within LOGPROB_ATOL; every layer writes
    through rope_quant_pool_fused (the norm form for qwen3), in place, nothing through mlx-lm."""
    model = model_of(arch)
    own = stock_quantized(model, bits, gs)
    want = stock_or_skip(model, own)
    cache = make_prompt_cache(model, kv_bits=bits, kv_group_size=gs)
    assert all(type(c).__name__ == "QuantizedKVCache" and isinstance(c, mq.QuantizedKVCache) for c in cache)
    assert_close(run(model, cache, PROMPT), want)
    plan = mc.fused_model(model).quant[(bits, gs)]
    for i, q in plan.items():
        assert q.fusion is not None and q.fusion.calls["fused"] == FORWARDS, (i, q.fusion.calls)
        # decode steps attend through decode_attention_quantized, the prefill chunk through mlx-lm's / MLX's
        assert q.calls["attention"] == FORWARDS - 1 and q.attention.implementation == f"native-{backend_of(None)}"
        assert q.calls["stock"] == 0 and (q.fusion.norm_kernel is not None) == (arch == "qwen3")
        assert q.fusion.kernel.implementation == f"native-{backend_of(None)}"
    for c, o in zip(cache, own):
        assert (c.offset, c.bits, c.group_size) == (o.offset, bits, gs)
        assert [x.shape for x in (*c.keys, *c.values)] == [x.shape for x in (*o.keys, *o.values)]


def test_decode_attention_off_runs_the_fallback_attention(native_artifacts, monkeypatch):
    """MLX_AOT_DECODE_ATTENTION_QUANTIZED=0: every forward attends through the fallback (mlx-lm's quantized
    attention here, dequantize + sdpa on CUDA), with the same tokens."""
    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION_QUANTIZED", "0")
    model = model_of("qwen3")
    want = stock_or_skip(model, stock_quantized(model, 4, 32))
    cache = make_prompt_cache(model, kv_bits=4, kv_group_size=32)
    assert_close(run(model, cache, PROMPT), want, atol=LOGPROB_ATOL * 4)
    plan = mc.fused_model(model).quant[(4, 32)]
    fallback = "dequantized" if backend_of(None) == "cuda" else "mlx-lm"
    assert all(q.attention is None and q.calls[fallback] == FORWARDS and not q.calls["attention"] for q in plan.values())
    assert "decode attention not a kernel (disabled by MLX_AOT_DECODE_ATTENTION_QUANTIZED=0)" in plan[0].describe()


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_attention_matches_the_fallback_on_any_device(native_artifacts, monkeypatch, bits):
    """Where mlx-lm's own quantized cache cannot run (CUDA), the oracle of the decode attention kernel
    is the caches' own fallback attention (dequantize + MLX's sdpa there, mlx-lm's quantized attention
    on the CPU): the same caches' tokens, log-probs within LOGPROB_ATOL."""
    model = model_of("qwen3")
    want = run(model, make_prompt_cache(model, kv_bits=bits, kv_group_size=64), PROMPT)
    assert all(q.calls["attention"] == FORWARDS - 1 for q in mc.fused_model(model).quant[(bits, 64)].values())
    monkeypatch.setenv("MLX_AOT_DECODE_ATTENTION_QUANTIZED", "0")
    other = model_of("qwen3")
    assert_close(run(other, make_prompt_cache(other, kv_bits=bits, kv_group_size=64), PROMPT), want,
                 atol=LOGPROB_ATOL * (4 if bits == 4 else 1))
    assert all(q.attention is None for q in mc.fused_model(other).quant[(bits, 64)].values())


def test_generate_step_kv_bits_converts_to_the_drop_in_quantized_cache(native_artifacts):
    """generate_step(kv_bits=..., quantized_kv_start=4) converts the float drop-in caches with their
    to_quantized: the result is the drop-in QuantizedKVCache (mlx-lm's name and state), the tokens
    stock's."""
    model = model_of("llama")
    kw = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=4)
    want = stock_or_skip(model, stock.make_prompt_cache(model), **kw)
    cache = make_prompt_cache(model)
    assert_close(run(model, cache, PROMPT, **kw), want)
    assert all(isinstance(c, mq.QuantizedKVCache) and c.bits == 8 for c in cache)
    assert all(q.fusion.calls["fused"] > 0 for q in mc.fused_model(model).quant[(8, 64)].values())


@pytest.mark.parametrize("bits", [8, 4])
def test_the_cuda_attention_path_on_any_device(native_artifacts, monkeypatch, bits):
    """The attention the caches run on CUDA (where MLX 0.32.4's quantized_matmul has no kernel for these
    shapes): the valid rows dequantized and MLX's fused sdpa. Forced here on the default device: the
    tokens of mlx-lm's own quantized attention."""
    model = model_of("llama")
    want = stock_or_skip(model, stock_quantized(model, bits, 64))
    monkeypatch.setattr(mq, "_backend", lambda quant: "cuda")
    cache = make_prompt_cache(model, kv_bits=bits, kv_group_size=64)
    got = run(model, cache, PROMPT)
    assert_close(got, want, atol=LOGPROB_ATOL * (4 if bits == 4 else 1))
    # the prefill chunk dequantizes; the decode steps go to the kernel
    assert all(q.calls["dequantized"] == 1 and q.calls["attention"] == FORWARDS - 1 and q.calls["mlx-lm"] == 0
               for q in mc.fused_model(model).quant[(bits, 64)].values())


def test_unfused_layers_write_through_the_quantized_store(native_artifacts):
    """smollm3's NoPE layer (3) is not fused: its keys arrive as the forward made them and
    kv_quant_pool_store quantizes them into the buffers; the RoPE layers fuse; tokens as stock."""
    model = model_of("smollm3 (NoPE layers)")
    want = stock_or_skip(model, stock_quantized(model, 8, 64))
    cache = make_prompt_cache(model, kv_bits=8, kv_group_size=64)
    assert_close(run(model, cache, PROMPT), want)
    plan = mc.fused_model(model).quant[(8, 64)]
    assert plan[3].fusion is None and plan[3].calls["store"] == FORWARDS and plan[3].calls["stock"] == 0
    assert all(plan[i].fusion.calls["fused"] == FORWARDS for i in (0, 1, 2))
    assert "the layer applies no RoPE (NoPE)" in plan[3].describe()
    text = mc.fused_model(model).explain()
    assert "layers 0-2, quantized 8-bit, group size 64: writes rope_quant_pool_fused" in text
    assert "layers 3, quantized 8-bit, group size 64: writes kv_quant_pool_store" in text


def test_a_format_without_kernels_runs_mlx_lms_own_writes(native_artifacts):
    """3-bit: no kernel implements it (their requires say why); the caches still are the drop-in class,
    writing through mlx-lm's own update, and give stock's tokens."""
    model = model_of("llama")
    want = stock_or_skip(model, stock_quantized(model, 3, 64))
    cache = make_prompt_cache(model, kv_bits=3, kv_group_size=64)
    assert_close(run(model, cache, PROMPT), want)
    plan = mc.fused_model(model).quant[(3, 64)]
    assert all(q.fusion is None and q.store is None and q.calls["stock"] == FORWARDS for q in plan.values())
    assert "kv_quant_pool_store not selected: the KV cache is not 4- or 8-bit" in plan[0].describe()


def test_save_and_load_in_mlx_lms_own_format(native_artifacts, tmp_path):
    """save_prompt_cache writes mlx-lm's file (stock load_prompt_cache reads QuantizedKVCache objects);
    load_prompt_cache here binds them again, and the generation continues as the original does."""
    model = model_of("qwen3")
    cache = make_prompt_cache(model, kv_bits=8, kv_group_size=64)
    run(model, cache, PROMPT, n=3)
    path = str(tmp_path / "q.safetensors")
    stock.save_prompt_cache(path, cache, {"who": "test"})
    plain = stock.load_prompt_cache(path)
    assert [type(c) for c in plain] == [stock.QuantizedKVCache] * 2
    for a, b in zip(plain, cache):
        assert a.offset == b.offset and (a.bits, a.group_size) == (8, 64)
        for x, y in zip([*a.keys, *a.values], [*b.keys, *b.values]):
            assert mx.array_equal(x, y).item()
    loaded, meta = mc.load_prompt_cache(path, model, return_metadata=True)
    assert meta == {"who": "test"} and all(isinstance(c, mq.QuantizedKVCache) for c in loaded)
    twin = copy.deepcopy(cache)
    assert twin[0]._quant is cache[0]._quant and twin[0].keys[0] is not cache[0].keys[0]
    assert_close(run(model, loaded, [5, 6], n=4), run(model, twin, [5, 6], n=4))


def test_batch_generator_batches_the_drop_in_where_stock_refuses(native_artifacts):
    """mlx-lm 0.32.2 has no quantized batch cache: BatchGenerator merges per-request caches with the
    class's merge, which its QuantizedKVCache lacks (ValueError). The drop-in class merges into
    BatchQuantizedKVCache (tests/test_mlx_lm_quant_batch.py), with each request's tokens alone."""
    model = model_of("llama")
    with pytest.raises(ValueError, match="does not yet support batching with history"):
        batch_run(model, PROMPTS[:2], n=2, caches=[stock_quantized(model, 8, 64) for _ in PROMPTS[:2]])
    got = batch_run(model, PROMPTS[:2], n=4, caches=[make_prompt_cache(model, kv_bits=8, kv_group_size=64)
                                                    for _ in PROMPTS[:2]])
    from tests.test_mlx_lm_quant_batch import assert_as_alone

    assert_as_alone(got, [run(model, make_prompt_cache(model, kv_bits=8, kv_group_size=64), p, n=4) for p in PROMPTS[:2]])


def test_mlx_lms_own_quantized_caches_keep_mlx_lms_attention(native_artifacts, monkeypatch):
    """The wrapped quantized_scaled_dot_product_attention sends only the drop-in caches' keys to them:
    mlx-lm's own QuantizedKVCache gets mlx-lm's function, bit for bit as without the wrapper."""
    base = import_mlx_lm_module("base")
    model = model_of("llama")
    make_prompt_cache(model, kv_bits=8, kv_group_size=64)          # installs the wrapper (once)
    wrapper = base.quantized_scaled_dot_product_attention
    assert wrapper._mlx_aot_wrapped and not getattr(wrapper.__wrapped__, "_mlx_aot_wrapped", False)
    got = stock_or_skip(model, stock_quantized(model, 8, 64))
    monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", wrapper.__wrapped__)
    want = run(model, stock_quantized(model, 8, 64), PROMPT)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("kw, message", [
    (dict(kv_bits=7), r"make_prompt_cache: kv_bits must be one of 2, 3, 4, 5, 6, 8 \(mx.quantize's affine "
                      r"formats\), got 7"),
    (dict(kv_bits=8, kv_group_size=48), r"kv_group_size must be one of 32, 64, 128, got 48"),
    (dict(kv_bits=True), r"kv_bits must be one of"),
])
def test_bad_formats_name_the_argument(kw, message):
    with pytest.raises(ValueError, match=message):
        make_prompt_cache(model_of("llama"), **kw)


def test_rotating_caches_stay_float(native_artifacts):
    """mlx-lm cannot quantize a rotating cache (its to_quantized raises): gemma3's sliding-window layers
    keep the float drop-in RotatingKVCache, its global layers get the quantized class; the tokens of the
    same mix of mlx-lm's own caches."""
    model = model_of("gemma3")
    own = stock_quantized(model, 8, 32)     # gemma3's tiny head_dim is 32
    want = stock_or_skip(model, own)
    cache = make_prompt_cache(model, kv_bits=8, kv_group_size=32)
    assert [type(c).__name__ for c in cache] == [type(c).__name__ for c in own]
    assert {type(c) for c in cache} == {mc.RotatingKVCache, mq.QuantizedKVCache}
    assert_close(run(model, cache, PROMPT), want)


@pytest.mark.parametrize("arch", ["llama", "smollm3 (NoPE layers)"])
def test_a_kept_state_is_a_snapshot(native_artifacts, arch):
    """state hands out the buffers (words, scales, biases per side) as a snapshot: the kernels' next
    in-place writes (rope_quant_pool_fused, kv_quant_pool_store in smollm3's NoPE layer) never reach
    it (docs/native.md, "Snapshots")."""
    model = model_of(arch)
    cache = make_prompt_cache(model, kv_bits=8, kv_group_size=64)
    run(model, cache, PROMPT, n=2)
    kept = [c.state for c in cache]
    before = [[np.array(x) if x.dtype == mx.uint32 else np.array(x.astype(mx.float32)) for x in (*k, *v)]
              for k, v, *_ in kept]
    run(model, cache, [9, 8, 7], n=3)
    for (k, v, *_), want in zip(kept, before):
        for x, w in zip((*k, *v), want):
            np.testing.assert_array_equal(np.array(x) if x.dtype == mx.uint32 else np.array(x.astype(mx.float32)), w)
    assert all(c.offset > kept[0][2] for c in cache)


def test_quant_decode_benchmark_runs_and_reports_memory(native_artifacts, capsys, tmp_path):
    """benchmarks/quant_decode.py (the GPU host's measurement of issue 35's targets) on a tiny size: one
    line per mode, no pool copied, the quantized caches' memory at the ideal fraction of bf16's."""
    import json

    from benchmarks.quant_decode import main

    out = tmp_path / "q.json"
    main(["--size", "tiny-llama", "--batch", "2", "--context", "300", "--steps", "2", "--rounds", "1",
          "--group-size", "32", "--json", str(out)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("tiny-llama")]
    assert len(lines) == 3 and all("pool copies 0" in ln for ln in lines), lines
    res = json.loads(out.read_text())["results"]
    assert res["q8"]["kv_bytes"] / res["bf16"]["kv_bytes"] == pytest.approx((1 + 2 * 2 / 32) / 2)
    assert res["q4"]["kv_bytes"] / res["bf16"]["kv_bytes"] == pytest.approx((0.5 + 2 * 2 / 32) / 2)
    assert all(r["tokens_per_s"] > 0 for r in res.values())
