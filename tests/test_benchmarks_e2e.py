"""`bench --e2e`: the end-to-end harness on the CPU at tiny sizes (a seconds-long smoke run, the CLI's
argument errors, the report's target verdicts). No assertion depends on how fast anything is."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from click.testing import CliRunner

from benchmarks import e2e, report
from benchmarks.cli import bench
from benchmarks.e2e import E2ECell
from registry.core import backend_of


def run_cli(*args):
    return CliRunner().invoke(bench, ["--e2e", *args], catch_exceptions=False)


def test_smoke_run_writes_every_output(tmp_path):
    out = run_cli("--smoke", "--json", str(tmp_path / "e.json"), "--markdown", str(tmp_path / "e.md"),
                  "--plot", str(tmp_path / "e.png"))
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "e.json").read_text())
    cells = doc["cells"]
    factory, _ = e2e.fused_cache_factory()
    want = {"mlx_lm", "module", "reference", "fused"} | ({"mlx_lm_fused_cache"} if factory else set())
    assert {(c["batch"], c["mode"]) for c in cells} == {(b, m) for b in (1, 2) for m in want}
    for c in cells:
        assert (c["size"], c["prompt"], c["dtype"]) == ("tiny-llama", 16, "bfloat16")
        assert c["decode_tokens_per_s"] > 0 and c["prefill_tokens_per_s"] > 0 and c["rounds"] == 1
    if not factory:                                         # skipped, and the reason says why
        assert {s["mode"] for s in doc["skipped"]} == {"mlx_lm_fused_cache"}
        assert "make_prompt_cache" in doc["skipped"][0]["reason"]
    assert doc["info"]["mlx"] == mx.__version__ and doc["info"]["commit"] and doc["command"]
    assert any("float32 tokens identical" in c for c in doc["info"]["checks"])
    assert any("bfloat16 logits agree with mlx-lm" in c for c in doc["info"]["checks"])
    md = (tmp_path / "e.md").read_text()
    assert "| tiny-llama | bfloat16 | 2 | 16 |" in md
    # The CPU target applies on the CPU; a GPU run states the GPU targets instead.
    assert ("CPU: fused >= module" in md) == (backend_of(None) == "cpu")
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, flag, says", [
    (["--sizes", "llama-70b"], "--sizes", "'llama-70b' is not one of llama-8b"),
    (["--modes", "fused,vllm"], "--modes", "'vllm' is not one of mlx_lm"),
    (["--batches", "0"], "--batches", "positive integers"),
    (["--batches", "two"], "--batches", "positive integers"),
    (["--prompts", ""], "--prompts", "positive integers"),
    (["--decode-tokens", "1"], "--decode-tokens", "1 is not in the range x>=2"),
    (["--batches", "32", "--prompts", "128", "--decode-tokens", "64", "--pool-size", "1000"], "--pool-size",
     "cannot hold batch 32 x (prompt 128 + 64 decode tokens - 1) = 6112"),
    (["--layers", "4"], "--layers", "not options of --e2e"),
    (["--dtypes", "float8"], "--dtypes", "'float8' is not one of"),
    # pools past half the machine's memory (were a numpy ValueError, an OverflowError, or a hang)
    (["--smoke", "--prompts", "99999999999999999999"], "--prompts", "GiB of pools; at most half of this machine"),
    (["--smoke", "--decode-tokens", "99999999999999999999"], "--decode-tokens", "GiB of pools; at most half"),
    (["--smoke", "--pool-size", "99999999999999999999"], "--pool-size", "GiB of pools; at most half"),
    (["--smoke", "--batches", "100000000"], "--batches", "1900000000 KV slots need"),
    (["--kv-bits", "3"], "--kv-bits", "'3': expected a comma list of none, 8, 4"),
    (["--kv-bits", "8,float"], "--kv-bits", "expected a comma list of none, 8, 4"),
    (["--kv-bits", ","], "--kv-bits", "expected a comma list of none, 8, 4"),
    (["--kv-group-size", "48"], "--kv-group-size", "'48' is not one of '32', '64', '128'"),
    (["--smoke", "--kv-bits", "none,8", "--modes", "mlx_lm,fused"], "--kv-bits",
     "the slot engine's modes (fused) have float pools only"),
    # 16384 and 12288 tokens in 512-token chunks: the shorter rows decode 8 steps early
    (["--smoke", "--batches", "4", "--prompts", "16384", "--prefill-step-size", "512", "--decode-tokens", "9"],
     "--decode-tokens", "8 steps before the longest's first token"),
])
def test_bad_arguments_name_the_flag(args, flag, says):
    out = run_cli(*args)
    assert out.exit_code == 2 and flag in out.output and says in out.output, out.output


def test_e2e_options_need_e2e():
    out = CliRunner().invoke(bench, ["--sizes", "tiny-llama", "--smoke"])
    assert out.exit_code == 2 and "--sizes, --smoke: only with --e2e" in out.output
    out = CliRunner().invoke(bench, ["--kv-bits", "8", "--kv-group-size", "32"])
    assert out.exit_code == 2 and "--kv-bits, --kv-group-size: only with --e2e" in out.output


def test_kv_bits_run_records_quantized_cells_memory_and_skips(tmp_path):
    """--kv-bits none,8: mlx-lm's two modes on the float and the 8-bit cache. Batch 1 runs all four;
    at batch 2 the drop-in runs quantized through BatchGenerator (its per-request caches merge into
    BatchQuantizedKVCache), stock cannot (its BatchGenerator takes no kv_bits, and its
    QuantizedKVCache has no merge): skipped with that reason, and the run goes on. Every cell
    records its KV memory; the 8-bit buffers are the format's share of the float ones."""
    out = run_cli("--smoke", "--no-check", "--kv-bits", "none,8", "--kv-group-size", "32", "--json",
                  str(tmp_path / "e.json"), "--markdown", str(tmp_path / "e.md"))
    assert out.exit_code == 0, out.output
    doc = json.loads((tmp_path / "e.json").read_text())
    factory, _ = e2e.fused_cache_factory()
    modes = {"mlx_lm"} | ({"mlx_lm_fused_cache"} if factory else set())
    # On CUDA stock's quantized attention raises (MLX 0.32.4's quantized_matmul has no kernel for it)
    stock_q8 = set() if backend_of(None) != "cuda" else {(1, "mlx_lm", 8)}
    got = {(c["batch"], c["mode"], c["kv_bits"]): c for c in doc["cells"]}
    assert set(got) == (({(1, m, b) for m in modes for b in (None, 8)} - stock_q8) | {(2, m, None) for m in modes}
                        | {(2, m, 8) for m in modes - {"mlx_lm"}})
    for (batch, mode, bits), c in got.items():
        assert ("kv_group_size" in c) == (bits is not None) and c.get("kv_group_size", 32) == 32
        assert c["kv_peak_bytes"] >= c["kv_decode_peak_bytes"] > 0 and c["kv_cache_bytes"] > 0
        assert c["kv_peak_bytes"] >= c["kv_cache_bytes"] * (bits or 16) / 16 * 0.5
    for b, m in {(b, m) for b in (1, 2) for m in modes if (b, m, 8) in got}:
        # buffers of 256 rows either way: 32 features at 8 bits + a bf16 scale and bias
        q, f = got[(b, m, 8)], got[(b, m, None)]
        assert q["kv_cache_bytes"] / f["kv_cache_bytes"] == report.kv_ideal(8, 32, "bfloat16") == (1 + 4 / 32) / 2
        assert q["floor_tokens_per_s"] > f["floor_tokens_per_s"]
    skipped = {(s["batch"], s["mode"], s["kv_bits"]): s for s in doc["skipped"]}
    assert set(skipped) == {(2, "mlx_lm", 8)} | stock_q8
    assert "BatchGenerator takes no kv_bits" in skipped[(2, "mlx_lm", 8)]["reason"]
    assert all(skipped[k]["reason"].startswith("could not run") for k in stock_q8)
    assert all(s["kv_group_size"] == 32 for s in skipped.values())
    md = (tmp_path / "e.md").read_text()
    assert "| tiny-llama | bfloat16 | 2 | 16 | q8 | skipped |" in md
    if factory:                                        # the drop-in's batch-2 q8 cell has its tokens/s
        assert re.search(r"\| tiny-llama \| bfloat16 \| 2 \| 16 \| q8 \| skipped \| [0-9.]+ \|", md), md
    assert "| tiny-llama | bfloat16 | 1 | 16 | q8 | " in md
    # one line per reason: batch 2 on every backend, batch 1 where stock's quantized attention raises
    assert "Skipped `mlx_lm q8` (1 cell: tiny-llama bfloat16 b2 p16): " in md
    assert ("Skipped `mlx_lm q8` (1 cell: tiny-llama bfloat16 b1 p16): " in md) == bool(stock_q8)
    assert doc["info"]["matrix"]["kv_bits"] == [None, 8] and doc["info"]["matrix"]["kv_group_size"] == 32
    cells, _ = report.load_e2e_json(tmp_path / "e.json")                 # and it reads back
    assert {c.kv_bits for c in cells} == {None, 8}


