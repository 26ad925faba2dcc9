"""The benchmark harness's logic on the CPU: what each case computes and touches, the timing protocol,
derived metrics, target verdicts, reports and the CLI. No assertion here depends on how fast anything is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from benchmarks import cases, report, runner
from benchmarks.cases import BenchmarkError, Shape
from benchmarks.cli import bench
from benchmarks.runner import Cell
from registry.core import backend_of
from registry.kernels.rope_pool_fused import RopePoolFusedKernel
from registry.paths import PROJECT_ROOT

TINY = Shape("tiny", 4, 2, 16, 12)   # partial RoPE, GQA 2


def ptr(a: mx.array) -> int:
    """Address of `a`'s buffer (CPU); bfloat16, which NumPy lacks, is viewed as uint16 (same buffer)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    mx.eval(a)
    return np.asarray(a).__array_interface__["data"][0]


def f32(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


class UnrotatedKernel:
    """A wrong 'fused' kernel: stores the pools correctly but returns q and k unrotated."""
    implementation = "broken-for-test"

    def __call__(self, q, k, v, positions, slots, k_pool, v_pool, check_slots=True):
        k_pool, v_pool = mx.array(k_pool), mx.array(v_pool)
        k_pool[slots] = k
        v_pool[slots] = v
        return q, k, k_pool, v_pool


def reference_kernel(rope):
    return RopePoolFusedKernel(rope, backend="cpu")


# ----------------------------------------------------------------------------- cases

def test_bytes_moved_counts_compulsory_traffic():
    s = cases.SHAPES["llama-8b"]
    q, kv = 8 * 32 * 128, 8 * 8 * 128
    reads, writes = q + 2 * kv, q + kv + 2 * kv   # q,k,v in; q_out, k_out, a k and a v pool row out
    assert cases.bytes_moved(s, 8, 2) == (reads + writes) * 2
    for shape in cases.SHAPES.values():
        for T in (1, 7, 2048):
            n = cases.copy_elements(shape, T)
            assert abs(2 * n * 4 - cases.bytes_moved(shape, T, 4)) <= 2 * 4  # read + write of the copy


def test_rope_variants_follow_the_shape():
    phi = cases.SHAPES["phi-4-mini-partial"]
    base = cases.rope_for(phi, "base")
    assert (base.rotary_dims, base.traditional, base.periods) == (96, False, None)
    freqs = cases.rope_for(phi, "freqs")
    assert freqs.base is None and len(freqs.periods) == 48
    plain = 500000.0 ** (np.arange(0, 96, 2) / 96)
    scaled = np.isclose(np.array(freqs.periods), plain * 8)
    assert scaled.any() and not scaled.all()  # a banded table, not a uniform rescale
    assert cases.rope_for(phi, "traditional").traditional
    with pytest.raises(KeyError, match="base, freqs, traditional"):
        cases.rope_for(phi, "yarn")


def test_layers_are_distinct_and_slots_injective():
    layers, positions, slots = cases.make_layers(TINY, 5, mx.float16, layers=3, seed=1)
    for name in ("q", "k", "v", "k_pool", "v_pool", "copy_src"):
        assert len({ptr(getattr(d, name)) for d in layers}) == 3, f"{name} shared between layers"
    assert not np.array_equal(f32(layers[0].q), f32(layers[1].q))
    d = layers[0]
    assert d.q.shape == (5, 4, 16) and d.k.shape == d.v.shape == (5, 2, 16)
    assert d.k_pool.shape == (cases.pool_size(5), 2, 16) == (4096, 2, 16) and not f32(d.k_pool).any()
    assert d.copy_src.size == cases.copy_elements(TINY, 5) and d.copy_src.dtype == mx.float16
    s = np.array(slots)
    assert len(set(s.tolist())) == 5 and s.min() >= 0 and s.max() < 4096
    assert np.array(positions).tolist() == list(range(cases.FIRST_POSITION, cases.FIRST_POSITION + 5))
    assert cases.pool_size(8192) == 16384


def _run_case(name, rope, seed=3, T=4, kernel=None):
    layers, positions, slots = cases.make_layers(TINY, T, mx.float32, layers=2, seed=seed)
    outs = cases.step_builders(kernel or reference_kernel(rope), rope, layers, positions, slots)[name]()
    mx.eval(outs)
    return outs, layers, positions, slots


@pytest.mark.parametrize("variant", cases.VARIANTS)
def test_cases_compute_the_same_step(variant):
    rope = cases.rope_for(TINY, variant)
    fused, fl, *_ = _run_case("fused", rope)
    mlx_out, ml, *_ = _run_case("mlx", rope)
    seed_out, sl, _, slots = _run_case("seed_loop", rope)
    assert len(fused) == len(mlx_out) == len(seed_out) == 8   # q, k, k_pool, v_pool per layer
    for a, b, c in zip(fused, mlx_out, seed_out):
        # fused computes the kernels' fp32 angles, mx.fast.rope its own: they differ by angle rounding.
        np.testing.assert_allclose(f32(a), f32(b), atol=cases.AGREEMENT_TOL["float32"])
        np.testing.assert_allclose(f32(c), f32(b), atol=1e-4)
    # The pools the layers hold afterwards are the updated ones (rebinding), with rows at the slots.
    for layers in (fl, ml, sl):
        kp = f32(layers[1].k_pool)
        written = np.zeros(kp.shape[0], bool)
        written[np.array(slots)] = True
        assert np.abs(kp[written]).sum() > 0 and not kp[~written].any()
    rotated = f32(mlx_out[0])[..., : rope.rotary_dims]
    assert not np.allclose(rotated, f32(ml[0].q)[..., : rope.rotary_dims])  # RoPE really ran
    np.testing.assert_array_equal(f32(mlx_out[0])[..., 12:], f32(ml[0].q)[..., 12:])  # pass-through tail


def test_trivial_and_copy_cases():
    rope = cases.rope_for(TINY, "base")
    triv, tl, *_ = _run_case("trivial", rope)
    assert len(triv) == 2
    np.testing.assert_array_equal(f32(triv[1]), 2 * f32(tl[1].q))
    copies, cl, *_ = _run_case("copy", rope)
    for out, d in zip(copies, cl):
        # A real copy of the layer's own source: new buffer, same bytes (a no-op would share it).
        assert ptr(out) != ptr(d.copy_src)
        np.testing.assert_array_equal(f32(out), f32(d.copy_src))


def test_mlx_path_scatters_in_place_when_the_pool_has_one_owner():
    """The fairness rule the harness relies on: each layer's LayerData is the pool's only owner, so
    MLX's `pool[slots] = x` reuses the pool buffer; an extra reference would force a full copy."""
    from registry import _ext

    rope = cases.rope_for(TINY, "base")
    layers, positions, slots = cases.make_layers(TINY, 4, mx.float32, layers=1, seed=5)
    d = layers[0]
    before = ptr(d.k_pool)
    # On CUDA, MLX's completion handlers release their references to the buffer some time after the
    # evaluation returns (docs/native.md); until then MLX cannot reuse it. Wait for that, at most 2 s.
    deadline = time.monotonic() + 2.0
    while _ext.owner_counts(d.k_pool)[1] > 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    mx.eval(cases.mlx_layer(d, positions, slots, rope, None))
    assert ptr(d.k_pool) == before
    extra = d.k_pool[0:]  # a second owner of the same buffer (a view)
    assert ptr(extra) == ptr(d.k_pool)
    mx.eval(cases.mlx_layer(d, positions, slots, rope, None))
    assert ptr(d.k_pool) != ptr(extra)


def test_check_agreement_accepts_the_reference_and_rejects_a_wrong_kernel():
    rope = cases.rope_for(TINY, "traditional")
    layers, positions, slots = cases.make_layers(TINY, 6, mx.bfloat16, layers=1, seed=2)
    pools = ptr(layers[0].k_pool), ptr(layers[0].v_pool)
    cases.check_agreement(reference_kernel(rope), rope, layers[0], positions, slots, "bfloat16")
    assert (ptr(layers[0].k_pool), ptr(layers[0].v_pool)) == pools and not f32(layers[0].k_pool).any()
    with pytest.raises(BenchmarkError, match=r"broken-for-test.*disagrees with MLX's path on q"):
        cases.check_agreement(UnrotatedKernel(), rope, layers[0], positions, slots, "bfloat16")


# ----------------------------------------------------------------------------- timing protocol

def test_time_steps_warms_up_interleaves_and_times_eval_separately():
    calls = []

    def builder(name, build_cost):
        def build_step():
            calls.append(name)
            if build_cost:
                time.sleep(build_cost)
            return [mx.ones((4,)) * 3]
        return build_step

    out = runner.time_steps({"a": builder("a", 0.002), "b": builder("b", 0.0)}, steps=20, warmup=2, rounds=3)
    assert calls[:4] == ["a", "a", "b", "b"]              # warm-up first, per case
    timed = calls[4:]
    assert timed.count("a") == timed.count("b") == 21     # >= steps, in 3 rounds of 7
    runs = [timed[0]] + [x for prev, x in zip(timed, timed[1:]) if x != prev]
    assert runs == ["a", "b"] * 3                          # cases alternate round by round
    (a_step, a_eval), (b_step, b_eval) = out["a"], out["b"]
    assert a_step >= a_eval + 0.002 and b_step >= b_eval > 0  # graph building counted in the step only


# ----------------------------------------------------------------------------- metrics and verdicts

def _cell(shape="llama-8b", T=1, dtype="bfloat16", variant="base", **us):
    return Cell(shape, T, dtype, variant, "native-cpu", us_per_layer=dict(us),
                eval_us_per_layer={k: v / 2 for k, v in us.items()}, bytes_per_layer=1_000_000)


def test_cell_derived_metrics():
    c = _cell(fused=10.0, mlx=25.0, trivial=8.0, copy=5.0)
    assert c.speedup_vs_mlx() == pytest.approx(2.5)
    assert c.ratio_to_trivial() == pytest.approx(1.25)
    assert c.bandwidth_gbs() == pytest.approx(100.0)       # 1 MB in 10 us
    assert c.bandwidth_share() == pytest.approx(0.5)       # copy moved it in 5 us
    assert c.ratio_to_trivial("eval") == pytest.approx(1.25)
    d = c.to_json()
    assert d["speedup_vs_mlx"] == pytest.approx(2.5) and d["fused_gbs"] == pytest.approx(100.0)
    bare = _cell(fused=10.0)
    assert bare.speedup_vs_mlx() is None and bare.ratio_to_trivial() is None and bare.bandwidth_share() is None


def test_gpu_targets():
    cells = [_cell(T=1, fused=12.0, mlx=30.0, trivial=10.0, copy=8.0),                # 1.2x trivial
             _cell(T=1, dtype="float32", fused=50.0, mlx=60.0, trivial=10.0, copy=8.0),  # f32: no decode target
             _cell(T=2048, dtype="float16", fused=100.0, mlx=300.0, trivial=60.0, copy=55.0),  # 55%
             _cell(T=8192, fused=100.0, mlx=300.0, trivial=60.0, copy=70.0)]          # 70%
    verdicts = {name: (met, ev) for name, met, ev in report.targets(cells, "cuda")}
    assert verdicts["never slower than MLX's own path (every cell)"][0]
    assert verdicts["T <= 512 (bf16/f16) within 1.3x of a trivial op"][0]
    met, evidence = verdicts["T >= 2048 (bf16/f16) at >= 60% of copy bandwidth"]
    assert not met and "1/2 cells" in evidence and "llama-8b T=2048 float16 base" in evidence
    cells.append(_cell(T=32, variant="traditional", fused=31.0, mlx=30.0, trivial=10.0, copy=8.0))
    verdicts = {name: (met, ev) for name, met, ev in report.targets(cells, "cuda")}
    met, evidence = verdicts["never slower than MLX's own path (every cell)"]
    assert not met and "llama-8b T=32 bfloat16 traditional" in evidence
    assert not verdicts["T <= 512 (bf16/f16) within 1.3x of a trivial op"][0]
    assert not any("CPU" in name for name in verdicts)


def test_cpu_targets():
    cells = [_cell(T=8, fused=10.0, mlx=40.0), _cell(T=128, fused=10.0, mlx=11.0)]
    verdicts = {name: met for name, met, _ in report.targets(cells, "cpu")}
    assert verdicts == {"never slower than MLX's own path (every cell)": True,
                        "CPU: >= 3x MLX's own path at T <= 32": True}   # T=128 is outside the 3x target
    cells.append(_cell(T=32, dtype="float32", fused=10.0, mlx=29.0))
    assert not dict((n, m) for n, m, _ in report.targets(cells, "cpu"))["CPU: >= 3x MLX's own path at T <= 32"]


# ----------------------------------------------------------------------------- reports

def test_table_rows_stay_aligned_with_missing_values():
    full = _cell(T=32, fused=10.0, mlx=25.0, seed_loop=900.0, trivial=8.0, copy=5.0)
    partial = _cell(shape="phi-4-mini-partial", T=8192, variant="traditional", fused=10.0, mlx=25.0)
    assert len(report.row(full)) == len(report.row(partial)) == len(report.HEADER)
    assert report.row(partial).split()[4:] == ["10.0", "25.0", "-", "-", "-", "2.50", "-", "100", "-"]


def test_json_roundtrip_markdown_and_plot(tmp_path):
    cells = [_cell(T=T, dtype=dt, variant=v, fused=10.0 * T, mlx=30.0 * T, trivial=8.0 * T, copy=5.0 * T)
             for T in (1, 2048) for dt in ("bfloat16", "float32") for v in ("base", "freqs")]
    info = {"backend": "cuda", "mlx": mx.__version__, "date": "2026-01-01T00:00:00Z", "commit": "abc1234"}
    path = tmp_path / "out" / "r.json"
    report.write_json(path, cells, info, "python -m benchmarks --quick")
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]   # no temporary file left behind
    loaded, doc = report.load_json(path)
    assert [c.to_json() for c in loaded] == [c.to_json() for c in cells]
    assert doc["command"] == "python -m benchmarks --quick" and doc["info"]["commit"] == "abc1234"
    md = report.markdown(loaded, doc["info"], doc["command"])
    assert "| 2048 | 20480.0 | 61440.0 | - | 16384.0 | 10240.0 | 3.00 / 3.00 | 1.25 / 1.25 | 0.50 / 0.50 |" in md
    assert "`python -m benchmarks --quick`" in md and "**not met**" in md
    png = tmp_path / "r.png"
    report.plot(png, loaded, "test", "cuda")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_load_json_names_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a readable benchmark JSON"):
        report.load_json(bad)
    bad.write_text(json.dumps({"info": {}, "cells": [{"shape": "x"}]}))
    with pytest.raises(ValueError, match=r"cells\[0\] lacks tokens"):
        report.load_json(bad)


