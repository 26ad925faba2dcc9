"""The AOT build pipeline with real compilers (g++, nvcc) and a recording stand-in for xcrun:
artifacts, entry checks, incremental builds, content keys, stale and corrupt artifacts, locks,
concurrent and interrupted builds, and the CLI (CliRunner and subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from build_tools import compile_kernels, toolchains
from build_tools.cli import cli
from build_tools.compiler import LockTimeoutError, MissingToolchainError, file_lock
from build_tools.symbols import elf_symbols, ptx_entries
from registry import artifacts
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT

HAS_NVCC = toolchains.nvcc().available
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="nvcc not found")

TOY_CPP = '''#include "toy.h"
extern "C" __attribute__((visibility("default"))) void toy_f32(void** args) {
  float* x = *static_cast<float**>(args[0]);
  x[0] = TOY_VALUE;
}
'''
TOY_CU = '''extern "C" __global__ void toy_f32(float* x) { if (threadIdx.x == 0) x[0] = 1.0f; }
'''


def toy_project(root: Path, *, cuda: bool = True, metal: bool = False, entry: str = "toy_f32") -> Path:
    (root / "src").mkdir(parents=True, exist_ok=True)
    (root / "src" / "toy.h").write_text("#define TOY_VALUE 1.0f\n")
    (root / "src" / "toy.cpp").write_text(TOY_CPP)
    (root / "src" / "toy.cu").write_text(TOY_CU)
    (root / "src" / "toy.metal").write_text('#include "toy.h"\nkernel void toy_f32() {}\n')
    kernel = {
        "name": "toy", "kernel_attr": "toy", "description": "toy", "wrapper": "tests.toy_wrapper:build",
        "enable": {"env": "MLX_AOT_TOY", "default": True},
        "signature": {"buffers": [{"name": "x", "role": "inplace"}]},
        "entries": {"float32": entry},
        "cpu": {"sources": ["src/toy.cpp"], "include_dirs": ["src"]},
    }
    if cuda:
        kernel["cuda"] = {"sources": ["src/toy.cu"], "archs": ["sm_90"], "ptx_arch": "compute_80"}
    if metal:
        kernel["metal"] = {"sources": ["src/toy.metal"], "include_dirs": ["src"], "std": "metal3.1",
                           "macos_min": "14.0"}
    path = root / "kernels.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "kernels": [kernel]}, sort_keys=False))
    return path


@pytest.fixture
def isolated_cache(monkeypatch, tmp_path):
    out = tmp_path / "artifacts"
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    return out


def statuses(report):
    return {(r.target, r.arch): r.status for r in report.results}


# ----------------------------------------------------------------------------- real kernels

@needs_nvcc
def test_real_manifest_compiles_for_cpu_and_cuda(tmp_path):
    out = tmp_path / "out"
    report = compile_kernels(targets=("cpu", "cuda"), out_dir=out, archs=["sm_90", "compute_90"])
    assert report.ok, [r.message for r in report.results]
    spec = load_manifest().kernel("rope_pool_fused")
    index, problem = artifacts.read_index(out)
    assert problem is None
    cubin = out / index[("rope_pool_fused", "cuda", "sm_90")].file
    assert set(spec.entries.values()) <= elf_symbols(cubin)
    ptx = out / index[("rope_pool_fused", "cuda", "compute_90")].file
    assert set(spec.entries.values()) <= ptx_entries(ptx)
    so = out / index[("rope_pool_fused", "cpu", None)].file
    assert set(spec.entries.values()) <= elf_symbols(so)


# ----------------------------------------------------------------------------- toy kernels

def test_cpu_build_index_and_lookup(tmp_path, isolated_cache):
    manifest = toy_project(tmp_path, cuda=False)
    report = compile_kernels(targets=("cpu",), manifest=manifest)
    assert statuses(report) == {("cpu", None): "built"}
    spec = load_manifest(manifest).kernel("toy")
    found = artifacts.lookup(spec, "cpu")
    assert found.path is not None and found.path.parent == isolated_cache / "toy" / "cpu"
    assert found.entries == {"float32": "toy_f32"}
    entry = artifacts.read_index(isolated_cache)[0][("toy", "cpu", None)]
    assert entry.sha256 == artifacts.sha256_file(found.path)
    assert "toy_f32" in elf_symbols(found.path)


@needs_nvcc
def test_second_compile_is_a_noop_and_fast_then_only_dependents_rebuild(tmp_path, isolated_cache):
    manifest = toy_project(tmp_path)
    first = compile_kernels(targets=("cpu", "cuda"), manifest=manifest)
    assert set(statuses(first).values()) == {"built"}
    start = time.monotonic()
    second = compile_kernels(targets=("cpu", "cuda"), manifest=manifest)
    assert time.monotonic() - start < 1.0
    assert set(statuses(second).values()) == {"fresh"}
    # The header is included by the C++ source only: only the cpu unit rebuilds.
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 2.0f\n")
    third = compile_kernels(targets=("cpu", "cuda"), manifest=manifest)
    assert statuses(third) == {("cpu", None): "built", ("cuda", "sm_90"): "fresh", ("cuda", "compute_80"): "fresh"}
    (tmp_path / "src" / "toy.cu").write_text(TOY_CU + "// edited\n")
    fourth = compile_kernels(targets=("cpu", "cuda"), manifest=manifest)
    assert statuses(fourth) == {("cpu", None): "fresh", ("cuda", "sm_90"): "built", ("cuda", "compute_80"): "built"}


def test_source_digest_and_build_key_change_with_each_input(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False)
    spec = lambda: load_manifest(manifest).kernel("toy")
    base = artifacts.source_digest(spec(), "cpu")
    key = artifacts.build_key(base, "g++ 12", ["-O3"], None)
    seen = {base}
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 3.0f\n")        # an included header
    seen.add(artifacts.source_digest(spec(), "cpu"))
    (tmp_path / "src" / "toy.cpp").write_text(TOY_CPP + "\n")                    # the source
    seen.add(artifacts.source_digest(spec(), "cpu"))
    data = yaml.safe_load(manifest.read_text())
    data["kernels"][0]["entries"]["float32"] = "toy_f32"
    data["kernels"][0]["cpu"]["flags"] = ["-DX=1"]                                # the target block
    manifest.write_text(yaml.safe_dump(data))
    seen.add(artifacts.source_digest(spec(), "cpu"))
    monkeypatch.setattr(artifacts, "__version__", "9.9.9")                        # the package version
    seen.add(artifacts.source_digest(spec(), "cpu"))
    assert len(seen) == 5
    assert len({key, artifacts.build_key(base, "g++ 13", ["-O3"], None),          # compiler identity
                artifacts.build_key(base, "g++ 12", ["-O2"], None),                # flags
                artifacts.build_key(base, "g++ 12", ["-O3"], "sm_90")}) == 4        # arch
    # Selection-only fields (description, enable, requires, prefer) do not touch the binary's digest.
    before = artifacts.source_digest(spec(), "cpu")
    data["kernels"][0]["description"] = "reworded"
    data["kernels"][0]["requires"] = ["head_dim > 0"]
    data["kernels"][0]["enable"]["default"] = False
    manifest.write_text(yaml.safe_dump(data))
    assert artifacts.source_digest(spec(), "cpu") == before


def test_stale_and_corrupt_artifacts_are_refused(tmp_path, isolated_cache):
    manifest = toy_project(tmp_path, cuda=False)
    compile_kernels(targets=("cpu",), manifest=manifest)
    spec = load_manifest(manifest).kernel("toy")
    assert artifacts.lookup(spec, "cpu").path is not None
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 5.0f\n")
    stale = artifacts.lookup(load_manifest(manifest).kernel("toy"), "cpu")
    assert stale.path is None and "stale" in stale.reason
    assert "python -m build_tools compile --only toy --target cpu" in stale.reason
    result = CliRunner().invoke(cli, ["list", "--manifest", str(manifest)])
    assert result.exit_code == 0 and "stale" in result.output
    compile_kernels(targets=("cpu",), manifest=manifest)
    found = artifacts.lookup(load_manifest(manifest).kernel("toy"), "cpu")
    data = bytearray(found.path.read_bytes())
    data[100] ^= 0xFF
    found.path.write_bytes(bytes(data))
    corrupt = artifacts.lookup(load_manifest(manifest).kernel("toy"), "cpu")
    assert corrupt.path is None and "sha256" in corrupt.reason


def test_missing_entry_symbol_fails_the_build(tmp_path, isolated_cache):
    manifest = toy_project(tmp_path, cuda=False, entry="not_there")
    report = compile_kernels(targets=("cpu",), manifest=manifest)
    assert not report.ok
    assert "lacks the entry symbol(s) not_there" in report.results[0].message
    assert artifacts.read_index(isolated_cache)[0] == {}


def test_compiler_error_reports_command_output_and_source(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    (tmp_path / "src" / "toy.cpp").write_text("this is not C++\n")
    result = CliRunner().invoke(cli, ["compile", "--target", "cpu", "--manifest", str(manifest),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "build failed" in result.output and str(tmp_path / "src" / "toy.cpp") in result.output
    assert "command: " in result.output and "-shared" in result.output and "error" in result.output


def test_explicit_target_without_toolchain_exits_2_with_fix(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    monkeypatch.setenv("PATH", "/nonexistent")
    toolchains.clear_cache()
    try:
        with pytest.raises(MissingToolchainError, match="xcrun"):
            compile_kernels(targets=("metal",), manifest=manifest, out_dir=tmp_path / "o")
        result = CliRunner().invoke(cli, ["compile", "--target", "metal", "--manifest", str(manifest),
                                          "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and "xcode-select" in result.output
    finally:
        toolchains.clear_cache()


def test_lock_timeout_names_the_lock(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("MLX_AOT_LOCK_TIMEOUT", "0.3")
    lock = out / ".locks" / "toy.cpu.any.lock"
    with file_lock(lock):
        report = compile_kernels(targets=("cpu",), manifest=manifest, out_dir=out)
    assert not report.ok and str(lock) in report.results[0].message
    with pytest.raises(LockTimeoutError):
        with file_lock(lock, timeout=5):
            with file_lock(lock, timeout=0.2):
                pass


def _compile_cmd(manifest: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "build_tools", "compile", "--target", "cpu", "--manifest", str(manifest),
            "--out", str(out), "--json"]


def test_concurrent_compiles_agree_and_never_corrupt(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    procs = [subprocess.Popen(_compile_cmd(manifest, out), cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        reports.append(json.loads(stdout))
    assert sorted(r["results"][0]["status"] for r in reports) in (["built", "fresh"], ["built", "built"])
    spec = load_manifest(manifest).kernel("toy")
    index, problem = artifacts.read_index(out)
    assert problem is None and len(index) == 1
    entry = index[("toy", "cpu", None)]
    assert artifacts.check_entry(out, entry, artifacts.source_digest(spec, "cpu")) is None
    assert [p.name for p in (out / "toy" / "cpu").iterdir()] == [Path(entry.file).name]


def test_interrupted_build_leaves_nothing_loadable(tmp_path, monkeypatch):
    """Kill a compile while its compiler runs: no index entry, nothing the registry would load;
    the next compile succeeds."""
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    slow = tmp_path / "slowcxx"
    slow.write_text(f"#!/bin/sh\ntouch {tmp_path}/started\nsleep 30\nexec g++ \"$@\"\n")
    slow.chmod(slow.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), CXX=str(slow))
    p = subprocess.Popen(_compile_cmd(manifest, out), cwd=PROJECT_ROOT, env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    spec = load_manifest(manifest).kernel("toy")
    assert artifacts.lookup(spec, "cpu").path is None
    assert artifacts.read_index(out)[0] == {}
    report = compile_kernels(targets=("cpu",), manifest=manifest, out_dir=out)   # the lock died with it
    assert report.ok and artifacts.lookup(spec, "cpu").path is not None


# ----------------------------------------------------------------------------- Metal, with a stand-in xcrun

FAKE_XCRUN = r'''#!/usr/bin/env python3
"""Records its argv and plays xcrun's part: --find, versions, metal -c (writes .air and the dep
file), metallib (concatenates the .air files, which carry the kernel names)."""
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_XCRUN_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
if args[:1] == ["--sdk"] and "--show-sdk-version" in args:
    print("15.0"); sys.exit(0)
assert args[:2] == ["-sdk", "macosx"], args
rest = args[2:]
if rest[:1] == ["--find"]:
    print("/fake/usr/bin/" + rest[1]); sys.exit(0)
if rest[:2] == ["metal", "--version"]:
    print("Apple metal version 32023.404 (fake)"); sys.exit(0)
if rest[0] == "metal":
    src = rest[rest.index("-c") + 1]; out = rest[rest.index("-o") + 1]; dep = rest[rest.index("-MF") + 1]
    text = open(src).read()
    names = [n for n in os.environ.get("FAKE_XCRUN_NAMES", "").split(",") if n]
    with open(out, "wb") as f:
        f.write(b"AIR\0" + b"".join(n.encode() + b"\0" for n in names) + text.encode())
    open(dep, "w").write(out + ": " + src + "\n")
    sys.exit(0)
if rest[0] == "metallib":
    out = rest[rest.index("-o") + 1]
    airs = rest[1:rest.index("-o")]
    with open(out, "wb") as f:
        f.write(b"MTLB\0")
        for a in airs:
            f.write(open(a, "rb").read())
    sys.exit(0)
sys.exit("fake xcrun: unexpected " + " ".join(args))
'''


@pytest.fixture
def fake_xcrun(tmp_path, monkeypatch):
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    script = bindir / "xcrun"
    script.write_text(FAKE_XCRUN)
    script.chmod(0o755)
    log = tmp_path / "xcrun.log"
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(log))
    toolchains.clear_cache()
    yield log
    toolchains.clear_cache()


def test_metal_commands_exact_argv(tmp_path, fake_xcrun, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    monkeypatch.setenv("FAKE_XCRUN_NAMES", "toy_f32")
    out = tmp_path / "out"
    report = compile_kernels(targets=("metal",), manifest=manifest, out_dir=out)
    assert report.ok, [r.message for r in report.results]
    calls = [json.loads(line) for line in fake_xcrun.read_text().splitlines()]
    build = [c for c in calls if c[2] in ("metal", "metallib") and "--version" not in c]
    src = str(tmp_path / "src" / "toy.metal")
    compile_call, link_call = build
    air = compile_call[compile_call.index("-o") + 1]
    assert compile_call == ["-sdk", "macosx", "metal", "-std=metal3.1", "-O3", "-mmacosx-version-min=14.0",
                            f"-I{tmp_path / 'src'}", "-MMD", "-MF", f"{air}.d", "-c", src, "-o", air]
    assert air.endswith("0_toy.air")
    assert link_call[:3] == ["-sdk", "macosx", "metallib"] and link_call[3] == air
    assert link_call[4] == "-o" and link_call[5].endswith("toy.metallib")
    index = artifacts.read_index(out)[0]
    assert index[("toy", "metal", None)].file.endswith(".metallib")


def test_metal_missing_function_fails(tmp_path, fake_xcrun, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    monkeypatch.setenv("FAKE_XCRUN_NAMES", "something_else")
    report = compile_kernels(targets=("metal",), manifest=manifest, out_dir=tmp_path / "out")
    assert not report.ok and "toy_f32" in report.results[0].message


def test_toolchains_identity_includes_toolchains_env(fake_xcrun, monkeypatch):
    monkeypatch.setenv("TOOLCHAINS", "metal")
    toolchains.clear_cache()
    tc = toolchains.metal()
    assert tc.available and "TOOLCHAINS=metal" in tc.identity and "32023.404" in tc.identity


@pytest.mark.macos
def test_real_metal_compile(tmp_path):
    report = compile_kernels(targets=("metal",), out_dir=tmp_path / "out")
    assert report.ok, [r.message for r in report.results]


# ----------------------------------------------------------------------------- CLI

def test_cli_validate_list_doctor_clean_json_dry_run(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    runner = CliRunner()
    out = tmp_path / "out"
    r = runner.invoke(cli, ["validate", "--manifest", str(manifest)])
    assert r.exit_code == 0 and "OK (1 kernel(s): toy)" in r.output
    r = runner.invoke(cli, ["compile", "--target", "cpu", "--manifest", str(manifest), "--out", str(out), "--dry-run"])
    assert r.exit_code == 0 and "planned" in r.output and "-shared" in r.output and not out.exists()
    r = runner.invoke(cli, ["compile", "--target", "cpu", "--manifest", str(manifest), "--out", str(out), "--json"])
    assert r.exit_code == 0
    report = json.loads(r.stdout)
    assert report["ok"] and report["results"][0]["status"] == "built"
    r = runner.invoke(cli, ["list", "--manifest", str(manifest), "--out", str(out)])
    assert r.exit_code == 0 and "fresh" in r.output
    r = runner.invoke(cli, ["doctor"])
    assert r.exit_code == 0 and "cpu" in r.output and "metal" in r.output
    r = runner.invoke(cli, ["clean", "--out", str(out)])
    assert r.exit_code == 0 and not (out / "index.json").exists() and not (out / "toy").exists()
    r = runner.invoke(cli, ["compile", "--only", "nope", "--target", "cpu", "--manifest", str(manifest), "--out", str(out)])
    assert r.exit_code == 2 and "unknown kernel(s) nope" in r.output
    r = runner.invoke(cli, ["compile", "--arch", "volta", "--target", "cpu", "--manifest", str(manifest)])
    assert r.exit_code == 2 and "not a CUDA arch" in r.output


def test_cli_as_subprocess(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT))
    p = subprocess.run(_compile_cmd(manifest, tmp_path / "out"), cwd=PROJECT_ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["ok"] and "[1/1] toy cpu" in p.stderr
    bad = subprocess.run([sys.executable, "-m", "build_tools", "validate", "--manifest", str(tmp_path / "none.yaml")],
                         cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "manifest not found" in bad.stderr