def test_a_group_size_the_head_dim_cannot_hold_is_skipped():
    """tiny-llama's head_dim is 32: group 64 cannot quantize it, said per variant before any run."""
    model = e2e.random_model(dict(e2e.SIZES["tiny-llama"].config, num_hidden_layers=1), mx.bfloat16)
    runner = e2e.Modes(model, ["mlx_lm"], 64, kv_bits=(None, 8), kv_group_size=64, head_dim=32)
    assert runner.variants == [("mlx_lm", None)]
    assert "head_dim 32 is not a multiple of --kv-group-size 64" in runner.skipped[("mlx_lm", 8)]
    with pytest.raises(ValueError, match="fused have no quantized cache"):
        e2e.Modes(model, ["mlx_lm", "fused"], 64, kv_bits=(None, 8))


def test_random_model_is_built_in_the_target_dtype():
    model = e2e.random_model(dict(e2e.SIZES["tiny-qwen3"].config, num_hidden_layers=1), mx.float16)
    from mlx.utils import tree_flatten
    params = dict(tree_flatten(model.parameters()))
    assert {v.dtype for v in params.values()} == {mx.float16}
    w = params["model.layers.0.mlp.down_proj.weight"]        # N(0, 1/(3 fan_in))
    assert abs(float(mx.std(w.astype(mx.float32))) * (3 * w.shape[1]) ** 0.5 - 1) < 0.05