# ----------------------------------------------------------------------------- CLI

def test_cli_runs_a_small_matrix(tmp_path):
    out = tmp_path / "b.json"
    res = CliRunner().invoke(bench, ["--shapes", "qwen3-0.6b", "--tokens", "1", "--dtypes", "float32",
                                     "--variants", "base,traditional", "--layers", "2", "--warmup", "1",
                                     "--commit", "feedbee", "--json", str(out), "--plot", str(tmp_path / "b.png"),
                                     "--markdown", str(tmp_path / "b.md")])
    assert res.exit_code == 0, res.output
    assert report.HEADER in res.output and "[2/2 " in res.output
    assert "never slower than MLX's own path" in res.output
    doc = json.loads(out.read_text())
    info = doc["info"]
    # The CPU target applies on the CPU only; the GPU targets are stated for bf16/f16 cells (not run here).
    assert ("CPU: >= 3x" in res.output) == (info["backend"] == "cpu")
    assert info["commit"] == "feedbee" and info["backend"] == backend_of(None) and info["mlx"] == mx.__version__
    assert {"date", "host", "platform", "gpu", "cpu_count", "seconds"} <= set(info)
    assert info["matrix"]["layers"] == 2 and info["matrix"]["variants"] == ["base", "traditional"]
    assert doc["command"].startswith("python -m ")
    assert [(c["tokens"], c["variant"]) for c in doc["cells"]] == [(1, "base"), (1, "traditional")]
    for c in doc["cells"]:
        assert set(c["us_per_layer"]) == set(c["eval_us_per_layer"]) == set(cases.CASES)
        assert c["bytes_per_layer"] == cases.bytes_moved(cases.SHAPES["qwen3-0.6b"], 1, 4)
    assert (tmp_path / "b.png").stat().st_size > 0 and "feedbee" in (tmp_path / "b.md").read_text()

    res = CliRunner().invoke(bench, ["--from-json", str(out), "--variants", "traditional"])
    assert res.exit_code == 0, res.output
    assert "traditional" in res.output and " base " not in res.output
    res = CliRunner().invoke(bench, ["--from-json", str(out), "--dtypes", "bfloat16"])
    assert res.exit_code == 2 and "no cell of" in res.output


