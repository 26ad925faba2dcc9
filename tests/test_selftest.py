"""`python -m build_tools selftest` (build_tools/selftest.py, registry/parity.py): every kernel of
kernels.yaml has a parity case; on this machine every check passes and the JSON report holds what a
bug report needs; a failing kernel, a missing case, an exception and a failing decode check are each
reported as FAIL (exit 1) without a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from build_tools import selftest as st
from build_tools.cli import cli
from registry.manifest import load_manifest
from registry.parity import CASES


def run(*args: str):
    return CliRunner().invoke(cli, ["selftest", *args])


def test_every_kernel_of_the_manifest_has_a_parity_case():
    missing = [k.name for k in load_manifest().kernels if k.name not in CASES]
    assert not missing, (f"kernels.yaml declares {missing} with no selftest parity case: add a function decorated "
                         f"with @parity('<name>') to registry/parity.py (docs/manifest.md, \"Adding a kernel\")")


def test_selftest_passes_here_and_writes_the_report(native_artifacts, tmp_path):
    path = tmp_path / "selftest.json"
    r = run("--out", str(native_artifacts), "--json", str(path))
    assert r.exit_code == 0, r.output
    report = json.loads(path.read_text())
    env = report["environment"]
    assert report["ok"] and not report["checks_failed"] and "all checks passed" in r.stdout
    assert env["backend"] in ("cpu", "cuda", "metal") and env["mlx"] and env["device_name"] and env["os"]
    assert report["compile"]["status"] == "ok" and report["compile"]["out_dir"] == str(native_artifacts)
    names = [k.name for k in load_manifest().kernels]
    assert [k["kernel"] for k in report["kernels"]] == names
    assert {a["kernel"] for a in report["artifacts"] if a["state"] == "fresh"} == set(names)
    for k in report["kernels"]:
        assert k["verdict"] == "PASS" and k["implementation"] == f"native-{env['backend']}", k
        assert k["cases"] and all(c["ok"] and c["max_error"] is not None for c in k["cases"]), k
        assert f"PASS {k['kernel']}: native-{env['backend']}" in r.stdout
    d = report["decode"]
    assert d["verdict"] == "PASS" and d["fused_layers"] and d["speed_ratio"] > 0, d
    assert d["tokens_dropin"] == d["tokens_stock"] and len(d["tokens_stock"]) == st.DECODE_TOKENS
    assert "decode speed" in r.stdout and "x stock" in r.stdout


def test_failures_are_reported_per_check_without_a_traceback(native_artifacts, monkeypatch):
    """A kernel whose native results leave the tolerance, a kernel with no parity case, a case that
    raises, and a decode check that raises: each one FAIL with its message, exit 1."""
    from registry.integrations import mlx_lm as integration
    from registry.kernels.kv_pool_store import KvPoolStoreKernel

    original = KvPoolStoreKernel.reference
    monkeypatch.setattr(KvPoolStoreKernel, "reference", lambda self, *a: tuple(p + 1 for p in original(self, *a)))
    monkeypatch.delitem(CASES, "rope_pool_fused")
    qk_cases = CASES["qk_norm_rope_pool_fused"]

    def broken():
        cases = qk_cases()
        cases[0].args = cases[0].args[:-1]          # one argument short
        return cases
    monkeypatch.setitem(CASES, "qk_norm_rope_pool_fused", broken)

    def no_model(*a, **kw):
        raise RuntimeError("no model today")
    monkeypatch.setattr(integration, "build_model", no_model)
    r = run("--out", str(native_artifacts))
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    assert "FAIL rope_pool_fused: no parity case: add a function decorated with @parity('rope_pool_fused')" in r.stdout
    assert "FAIL kv_pool_store" in r.stdout and "max error 1 beyond its tolerance (atol 0 + rtol 0" in r.stdout
    assert "FAIL qk_norm_rope_pool_fused" in r.stdout and "1 of 3 cases failed" in r.stdout
    assert "TypeError" in r.stdout
    assert "FAIL decode: decode check: RuntimeError: no model today (at test_selftest.py:" in r.stdout
    assert "4 check(s) failed: rope_pool_fused, kv_pool_store, qk_norm_rope_pool_fused, decode" in r.stdout


def test_a_kernel_without_its_backend_target_is_skipped_not_failed():
    from registry.parity import run_kernel
    spec = load_manifest().kernel("kv_pool_store")
    spec_without = type("Spec", (), {"name": spec.name, "targets": {"metal": None}})()
    res = run_kernel(spec_without, "cpu")
    assert res.verdict == "SKIP" and "declares no cpu target" in res.reason


def test_compare_tokens_accepts_only_a_near_tie():
    lps = [np.array([0.0, -1.0, -5.0]), np.array([-2.0, -0.5, -0.5001])]
    ok, what, _ = st.compare_tokens([0, 1], lps, [0, 1], lps)
    assert ok and what == "2 tokens identical"
    near = [lps[0] + 1e-3, lps[1]]                 # stock's step 1: a top-2 gap of 1e-4, the runs 1e-3 apart
    ok, what, worst = st.compare_tokens([0, 2], near, [0, 1], lps)
    assert ok and "near-tie" in what and worst == pytest.approx(1e-3)
    ok, what, _ = st.compare_tokens([1, 1], lps, [0, 1], lps)    # step 0: a gap of 1, no difference
    assert not ok and what.startswith("step 0: token 1, stock 0")


def test_decode_check_is_skipped_without_mlx_lm(monkeypatch):
    monkeypatch.setattr(st, "_version", lambda dist: None)
    d = st.decode_check(load_manifest())
    assert d["verdict"] == "SKIP" and "pip install mlx-lm" in d["message"]


def test_a_json_path_in_a_missing_directory_is_refused_before_anything_runs(tmp_path):
    r = run("--json", str(tmp_path / "nowhere" / "report.json"))
    assert r.exit_code == 2 and "--json" in r.output and "does not exist" in r.output