def test_big_sizes_have_the_dims_the_issue_names():
    c8, c1 = e2e.SIZES["llama-8b"].config, e2e.SIZES["llama-1b"].config
    assert [c8[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                            "head_dim", "vocab_size", "intermediate_size")] == [32, 4096, 32, 8, 128, 128256, 14336]
    assert [c1[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                            "head_dim", "vocab_size", "intermediate_size")] == [16, 2048, 32, 8, 64, 128256, 8192]
    assert not any(e2e.SIZES[s].cpu for s in e2e.GPU_SIZES) and all(e2e.SIZES[s].cpu for s in e2e.CPU_SIZES)


def cell(mode, tps, batch=1, size="s"):
    return E2ECell(size, batch, 128, "bfloat16", mode, 64, tps, 1000.0, 1e3 / tps, 3)


def test_targets_compare_modes_within_each_cell():
    cells = [cell("mlx_lm", 100), cell("module", 95), cell("fused", 120),
             cell("mlx_lm", 400, 8), cell("module", 500, 8), cell("fused", 540, 8)]
    got = {name: (met, ev) for name, met, ev in report.e2e_targets(cells, "cuda")}
    assert got["fused >= 1.10x module (every cell)"][0] is False          # b8: 1.08x
    assert "worst 1.08x (s bfloat16 b8 p128)" in got["fused >= 1.10x module (every cell)"][1]
    assert got["batch 1: module within 10% of mlx_lm"][0] is True          # 0.95
    assert got["batch 1: fused >= mlx_lm"][0] is True
    assert [n for n, _, _ in report.e2e_targets(cells, "cpu")] == ["CPU: fused >= module (every cell)"]
    table = report.e2e_table(cells)
    assert "1.26" in table and "1.08" in table                             # fused/module per row