def test_cli_merges_runs_and_refuses_duplicates(tmp_path):
    info = {"backend": "cuda", "mlx": mx.__version__, "commit": "c1", "matrix": {"layers": 32}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    report.write_json(a, [_cell(T=1, fused=10.0, mlx=20.0)], info, "bench --tokens 1")
    report.write_json(b, [_cell(T=8, fused=10.0, mlx=20.0)], dict(info, commit="c2"), "bench --tokens 8")
    merged = tmp_path / "m.json"
    res = CliRunner().invoke(bench, ["--from-json", str(a), "--from-json", str(b), "--json", str(merged)])
    assert res.exit_code == 0, res.output
    doc = json.loads(merged.read_text())
    assert [c["tokens"] for c in doc["cells"]] == [1, 8] and doc["command"] == "bench --tokens 1 ; bench --tokens 8"
    assert [m["commit"] for m in doc["info"]["merged_from"]] == ["c1", "c2"]
    res = CliRunner().invoke(bench, ["--from-json", str(a), "--from-json", str(merged)])
    assert res.exit_code == 2 and "cell llama-8b 1 bfloat16 base is also in" in res.output
    report.write_json(b, [_cell(T=8, fused=10.0, mlx=20.0)], dict(info, backend="cpu"), "x")
    res = CliRunner().invoke(bench, ["--from-json", str(a), "--from-json", str(b)])
    assert res.exit_code == 2 and "different backends" in res.output


_GOOD = dict(shape="llama-8b", tokens=1, dtype="bfloat16", variant="base", implementation="cpu",
             us_per_layer={"fused": 10.0, "mlx": 20.0}, bytes_per_layer=100)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not a readable benchmark JSON file"),
    ("[1, 2]", "expected an object with 'info' and a 'cells' list"),
    (json.dumps({"info": {"backend": "cpu"}, "cells": [1]}), "cells[0] lacks shape"),
    (json.dumps({"info": {}, "cells": [_GOOD]}), "info lacks its 'backend'"),
    (json.dumps({"info": {"backend": "cpu"}, "cells": [dict(_GOOD, tokens="8")]}),
     'cells[0].tokens is "8"; expected an integer'),
    (json.dumps({"info": {"backend": "cpu"}, "cells": [dict(_GOOD, us_per_layer={"fused": "x"})]}),
     "cells[0].us_per_layer is {\"fused\": \"x\"}; expected an object of numbers"),
])
def test_from_json_that_is_not_a_bench_file_is_a_usage_error(tmp_path, text, message):
    """A --from-json file that is not `bench --json`'s is a usage error naming the file and what is
    wrong (was a ValueError, TypeError, KeyError or AttributeError traceback)."""
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    res = CliRunner().invoke(bench, ["--from-json", str(bad)])
    assert res.exit_code == 2 and f"{bad}: " in res.output and message in res.output, res.output


@pytest.mark.parametrize("e2e", [[], ["--e2e"]])
def test_from_json_fifo_does_not_hang(tmp_path, e2e):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "benchmarks", *e2e, "--from-json", str(fifo)], capture_output=True,
                       text=True, cwd=PROJECT_ROOT, timeout=60)
    assert r.returncode == 2 and f"{fifo}: not a regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--tokens", "3"], "'3' is not one of 1, 8, 32"),
    (["--shapes", "llama-70b"], "'llama-70b' is not one of llama-8b"),
    (["--dtypes", ","], "empty list"),
    (["--steps", "5"], "5 is not in the range x>=20"),
])
def test_cli_rejects_bad_arguments(args, message):
    res = CliRunner().invoke(bench, args)
    assert res.exit_code == 2 and message in res.output


@pytest.mark.parametrize("extra, flag", [(e, f) for e in ([], ["--e2e"]) for f in ("--json", "--plot", "--markdown")]
                         + [(["--kernel", "kv_pool_store"], "--json")])   # the micro benchmarks write --json only
def test_outputs_that_cannot_be_written_are_refused_before_the_run(tmp_path, monkeypatch, flag, extra):
    """An output path under a file, or where no file can be created, is a usage error naming the flag and
    the path before anything is measured (the measurement would take minutes)."""
    import benchmarks.runner as runner_mod

    monkeypatch.setattr(runner_mod, "host_info", lambda *a: pytest.fail("measured before checking the outputs"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    res = CliRunner().invoke(bench, extra + [flag, str(blocker / "out" / "x.json")])
    assert res.exit_code == 2 and flag in res.output and f"{blocker} is not a directory" in res.output, res.output
    if os.path.isdir("/proc/self"):            # nobody, root included, creates a file in /proc
        res = CliRunner().invoke(bench, extra + [flag, "/proc/x.json"])
        assert res.exit_code == 2 and "/proc/x.json: cannot write there" in res.output, res.output
    res = CliRunner().invoke(bench, extra + [flag, str(tmp_path)])
    assert res.exit_code == 2 and "is a directory" in res.output, res.output


@pytest.mark.parametrize("args, message", [
    (["--layers", "257"], "'--layers': 257 is not in the range 1<=x<=256"),   # per-layer inputs: memory
    (["--kernel", "kv_pool_store", "--layers", "99999999999"], "'--layers': 99999999999 is not in the range"),
    (["--json", ""], "'--json': an empty path; expected a file path"),       # was "." , written after the run
    (["--e2e", "--markdown", ""], "'--markdown': an empty path"),
])
def test_bad_arguments_are_refused_before_the_run(monkeypatch, args, message):
    import benchmarks.runner as runner_mod

    monkeypatch.setattr(runner_mod, "host_info", lambda *a: pytest.fail("measured before checking the arguments"))
    res = CliRunner().invoke(bench, args)
    assert res.exit_code == 2 and message in res.output, res.output


def test_a_write_that_fails_after_the_run_is_an_error_naming_the_file(tmp_path, monkeypatch):
    """A write that fails once the run is over (a full disk) is a clear error, not a traceback, and
    leaves no temporary file."""
    info = {"backend": "cpu", "mlx": mx.__version__, "commit": "c1", "matrix": {"layers": 32}}
    a = tmp_path / "a.json"
    report.write_json(a, [_cell(T=1, fused=10.0, mlx=20.0)], info, "bench --tokens 1")

    def full(self, *args):
        raise OSError(28, "No space left on device")

    out = tmp_path / "m.md"
    monkeypatch.setattr(report.os, "replace", full)
    res = CliRunner().invoke(bench, ["--from-json", str(a), "--markdown", str(out)])
    assert res.exit_code == 1 and f"{out}: cannot write it (No space left on device)" in res.output, res.output
    assert "Traceback" not in res.output and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_entry_points():
    res = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=PROJECT_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "--quick" in res.stdout and "--from-json" in res.stdout
    import click
    from build_tools.cli import cli
    assert cli.get_command(click.Context(cli), "bench") is bench   # `python -m build_tools bench`


def test_pool_layout_variants_read_and_write_the_same_rows():
    """benchmarks.pool_layout compares like with like: its three gathers of a slot table give the same
    context rows, its two run reads the same run, and its three writes the same pools."""
    from benchmarks import pool_layout

    mx.random.seed(0)
    built = {name: build() for name, build in pool_layout.ops(3, 5, 2, 4, layers=2, dtype=mx.float32).items()}
    gathers = [np.array(v) for k, v in built.items() if k.startswith("gather")]
    runs = [np.array(v) for k, v in built.items() if k.startswith("run")]
    assert len(gathers) == 3 and len(runs) == 2
    for got in gathers[1:]:
        np.testing.assert_allclose(got, gathers[0], rtol=1e-5)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
    slot_major = [np.array(p) for p in built["write: slot-major pool[slots] ="]]
    for name in ("write: head-major pool[:, :, slots] =", "write: head-major put_along_axis"):
        for sm, hm in zip(slot_major, built[name]):
            np.testing.assert_array_equal(np.array(hm)[0].transpose(1, 0, 2), sm, err_msg=name)


@pytest.mark.parametrize("args, message", [(["--shapes", "8x1"], "expected batch x context x kv heads x head_dim"),
                                           (["--shapes", "8x0x1x1"], "every dimension must be positive"),
                                           (["--layers", "0"], "expected an integer from 1 to 256"),
                                           (["--shapes", "100000x100000x8x128"], "MLX's ops take at most 2^31 - 1"),
                                           (["--shapes", "1000x1000x8x128", "--layers", "256"],
                                            "GiB of pools; at most half of this machine's memory")])
def test_pool_layout_bad_arguments_name_the_flag(args, message):
    r = subprocess.run([sys.executable, "-m", "benchmarks.pool_layout", *args], capture_output=True, text=True,
                       cwd=PROJECT_ROOT, timeout=120)
    assert r.returncode == 2 and f"argument {args[0]}" in r.stderr and message in r.stderr, r.stderr


@pytest.mark.parametrize("layers", ["0", "-3", "257"])
def test_graph_count_bad_layers_name_the_flag(layers):
    r = subprocess.run([sys.executable, "-m", "benchmarks.graph_count", "--layers", layers], capture_output=True,
                       text=True, cwd=PROJECT_ROOT, timeout=120)
    assert r.returncode == 2 and "argument --layers" in r.stderr and "from 1 to 256" in r.stderr, r.stderr


def test_node_cost_times_every_kind(capsys):
    """benchmarks.node_cost prints one row per kind, with its node's inputs/outputs and finite times."""
    from benchmarks import node_cost
    node_cost.main(["--nodes", "2", "--tokens", "1", "--steps", "1"])
    rows = [r.split() for r in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == list(node_cost.KINDS)
    for r in rows:
        assert r[-4] == "%d/%d" % node_cost.edges(r[0]) and all(float(x) > 0 for x in r[-3:]), r
    from registry.kernels.qk_norm_rope_pool_fused import QkNormRopePoolFusedKernel
    assert node_cost.edges("aot_qk_norm") == (len(QkNormRopePoolFusedKernel.INPUTS), 4)


@pytest.mark.parametrize("args, message", [(["--kinds", "aot,add"], "expected a comma-separated list of"),
                                           (["--tokens", "0"], "expected an integer from 1 to 4096"),
                                           (["--nodes", "x"], "expected an integer from 1 to 256")])
def test_node_cost_bad_arguments_name_the_flag(args, message):
    r = subprocess.run([sys.executable, "-m", "benchmarks.node_cost", *args], capture_output=True, text=True,
                       cwd=PROJECT_ROOT, timeout=120)
    assert r.returncode == 2 and f"argument {args[0]}" in r.stderr and message in r.stderr, r.stderr


@pytest.mark.parametrize("what", ["empty", "fifo"])
def test_graph_time_summarize_of_no_file_says_so(tmp_path, what):
    """--summarize '' ran the whole benchmark instead (an empty value read as no --summarize); a FIFO hung."""
    path = ""
    if what == "fifo":
        path = str(tmp_path / "g.csv")
        os.mkfifo(path)
    r = subprocess.run([sys.executable, "-m", "benchmarks.graph_time", "--summarize", path], capture_output=True,
                       text=True, cwd=PROJECT_ROOT, timeout=60)
    says = "not a regular file" if what == "fifo" else "cannot read it (No such file or directory)"
    assert r.returncode == 1 and f"--summarize {path}: {says}" in r.stderr, r.stderr


# ----------------------------------------------------------------------------- decode attention

def attention_run(tmp_path, *extra):
    from benchmarks import attention

    out, txt = tmp_path / "a.json", tmp_path / "a.txt"
    attention.main(["--cells", "2x64", "--layers", "1", "--steps", "1", "--json", str(out), "--txt", str(txt),
                    "--commit", "abc1234", *extra])
    return json.loads(out.read_text()), txt.read_text()


def test_attention_quantized_case_writes_every_field(tmp_path, capsys):
    """A tiny --quantized cell: every case timed, a floor per format from the rows' bytes, each kernel's
    error against its reference within tolerance, the run's provenance, and the text table."""
    from benchmarks import attention

    data, txt = attention_run(tmp_path, "--quantized")
    for key in ("date", "host", "device", "mlx", "commit", "command", "kernel", "heads", "layers", "steps",
                "copy_tb_per_s", "launcher", "seconds"):
        assert key in data, key
    assert data["commit"] == "abc1234" and data["kernel"] == "decode_attention_quantized"
    assert data["command"].startswith("python -m benchmarks.attention ") and "--quantized" in data["command"]
    (cell,) = data["cells"]
    cases = ["kernel_bf16", "kernel_q8", "kernel_q4", "mlx_dequantized_q8", "mlx_dequantized_q4"]
    assert (cell["batch"], cell["context"], cell["dtype"], cell["group_size"]) == (2, 64, "bfloat16", 64)
    assert list(cell["us_per_layer"]) == cases and all(v > 0 for v in cell["us_per_layer"].values())
    assert list(cell["fraction_of_floor"]) == cases
    floor = cell["floor_us_per_layer"]
    # a row of head_dim 128: bf16 256 bytes; 8 bits 128 + 2 x 2 groups x 2 bytes; 4 bits 64 + 8
    assert cell["floor_speedup"] == pytest.approx({"q8": 256 / 136, "q4": 256 / 72})
    assert floor["bf16"] > floor["q8"] > floor["q4"] > 0
    for case, share in cell["fraction_of_floor"].items():
        assert share == pytest.approx(floor[case.rsplit("_", 1)[-1]] / cell["us_per_layer"][case])
    assert set(cell["speedup"]) == {"q8", "q4"}
    us = cell["us_per_layer"]
    assert cell["speedup"]["q8"] == pytest.approx(us["kernel_bf16"] / us["kernel_q8"])
    assert set(cell["max_err"]) == {"kernel_bf16", "kernel_q8", "kernel_q4"}
    assert cell["max_err"]["kernel_bf16"] <= attention.TOL["bfloat16"]
    assert max(cell["max_err"]["kernel_q8"], cell["max_err"]["kernel_q4"]) <= attention.QUANT_TOL["bfloat16"]
    assert txt.startswith("decode_attention_quantized micro on ") and "commit abc1234" in txt
    assert all(c + " us (share)" in txt for c in cases) and "q4 vs bf16 (floor)" in txt
    assert txt in capsys.readouterr().out


def test_attention_float_case_writes_every_field(tmp_path):
    data, txt = attention_run(tmp_path, "--dtype", "float32")
    (cell,) = data["cells"]
    assert data["kernel"] == "decode_attention" and cell["dtype"] == "float32"
    assert list(cell["us_per_layer"]) == ["kernel", "mlx_masked", "mlx_unmasked"]
    assert cell["floor_us_per_layer"] > 0 and 0 <= cell["max_err"] <= 2e-4
    assert "kernel vs masked" in txt and "max |kernel - MLX masked| per cell" in txt


def test_attention_quantized_disagreement_stops_the_run(tmp_path, monkeypatch):
    from benchmarks import attention

    monkeypatch.setattr(attention, "QUANT_TOL", {"bfloat16": -1.0})
    with pytest.raises(SystemExit, match=r"at B=2 S=64, disagreeing with its reference: kernel_q8 max error"):
        attention.run([(2, 64)], layers=1, steps=1, warmup=0, quantized=True)


def test_attention_group_size_needs_quantized(capsys):
    from benchmarks import attention

    with pytest.raises(SystemExit):
        attention.main(["--group-size", "32"])
    assert "--group-size: only with --quantized" in capsys.readouterr().err


@pytest.mark.parametrize("kernel, args, routed", [
    ("decode_attention", [], ["--dtype=bfloat16", "--layers=32", "--steps=20"]),
    ("decode_attention_quantized", ["--kv-group-size", "32", "--layers", "16", "--commit", "c0ffee"],
     ["--dtype=bfloat16", "--layers=16", "--steps=20", "--quantized", "--group-size=32", "--commit=c0ffee"]),
    ("decode_attention_quantized", [], ["--dtype=bfloat16", "--layers=32", "--steps=20", "--quantized",
                                        "--group-size=64"]),
])
def test_cli_routes_the_attention_kernels(monkeypatch, tmp_path, kernel, args, routed):
    from benchmarks import attention

    seen = []
    monkeypatch.setattr(attention, "main", seen.append)
    res = CliRunner().invoke(bench, ["--kernel", kernel, *args])
    assert res.exit_code == 0, res.output
    assert seen == [routed]
    out, txt = tmp_path / "q.json", tmp_path / "q.txt"
    res = CliRunner().invoke(bench, ["--kernel", kernel, "--json", str(out), "--txt", str(txt)])
    assert res.exit_code == 0 and seen[-1][-2:] == [f"--json={out}", f"--txt={txt}"], res.output


@pytest.mark.parametrize("args, message", [
    (["--kernel", "decode_attention", "--kv-group-size", "32"], "--kv-group-size: only with --e2e"),
    (["--kernel", "decode_attention_quantized", "--dtypes", "bfloat16,float16"], "not --dtypes with several"),
    (["--kernel", "decode_attention_quantized", "--plot", "x.png"], "not --plot"),
    (["--kernel", "kv_pool_store", "--txt", "x.txt"], "--txt: only with --kernel decode_attention"),
])
def test_cli_attention_kernels_reject_foreign_options(monkeypatch, args, message):
    from benchmarks import attention

    monkeypatch.setattr(attention, "main", lambda argv: pytest.fail("ran despite a usage error"))
    res = CliRunner().invoke(bench, args)
    assert res.exit_code == 2 and message in res.output, res.output