def test_ratios_pair_the_rounds_and_drop_in_targets():
    """A ratio of two modes is the median of the per-round ratios: a host that halves its speed for
    some rounds slows both modes of those rounds, which the ratio of the two medians would mistake
    for a difference between the modes."""
    stock = E2ECell("llama-8b", 1, 128, "bfloat16", "mlx_lm", 64, 0, 1000.0, 0, 5, decode_s=[1.0, 1.0, 2.0, 2.0, 2.0])
    fused = E2ECell("llama-8b", 1, 128, "bfloat16", "mlx_lm_fused_cache", 64, 0, 1000.0, 0, 5,
                    decode_s=[0.9, 1.8, 1.8, 1.8, 0.9])     # faster in every round
    for c in (stock, fused):
        c.decode_tokens_per_s = 63 / sorted(c.decode_s)[2]
    g = report._e2e_groups([stock, fused])[("llama-8b", "bfloat16", 1, 128, None)]
    assert stock.decode_tokens_per_s / fused.decode_tokens_per_s == 0.9     # medians: 2.0 vs 1.8 s
    assert report._ratio(g, "mlx_lm_fused_cache", "mlx_lm") == pytest.approx(1 / 0.9)   # every round 1/0.9
    assert "1.11 [1.11-1.11]" in report.e2e_markdown([stock, fused], [], {}, "cmd")
    got = {name: (met, ev) for name, met, ev in report.e2e_targets([stock, fused], "cuda")}
    assert got["drop-in cache: mlx_lm_fused_cache >= 1.05x mlx_lm at batch 1 (llama-8b)"][0] is True
    assert got["drop-in cache: mlx_lm_fused_cache never slower than mlx_lm (every cell)"][0] is True
    slow = E2ECell("llama-1b", 8, 128, "bfloat16", "mlx_lm_fused_cache", 64, 90.0, 1000.0, 0, 3)
    base = E2ECell("llama-1b", 8, 128, "bfloat16", "mlx_lm", 64, 100.0, 1000.0, 0, 3)   # no rounds: medians
    got = {name: (met, ev) for name, met, ev in report.e2e_targets([stock, fused, slow, base], "cuda")}
    met, ev = got["drop-in cache: mlx_lm_fused_cache never slower than mlx_lm (every cell)"]
    assert met is False and "worst 0.90x (llama-1b bfloat16 b8 p128)" in ev


def test_plot_draws_ratios_from_zero_and_the_summary_table():
    """The plot's bars are each mode's ratio to stock mlx-lm (per-round medians) on a linear axis from 0
    with the 1.0 line, not tokens/s on a log axis (where 1.15x looked like 3x); dropin_summary is the
    README's table of the drop-in cache against stock."""
    rounds = lambda *t: dict(decode_s=list(t))
    cells = [E2ECell("s", 1, 128, "bfloat16", "mlx_lm", 64, 100.0, 1.0, 0, 3, **rounds(1.0, 2.0, 1.0)),
             E2ECell("s", 1, 128, "bfloat16", "mlx_lm_fused_cache", 64, 115.0, 1.0, 0, 3, **rounds(0.8, 1.6, 0.9)),
             E2ECell("s", 1, 128, "bfloat16", "fused", 64, 90.0, 1.0, 0, 3, **rounds(1.1, 2.2, 1.1)),
             E2ECell("s", 8, 128, "bfloat16", "mlx_lm", 64, 400.0, 1.0, 0, 3, **rounds(1.0, 1.0, 1.0)),
             E2ECell("s", 8, 128, "bfloat16", "mlx_lm_fused_cache", 64, 380.0, 1.0, 0, 3, **rounds(1.0, 1.0, 1.1))]
    fig = report.e2e_figure(cells, "t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())
    heights = {c.get_label(): [round(p.get_height(), 4) for p in c] for c in ax.containers if hasattr(c, "patches")}
    assert heights == {"drop-in cache in mlx-lm's own loop": [round(1 / 0.8, 4), 1.0], "slot engine, fused": [round(1 / 1.1, 4)]}
    table = report.dropin_summary(cells)
    assert table.splitlines() == ["| model | batch 1 | batch 8 |", "|---|---|---|",
                                  "| s | **1.25x** (100 → 115) | **1.00x** (400 → 380) |"]
    assert report.dropin_summary(cells[2:3]) is None


def test_plot_without_matplotlib_refuses_to_start(tmp_path, monkeypatch):
    """Was a ModuleNotFoundError traceback after the whole run, with no output written."""
    import sys

    import benchmarks.runner as runner_mod

    monkeypatch.setitem(sys.modules, "matplotlib", None)           # import matplotlib raises ImportError
    monkeypatch.setattr(runner_mod, "host_info", lambda *a: pytest.fail("measured without matplotlib"))
    for args in (["--e2e", "--smoke"], ["--quick"]):
        res = CliRunner().invoke(bench, [*args, "--json", str(tmp_path / "a.json"), "--plot", str(tmp_path / "a.png")])
        assert res.exit_code == 2 and "'--plot'" in res.output and "pip install -e '.[bench]'" in res.output, res.output
        assert "Traceback" not in res.output and not list(tmp_path.iterdir())


def test_from_json_merges_runs_and_refuses_a_cell_twice(tmp_path):
    info = dict(backend="cuda", device="gpu", mlx=mx.__version__, date="2026-12-01T00:00:00Z", commit="abc",
                checks=["a check"], sizes={"s": "a size"})
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report.write_e2e_json(a, [cell("module", 100), cell("fused", 120)], [], info, "run a")
    report.write_e2e_json(b, [cell("module", 400, 8), cell("fused", 500, 8)], [], info, "run b")
    out = run_cli("--from-json", str(a), "--from-json", str(b), "--markdown", str(tmp_path / "m.md"))
    assert out.exit_code == 0, out.output
    assert "MET     fused >= 1.10x module (every cell): 2/2 cells" in out.output
    assert "Command: `run a ; run b`" in (tmp_path / "m.md").read_text()
    out = run_cli("--from-json", str(a), "--from-json", str(a))
    assert out.exit_code == 2 and "cell s bfloat16 1 128 module is also in" in out.output
    out = run_cli("--from-json", str(a), "--rounds", "2")
    assert out.exit_code == 2 and "--rounds do not apply" in out.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"info": {}, "cells": [{"size": "s"}]}')
    out = run_cli("--from-json", str(bad))
    assert out.exit_code == 2 and "cells[0] lacks batch" in out.output


@pytest.mark.parametrize("change, says", [
    (lambda d: d["info"].pop("backend"), "info lacks its 'backend'"),
    (lambda d: d["cells"].clear() or d["info"].pop("backend"), "info lacks its 'backend'"),
    (lambda d: d.update(skipped=[1]), "'skipped' is not a list of objects with a mode and a reason"),
    (lambda d: d["cells"][0].update(batch="8"), 'cells[0].batch is "8"; expected an integer'),
    (lambda d: d["cells"][0].update(decode_s="slow"), 'cells[0].decode_s is "slow"; expected a list of numbers'),
    (lambda d: d["cells"][0].update(kv_bits="8"), 'cells[0].kv_bits is "8"; expected an integer or null'),
    (lambda d: d["cells"][0].update(kv_bits=8), "cells[0] has kv_bits 8 but no kv_group_size"),
])
def test_from_json_with_wrong_values_is_a_usage_error(tmp_path, change, says):
    """Was a KeyError, TypeError or ValueError traceback from the report."""
    path = tmp_path / "a.json"
    report.write_e2e_json(path, [cell("module", 100)], [], dict(backend="cpu", mlx=mx.__version__), "run a")
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    out = CliRunner().invoke(bench, ["--e2e", "--from-json", str(path)])
    assert out.exit_code == 2 and f"{path}: {says}" in out.output, out.output


def test_prompt_lengths_floor_and_prefill_step(monkeypatch):
    """A batch's odd rows get three quarters of the nominal prompt; the floor counts the weights (less a
    separate head's embedding table) and the K/V rows (a sliding layer's at most its window);
    --prefill-step-size reaches mlx-lm's loops."""
    assert e2e.prompt_lengths(1, 100) == [100] and e2e.prompt_lengths(4, 100) == [100, 75, 100, 75]
    size = e2e.SIZES["tiny-gemma3"]
    model = e2e.random_model(size.config, mx.bfloat16)
    c = size.config
    short, long_ = e2e.step_bytes(model, c, [10], 2), e2e.step_bytes(model, c, [1000], 2)
    row = 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    sliding = sum(1 for i in range(c["num_hidden_layers"]) if (i + 1) % c["sliding_window_pattern"])
    full = c["num_hidden_layers"] - sliding
    assert long_ - short == row * (full * 990 + sliding * (c["sliding_window"] - 11))
    seen = []
    import importlib

    g = importlib.import_module("mlx_lm.generate")   # mlx_lm.generate, the attribute, is the function

    class Spy(g.BatchGenerator):
        def __init__(self, *a, **kw):
            seen.append(kw.get("prefill_step_size"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(g, "BatchGenerator", Spy)
    from registry.integrations.mlx_lm import make_own_cache

    e2e.run_mlx_lm(model, [[1, 2, 3], [4, 5]], 2, make_own_cache, prefill_step_size=2)
    e2e.run_mlx_lm(model, [[1, 2, 3], [4, 5]], 2, make_own_cache)
    assert seen == [2, None]


def test_step_bytes_of_quantized_caches():
    """A full layer's row on an 8- or 4-bit cache is its packed words plus a scale and a bias of the
    dtype per group; a sliding layer's stays float (mlx-lm cannot quantize a rotating cache)."""
    size = e2e.SIZES["tiny-gemma3"]
    c = size.config
    model = e2e.random_model(c, mx.bfloat16)
    H, D, item = c["num_key_value_heads"], c["head_dim"], 2
    sliding = sum(1 for i in range(c["num_hidden_layers"]) if (i + 1) % c["sliding_window_pattern"])
    full = c["num_hidden_layers"] - sliding
    for bits, g in ((8, 64), (4, 32), (None, 64)):
        row = 2 * H * (D * item if bits is None else D * bits // 8 + 2 * (D // g) * item)
        grow = e2e.step_bytes(model, c, [20], 2, bits, g) - e2e.step_bytes(model, c, [10], 2, bits, g)
        assert grow == 10 * (full * row + sliding * 2 * H * D * item)      # 11..21 rows: inside the window
    q8, f = e2e.step_bytes(model, c, [40], 2, 8, 64), e2e.step_bytes(model, c, [40], 2)
    assert f - q8 == full * 41 * 2 * H * (D * item - D - 2 * item)


def test_quantized_ratios_targets_and_the_readme_summary():
    """A quantized cell's drop-in is compared with stock on its format and with the drop-in on the float
    cache (per-round ratios); the target counts every quantized cell both ran; dropin_summary (README)
    keeps to the float cache."""
    def c(mode, bits, decode_s, batch=1, kv=None):
        cell = E2ECell("s", batch, 128, "bfloat16", mode, 64, 63 / sorted(decode_s)[1], 1.0, 0, 3,
                       decode_s=decode_s, kv_bits=bits, kv_group_size=None if bits is None else 64,
                       kv_decode_peak_bytes=kv)
        return cell
    cells = [c("mlx_lm", None, [1.0, 2.0, 1.0], kv=1000), c("mlx_lm_fused_cache", None, [0.8, 1.6, 0.8], kv=1000),
             c("mlx_lm", 8, [1.2, 2.4, 1.2]), c("mlx_lm_fused_cache", 8, [0.6, 1.2, 0.6], kv=540),
             c("mlx_lm_fused_cache", 4, [0.5, 1.0, 0.5], kv=330),           # stock skipped at 4 bits
             c("mlx_lm", 8, [1.0, 1.0, 1.0], batch=8), c("mlx_lm_fused_cache", 8, [1.25, 1.25, 1.25], batch=8)]
    groups = report._e2e_groups(cells)
    assert report._ratio(groups[("s", "bfloat16", 1, 128, 8)], "mlx_lm_fused_cache", "mlx_lm") == pytest.approx(2.0)
    assert report._over_float(groups, ("s", "bfloat16", 1, 128, 8)) == pytest.approx(0.8 / 0.6)
    assert report._over_float(groups, ("s", "bfloat16", 1, 128, None)) is None
    table = report.e2e_table(cells)
    assert any(line.split()[4] == "q8" and line.split()[-2:] == ["2.00", "1.33"] for line in table.splitlines()[1:])
    got = {name: (met, ev) for name, met, ev in report.e2e_targets(cells, "cpu")}
    met, ev = got["quantized drop-in >= stock mlx-lm's QuantizedKVCache (every cell both ran)"]
    assert met is False and "1/2 cells at or above; worst 0.80x (s bfloat16 b8 p128 q8)" in ev
    got = {name: (met, ev) for name, met, ev in report.e2e_targets(cells, "cuda")}
    met, ev = [v for k, v in got.items() if k.startswith("quantized drop-in: KV memory")][0]
    assert met is False and "1/2 cells within" in ev and "s bfloat16 b1 p128 q4 0.330 vs 0.281" in ev
    assert got["drop-in cache: mlx_lm_fused_cache never slower than mlx_lm (every cell)"][0] is True   # float only
    assert report.dropin_summary(cells).splitlines() == ["| model | batch 1 |", "|---|---|",
                                                         "| s | **1.25x** (63 → 79) |"]
    md = report.e2e_markdown(cells, [], {}, "cmd")
    assert "| s | bfloat16 | 1 | 128 | q8 | " in md and "1.33 [1.33-1.33] | 0.540 (0.531) |" in md


def test_batch_decode_is_timed_where_every_request_decodes(monkeypatch):
    """BatchGenerator runs one prefill chunk and one decode step per call, so the shorter prompts decode
    while the longest prefills: batch_lag counts those steps as mlx-lm schedules them, and decode_s is
    the time of the steps where every request decodes, scaled to n - 1 of them (prefill's chunks and
    the tail after the first request finishes left out)."""
    import importlib

    g = importlib.import_module("mlx_lm.generate")
    model = e2e.random_model(e2e.SIZES["tiny-llama"].config, mx.bfloat16)
    from registry.integrations.mlx_lm import make_own_cache

    for batch, prompt, step in [(4, 128, 16), (2, 64, 7), (4, 33, 8), (8, 128, 2048)]:
        lengths = e2e.prompt_lengths(batch, prompt)
        prompts = [[1 + i % 50 for i in range(n)] for n in lengths]
        gen = g.BatchGenerator(model, max_tokens=12, completion_batch_size=batch, prefill_batch_size=batch,
                               prefill_step_size=step)
        got = {u: 0 for u in gen.insert(prompts)}
        lag = None
        while responses := gen.next_generated():
            for r in responses:
                got[r.uid] += 1
            if lag is None and min(got.values()) >= 1:
                lag = max(got.values()) - 1
        gen.close()
        assert lag == e2e.batch_lag(lengths, step), (batch, prompt, step)
    # the window, on a clock that reads the calls of next_generated so far (a decode step each)
    calls = []
    monkeypatch.setattr(e2e.time, "perf_counter", lambda: float(len(calls)))
    original = g.BatchGenerator.next_generated

    def counted(self):
        calls.append(1)
        return original(self)

    monkeypatch.setattr(g.BatchGenerator, "next_generated", counted)
    run = e2e.run_mlx_lm(model, [[1] * 64, [2] * 48], 6, make_own_cache, prefill_step_size=8)
    lag = e2e.batch_lag([64, 48], 8)
    assert lag == 2 and [len(t) for t in run.tokens] == [6, 6]
    # from the call giving the longest its first token to the one giving the shorter its 6th: 6 - 1 - lag
    # calls of both requests decoding, 3 "seconds" for 6 tokens, scaled to 2 x 5 tokens
    assert run.decode_s == 5.0 and run.prefill_s >= 1, run
