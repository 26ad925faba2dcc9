"""The AOT build pipeline with real compilers (g++, nvcc) on tiny test kernels: artifacts and entry
checks, content keys, incremental builds, stale/corrupt refusal, the runtime lookup, locks,
concurrent and interrupted builds. Metal (stand-in xcrun): test_build_metal.py; CLI: test_build_cli.py.

`toy_project` and `slow_compiler` are shared with those files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from build_tools import compile_kernels, toolchains
from build_tools.commands import Unit, key_commands
from build_tools.compiler import MissingToolchainError, file_lock
from build_tools.locking import LockTimeoutError
from build_tools.symbols import cubin_sm, exported_functions, ptx_entries
from registry import artifacts
from registry.manifest import load_manifest
from registry.paths import PROJECT_ROOT

HAS_NVCC = toolchains.nvcc().available
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="nvcc not found (CI has nvcc 13.0)")

TOY_H = "#define TOY_VALUE 1.0f\n"
TOY_CPP = '''#include "toy.h"
extern "C" __attribute__((visibility("default"))) void toy_f32(void** args) {
  float* x = *static_cast<float**>(args[0]);
  x[0] = TOY_VALUE;
}
'''
TOY_CUH = "#define TOY_CUDA_VALUE 1.0f\n"
TOY_CU = '''#include "toy.cuh"
extern "C" __global__ void toy_f32(float* x) { if (threadIdx.x == 0) x[0] = TOY_CUDA_VALUE; }
'''
TOY_METAL = '''#include <metal_stdlib>
#include "toy.h"
using namespace metal;
[[kernel, host_name("toy_f32")]] void toy_impl(device float* x [[buffer(0)]]) { x[0] = TOY_VALUE; }
'''


def toy_project(root: Path, *, cuda: bool = True, metal: bool = False, entry: str = "toy_f32",
                archs: list[str] | None = None, ptx_arch: str | None = "compute_80") -> Path:
    """A one-kernel manifest with its own tiny sources under `root` (independent of the real kernels)."""
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name, text in {"toy.h": TOY_H, "toy.cpp": TOY_CPP, "toy.cuh": TOY_CUH, "toy.cu": TOY_CU,
                       "toy.metal": TOY_METAL}.items():
        (src / name).write_text(text)
    kernel = {
        "name": "toy", "kernel_attr": "toy", "description": "toy", "wrapper": "tests.toy_wrapper:build",
        "enable": {"env": "MLX_AOT_TOY", "default": True},
        "signature": {"buffers": [{"name": "x", "role": "inplace"}]},
        "entries": {"float32": entry},
        "cpu": {"sources": ["src/toy.cpp"], "include_dirs": ["src"]},
    }
    if cuda:
        kernel["cuda"] = {"sources": ["src/toy.cu"], "include_dirs": ["src"], "archs": archs or ["sm_90"]}
        if ptx_arch:
            kernel["cuda"]["ptx_arch"] = ptx_arch
    if metal:
        kernel["metal"] = {"sources": ["src/toy.metal"], "include_dirs": ["src"], "std": "metal3.1",
                           "macos_min": "14.0"}
    path = root / "kernels.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "kernels": [kernel]}, sort_keys=False))
    return path


def edit_manifest(path: Path, fn) -> None:
    data = yaml.safe_load(path.read_text())
    fn(data["kernels"][0])
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def slow_compiler(path: Path, marker: Path, seconds: float, then: str = "") -> Path:
    """A $CXX that answers --version at once but, after each real compile step, touches `marker`,
    runs `then` (shell) and sleeps: a window in which another process or a kill can act."""
    path.write_text(f'''#!/bin/sh
if [ "$1" = "--version" ]; then exec g++ --version; fi
g++ "$@" || exit $?
touch {marker}
{then}
sleep {seconds}
''')
    path.chmod(0o755)
    return path


def toy(manifest: Path):
    return load_manifest(manifest).kernel("toy")


def statuses(report) -> dict:
    return {(r.target, r.arch): r.status for r in report.results}


def failures(report) -> list[str]:
    return [r.message for r in report.results if r.status == "failed"]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An artifact dir for compile and lookup alike (MLX_AOT_CACHE_DIR)."""
    out = tmp_path / "artifacts"
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    return out


@pytest.fixture
def fresh_toolchains():
    toolchains.clear_cache()
    yield
    toolchains.clear_cache()


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def subprocess_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT), **extra)
    env.pop("MLX_AOT_CACHE_DIR", None)
    return env


def compile_argv(manifest: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "build_tools", "compile", "--target", "cpu", "--manifest", str(manifest),
            "--out", str(out), "--json", *extra]


# ----------------------------------------------------------------------------- the real kernels

def test_real_manifest_compiles_for_cpu_and_cuda(tmp_path, monkeypatch):
    spec = load_manifest().kernel("rope_pool_fused")
    missing = [str(p) for t in ("cpu", "cuda") if t in spec.targets for p in spec.source_paths(t) if not p.is_file()]
    if missing:
        pytest.skip(f"kernel sources not written yet: {', '.join(missing)}")
    targets = ("cpu", "cuda") if HAS_NVCC else ("cpu",)
    out = tmp_path / "out"
    report = compile_kernels(targets=targets, out_dir=out, archs=["sm_90"])
    assert report.ok, failures(report)
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    so = artifacts.lookup(spec, "cpu")
    assert so.path is not None and so.entries == spec.entries
    assert set(spec.entries.values()) <= exported_functions(so.path, "dynsym")
    if HAS_NVCC:
        cubin = artifacts.lookup(spec, "cuda", arch="sm_90")
        assert cubin.path is not None and cubin.path.suffix == ".cubin", cubin.reason
        assert set(spec.entries.values()) <= exported_functions(cubin.path, "symtab")
        assert cubin_sm(cubin.path) == 90


# ----------------------------------------------------------------------------- CPU and CUDA artifacts

def test_cpu_artifact_index_entry_and_lookup(tmp_path, cache):
    manifest = toy_project(tmp_path, cuda=False)
    report = compile_kernels(targets="cpu", manifest=manifest)
    assert statuses(report) == {("cpu", None): "built"}
    spec = toy(manifest)
    found = artifacts.lookup(spec, "cpu")
    assert found.path is not None and found.path.parent == cache / "toy" / "cpu", found.reason
    assert found.reason == f"loaded {found.path}"
    assert found.entries == {"float32": "toy_f32"}
    assert "toy_f32" in exported_functions(found.path, "dynsym")
    entry = artifacts.read_index(cache)[0][("toy", "cpu", None)]
    assert entry.sha256 == artifacts.sha256_file(found.path)
    assert entry.source_digest == artifacts.source_digest(spec, "cpu")
    assert found.path.name == f"toy.{entry.key[:16]}.so"
    assert set(entry.inputs) == {artifacts.MANIFEST_INPUT, "src/toy.cpp", "src/toy.h"}
    assert entry.inputs["src/toy.h"] == artifacts.sha256_file(tmp_path / "src" / "toy.h")
    # What the key covered is recorded, with paths normalised.
    assert entry.commands[0][-4:] == ["-c", "<root>/src/toy.cpp", "-o", "<build>/0_toy.o"]
    assert "-I<root>/src" in entry.commands[0] and "-shared" in entry.commands[1]
    raw = json.loads((cache / "index.json").read_text())
    assert raw["schema"] == artifacts.INDEX_SCHEMA and len(raw["artifacts"]) == 1
    assert not list(cache.glob(".tmp-*")) and not list(cache.glob(".index.*"))


def test_hidden_entry_symbol_fails_the_build(tmp_path, cache):
    """-fvisibility=hidden: an entry without default visibility is in .symtab but not in .dynsym,
    so dlsym would not find it; the build says so instead of indexing an unloadable library."""
    manifest = toy_project(tmp_path, cuda=False)
    (tmp_path / "src" / "toy.cpp").write_text(TOY_CPP.replace(' __attribute__((visibility("default")))', ""))
    report = compile_kernels(targets="cpu", manifest=manifest)
    assert not report.ok
    assert "toy_f32" in report.results[0].message and "exported from the shared library" in report.results[0].message
    assert artifacts.read_index(cache)[0] == {}


def test_undeclared_entry_fails_the_build(tmp_path, cache):
    manifest = toy_project(tmp_path, cuda=False, entry="not_there")
    report = compile_kernels(targets="cpu", manifest=manifest)
    assert not report.ok and "entry symbol(s) not_there" in report.results[0].message
    assert artifacts.read_index(cache)[0] == {} and not (cache / "toy").exists()


@needs_nvcc
def test_cuda_cubin_and_ptx_with_entries_and_lookup_rules(tmp_path, cache):
    manifest = toy_project(tmp_path, archs=["sm_90"], ptx_arch="compute_80")
    report = compile_kernels(targets="cuda", manifest=manifest)
    assert statuses(report) == {("cuda", "sm_90"): "built", ("cuda", "compute_80"): "built"}, failures(report)
    index = artifacts.read_index(cache)[0]
    cubin = cache / index[("toy", "cuda", "sm_90")].file
    ptx = cache / index[("toy", "cuda", "compute_80")].file
    assert cubin.name.endswith(".sm_90.cubin") and ptx.name.endswith(".compute_80.ptx")
    assert "toy_f32" in exported_functions(cubin, "symtab") and cubin_sm(cubin) == 90
    assert ptx_entries(ptx) == {"toy_f32"}
    spec = toy(manifest)
    exact = artifacts.lookup(spec, "cuda", arch="sm_90")
    assert exact.path == cubin and exact.entries == {"float32": "toy_f32"}
    newer = artifacts.lookup(spec, "cuda", arch="sm_120")      # no cubin: the driver JITs the PTX
    assert newer.path == ptx and "PTX compute_80" in newer.reason
    older = artifacts.lookup(spec, "cuda", arch="sm_75")       # older than the PTX: nothing fits
    assert older.path is None
    assert "run: python -m build_tools compile --only toy --target cuda --arch sm_75" in older.reason
    assert artifacts.lookup(spec, "cuda").path is None
    assert "device arch" in artifacts.lookup(spec, "cuda", arch="volta").reason
    assert artifacts.lookup(spec, "cpu", arch="sm_90").path is None


@needs_nvcc
def test_full_default_arch_list_builds_with_this_nvcc(tmp_path, cache):
    """Every arch of the real kernels.yaml (sm_80 ... sm_120 + PTX) builds, each cubin for its own SM."""
    real = load_manifest().kernel("rope_pool_fused").targets["cuda"]
    manifest = toy_project(tmp_path, archs=list(real.archs), ptx_arch=real.ptx_arch)
    report = compile_kernels(targets="cuda", manifest=manifest)
    assert report.ok, failures(report)
    assert sorted(a for _, a in statuses(report)) == sorted([*real.archs, real.ptx_arch])
    index = artifacts.read_index(cache)[0]
    for arch in real.archs:
        path = cache / index[("toy", "cuda", arch)].file
        assert cubin_sm(path) == int(arch[3:]) and "toy_f32" in exported_functions(path, "symtab")
        assert artifacts.lookup(toy(manifest), "cuda", arch=arch).path == path


# ----------------------------------------------------------------------------- incremental builds and keys

@needs_nvcc
def test_noop_is_fast_and_touching_a_file_rebuilds_only_its_dependents(tmp_path, cache):
    manifest = toy_project(tmp_path)
    both = ("cpu", "cuda")
    assert set(statuses(compile_kernels(targets=both, manifest=manifest)).values()) == {"built"}
    start = time.monotonic()
    second = compile_kernels(targets=both, manifest=manifest)
    assert time.monotonic() - start < 1.0
    assert set(statuses(second).values()) == {"fresh"}
    os.utime(tmp_path / "src" / "toy.h")                                     # mtime alone: content-addressed
    assert set(statuses(compile_kernels(targets=both, manifest=manifest)).values()) == {"fresh"}
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 2.0f\n")        # included by toy.cpp only
    assert statuses(compile_kernels(targets=both, manifest=manifest)) == {
        ("cpu", None): "built", ("cuda", "sm_90"): "fresh", ("cuda", "compute_80"): "fresh"}
    (tmp_path / "src" / "toy.cuh").write_text("#define TOY_CUDA_VALUE 2.0f\n")  # included by toy.cu only
    assert statuses(compile_kernels(targets=both, manifest=manifest)) == {
        ("cpu", None): "fresh", ("cuda", "sm_90"): "built", ("cuda", "compute_80"): "built"}
    # Superseded files are gone: one file per unit.
    assert len(list((cache / "toy" / "cuda").iterdir())) == 2 and len(list((cache / "toy" / "cpu").iterdir())) == 1
    forced = compile_kernels(targets="cpu", manifest=manifest, force=True)
    assert statuses(forced) == {("cpu", None): "built"}


def test_source_digest_changes_with_each_input_and_only_those(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False)
    digests = [artifacts.source_digest(toy(manifest), "cpu")]

    def record():
        digests.append(artifacts.source_digest(toy(manifest), "cpu"))

    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 3.0f\n"); record()       # an included header
    (tmp_path / "src" / "toy.cpp").write_text(TOY_CPP + "\n"); record()                  # the source
    edit_manifest(manifest, lambda k: k["cpu"].update(flags=["-DX=1"])); record()        # the target block
    edit_manifest(manifest, lambda k: k["entries"].update(float16="toy_f16")); record()  # entries
    edit_manifest(manifest, lambda k: k["signature"]["buffers"].append(
        {"name": "y", "role": "input"})); record()                                       # signature
    monkeypatch.setattr(artifacts, "__version__", "9.9.9"); record()                     # package version
    monkeypatch.setattr(artifacts, "KEY_SCHEMA_VERSION", 99); record()                   # key schema
    assert len(set(digests)) == len(digests) == 8
    # Deterministic, and blind to what only changes selection (not the binary) and to mtimes.
    before = artifacts.source_digest(toy(manifest), "cpu")
    assert artifacts.source_digest(toy(manifest), "cpu") == before

    def selection_only(k):
        k["description"] = "reworded"
        k["requires"] = ["head_dim > 0"]
        k["enable"]["default"] = False
    edit_manifest(manifest, selection_only)
    os.utime(tmp_path / "src" / "toy.cpp")
    assert artifacts.source_digest(toy(manifest), "cpu") == before


def test_build_key_changes_with_compiler_commands_and_arch():
    base = artifacts.build_key("d" * 64, "g++ 12", [["g++", "-O3"]], None)
    others = {artifacts.build_key("e" * 64, "g++ 12", [["g++", "-O3"]], None),      # sources
              artifacts.build_key("d" * 64, "g++ 13", [["g++", "-O3"]], None),      # compiler identity
              artifacts.build_key("d" * 64, "g++ 12", [["g++", "-O2"]], None),      # flags
              artifacts.build_key("d" * 64, "g++ 12", [["g++", "-O3"]], "sm_90")}   # arch
    assert base not in others and len(others) == 4


def test_keys_survive_a_moved_checkout(tmp_path):
    a = toy_project(tmp_path / "a", cuda=False)
    b = toy_project(tmp_path / "elsewhere" / "b", cuda=False)
    tc = toolchains.cxx()
    assert artifacts.source_digest(toy(a), "cpu") == artifacts.source_digest(toy(b), "cpu")
    assert key_commands(Unit(toy(a), "cpu", None), tc) == key_commands(Unit(toy(b), "cpu", None), tc)


def test_compiler_and_flag_changes_rebuild(tmp_path, cache, monkeypatch, fresh_toolchains):
    manifest = toy_project(tmp_path, cuda=False)
    assert statuses(compile_kernels(targets="cpu", manifest=manifest)) == {("cpu", None): "built"}
    wrapper = tmp_path / "other-g++"
    wrapper.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "other-g++ 99.1"; exit 0; fi\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    toolchains.clear_cache()
    assert statuses(compile_kernels(targets="cpu", manifest=manifest)) == {("cpu", None): "built"}
    assert "other-g++ 99.1" in artifacts.read_index(cache)[0][("toy", "cpu", None)].compiler
    assert statuses(compile_kernels(targets="cpu", manifest=manifest)) == {("cpu", None): "fresh"}
    edit_manifest(manifest, lambda k: k["cpu"].update(flags=["-DTOY_EXTRA=1"]))
    report = compile_kernels(targets="cpu", manifest=manifest)
    assert statuses(report) == {("cpu", None): "built"}
    assert "-DTOY_EXTRA=1" in report.results[0].commands[0]


def test_a_header_the_scan_cannot_see_fails_the_build(tmp_path, cache):
    """`#include MACRO` hides toy.h from the include scan; g++'s -MMD output shows it was read, so the
    build fails rather than produce an artifact whose digest ignores toy.h."""
    manifest = toy_project(tmp_path, cuda=False)
    (tmp_path / "src" / "toy.cpp").write_text('#define TOY_HEADER "toy.h"\n' +
                                              TOY_CPP.replace('#include "toy.h"', "#include TOY_HEADER"))
    report = compile_kernels(targets="cpu", manifest=manifest)
    assert not report.ok
    message = report.results[0].message
    assert str(tmp_path / "src" / "toy.h") in message and "include scan does not reach" in message
    assert artifacts.read_index(cache)[0] == {}


def test_angle_includes_inside_include_dirs_are_hashed(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    (tmp_path / "src" / "toy.cpp").write_text(TOY_CPP.replace('#include "toy.h"', "#include <toy.h>\n#include <vector>"))
    assert "src/toy.h" in artifacts.source_inputs(toy(manifest), "cpu").files


# ----------------------------------------------------------------------------- failures

def test_compiler_error_reports_command_output_and_source(tmp_path, cache):
    manifest = toy_project(tmp_path, cuda=False)
    (tmp_path / "src" / "toy.cpp").write_text("this is not C++\n")
    report = compile_kernels(targets="cpu", manifest=manifest)
    r = report.results[0]
    assert r.status == "failed" and not report.ok
    assert f"sources: {tmp_path / 'src' / 'toy.cpp'}" in r.message
    assert "command: " in r.message and " -c " in r.message and "exit code 1" in r.message
    assert "error" in r.message.split("exit code 1", 1)[1]          # the compiler's own output
    assert artifacts.read_index(cache)[0] == {} and not list(cache.glob(".tmp-*"))


def test_explicit_target_without_toolchain_raises_with_fix_and_auto_skips(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path)
    gone = toolchains.Toolchain("cuda", False, "", (), "nvcc not found (test)", "install the CUDA toolkit")
    monkeypatch.setitem(toolchains.FINDERS, "cuda", lambda: gone)
    monkeypatch.setattr(toolchains, "runs", lambda target: "")      # a machine with a GPU for MLX's CUDA
    with pytest.raises(MissingToolchainError, match="(?s)target cuda: nvcc not found.*fix: install the CUDA"):
        compile_kernels(targets=("cpu", "cuda"), manifest=manifest, out_dir=tmp_path / "o")
    report = compile_kernels(targets="auto", manifest=manifest, out_dir=tmp_path / "o")
    assert report.ok and "cuda" not in report.targets and "cpu" in report.targets
    assert "nvcc not found (test)" in report.skipped["cuda"] and "install the CUDA toolkit" in report.skipped["cuda"]
    with pytest.raises(ValueError, match="unknown target 'rocm'"):
        compile_kernels(targets="rocm", manifest=manifest, out_dir=tmp_path / "o")
    with pytest.raises(ValueError, match="archs: 'volta' is not a CUDA arch"):
        compile_kernels(targets="cpu", archs="volta", manifest=manifest, out_dir=tmp_path / "o")
    with pytest.raises(ValueError, match="unknown kernel.*nope"):
        compile_kernels(targets="cpu", only="nope", manifest=manifest, out_dir=tmp_path / "o")


def fake_toolchains(monkeypatch, *available: str) -> None:
    """Toolchains for `available` (never run: dry runs only), none for the other targets."""
    for t in ("metal", "cuda", "cpu"):
        tc = (toolchains.Toolchain(t, True, f"{t} (test)", ("true",), f"{t} (test)", "") if t in available
              else toolchains.Toolchain(t, False, "", (), f"no {t} toolchain (test)", f"install {t} (test)"))
        monkeypatch.setitem(toolchains.FINDERS, t, lambda tc=tc: tc)


def test_auto_builds_what_this_machine_runs_and_all_what_the_toolchains_build(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, metal=True)
    fake_toolchains(monkeypatch, "metal", "cuda", "cpu")
    here = {"cpu": "", "cuda": "no CUDA backend (test)", "metal": "not macOS (test)"}
    monkeypatch.setattr(toolchains, "runs", lambda t: here[t])
    lines = []
    plan = lambda targets: compile_kernels(targets=targets, manifest=manifest, out_dir=tmp_path / "o", dry_run=True,
                                           log=lines.append)
    report = plan("auto")
    assert report.targets == ["cpu"] and statuses(report) == {("cpu", None): "planned"}
    assert report.skipped == {t: f"{here[t]}; `--target {t}` or `--target all` builds it for other machines"
                              for t in ("metal", "cuda")}
    assert lines[0].startswith("--target auto: what this machine runs (cpu)")
    here["cuda"] = ""                                                 # MLX's CUDA backend and a GPU
    assert plan("auto").targets == ["cuda", "cpu"]
    lines.clear()
    report = plan("all")
    assert report.targets == ["metal", "cuda", "cpu"] and not report.skipped
    assert lines[0].startswith("--target all: every target the toolchains here build (metal, cuda, cpu)")
    fake_toolchains(monkeypatch, "cuda", "cpu")                       # all skips a missing toolchain, with the fix
    report = plan("all")
    assert report.targets == ["cuda", "cpu"] and report.skipped == {"metal": "no metal toolchain (test) "
                                                                              "(fix: install metal (test))"}
    here["metal"] = ""                                                # auto too, where the machine runs it
    assert plan("auto").skipped == report.skipped
    with pytest.raises(MissingToolchainError, match="target metal: no metal toolchain"):
        compile_kernels(targets="metal", manifest=manifest, out_dir=tmp_path / "o")


def test_which_targets_this_machine_runs(monkeypatch):
    """toolchains.runs reads the installed MLX's backends and devices: CUDA needs the backend and a GPU
    (mx.cuda.is_available() is true for the CUDA build on a machine without one), Metal macOS."""
    from types import SimpleNamespace

    backend, gpus, system = {"cuda": False, "metal": False}, [0], ["Linux"]
    mx = SimpleNamespace(gpu="gpu", device_count=lambda d: gpus[0] if d == "gpu" else 1,
                         cuda=SimpleNamespace(is_available=lambda: backend["cuda"]),
                         metal=SimpleNamespace(is_available=lambda: backend["metal"]))
    monkeypatch.setattr(toolchains, "_mlx", lambda: mx)
    monkeypatch.setattr(toolchains.platform, "system", lambda: system[0])

    def runs(target):
        toolchains.runs.cache_clear()
        return toolchains.runs(target)
    assert runs("cpu") == ""
    assert runs("cuda") == "the installed MLX has no CUDA backend (that is mlx[cuda13])"
    backend["cuda"] = True
    assert runs("cuda") == "MLX's CUDA backend finds no GPU"
    gpus[0] = 1
    assert runs("cuda") == ""
    backend["metal"] = True
    assert runs("metal") == "this is not macOS"
    system[0] = "Darwin"
    assert runs("metal") == ""
    backend["metal"] = False
    assert runs("metal") == "MLX finds no Metal device"
    toolchains.runs.cache_clear()


def test_dry_run_builds_nothing(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    report = compile_kernels(targets="cpu", manifest=manifest, out_dir=out, dry_run=True)
    assert statuses(report) == {("cpu", None): "planned"} and not out.exists()
    assert report.results[0].commands[0][-3] == str(tmp_path / "src" / "toy.cpp")


# ----------------------------------------------------------------------------- stale, corrupt, search order

def test_stale_corrupt_and_missing_artifacts_are_refused_with_the_reason(tmp_path, cache):
    manifest = toy_project(tmp_path, cuda=False)
    compile_kernels(targets="cpu", manifest=manifest)
    assert artifacts.lookup(toy(manifest), "cpu").path is not None
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 5.0f\n")
    stale = artifacts.lookup(toy(manifest), "cpu")
    assert stale.path is None and "is stale (changed: src/toy.h)" in stale.reason
    assert "run: python -m build_tools compile --only toy --target cpu" in stale.reason
    edit_manifest(manifest, lambda k: k["signature"]["buffers"].append({"name": "y", "role": "input"}))
    assert "kernels.yaml entry" in artifacts.lookup(toy(manifest), "cpu").reason

    compile_kernels(targets="cpu", manifest=manifest)
    found = artifacts.lookup(toy(manifest), "cpu")
    data = bytearray(found.path.read_bytes())
    data[100] ^= 0xFF
    found.path.write_bytes(bytes(data))
    corrupt = artifacts.lookup(toy(manifest), "cpu")
    assert corrupt.path is None and "does not match its sha256" in corrupt.reason
    # compile notices the damaged file is not fresh and rebuilds it.
    assert statuses(compile_kernels(targets="cpu", manifest=manifest)) == {("cpu", None): "built"}
    path = artifacts.lookup(toy(manifest), "cpu").path
    path.unlink()
    assert "but missing" in artifacts.lookup(toy(manifest), "cpu").reason


def test_unreadable_index_is_refused_and_recovered(tmp_path, cache):
    manifest = toy_project(tmp_path, cuda=False)
    compile_kernels(targets="cpu", manifest=manifest)
    (cache / "index.json").write_text('{"schema": 2, "artifacts": [')
    found = artifacts.lookup(toy(manifest), "cpu")
    assert found.path is None and "unreadable index" in found.reason
    (cache / "index.json").write_text('{"schema": 1, "artifacts": []}')
    assert f"index schema 1 is not {artifacts.INDEX_SCHEMA}" in artifacts.lookup(toy(manifest), "cpu").reason
    assert compile_kernels(targets="cpu", manifest=manifest).ok
    assert artifacts.lookup(toy(manifest), "cpu").path is not None


def test_search_order_package_dir_then_user_cache(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False)
    pkg, user = tmp_path / "pkg", tmp_path / "user"
    monkeypatch.delenv("MLX_AOT_CACHE_DIR", raising=False)
    monkeypatch.setattr(artifacts, "package_artifact_dir", lambda: pkg)
    monkeypatch.setattr(artifacts, "user_cache_dir", lambda: user)
    assert artifacts.artifact_dirs() == [pkg, user] and artifacts.default_output_dir() == pkg
    compile_kernels(targets="cpu", manifest=manifest, out_dir=pkg)
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 7.0f\n")       # pkg's copy is now stale
    compile_kernels(targets="cpu", manifest=manifest, out_dir=user)
    found = artifacts.lookup(toy(manifest), "cpu")
    assert found.path is not None and found.path.is_relative_to(user), found.reason
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(tmp_path / "override"))
    assert artifacts.artifact_dirs() == [tmp_path / "override"]
    assert artifacts.default_output_dir() == tmp_path / "override"
    assert artifacts.lookup(toy(manifest), "cpu").path is None


# ----------------------------------------------------------------------------- locks, concurrency, interruption

def test_lock_timeout_names_the_lock(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    monkeypatch.setenv("MLX_AOT_LOCK_TIMEOUT", "0.3")
    lock = out / ".locks" / "toy.cpu.any.lock"
    with file_lock(lock, 5):
        report = compile_kernels(targets="cpu", manifest=manifest, out_dir=out)
    assert not report.ok and str(lock) in report.results[0].message
    assert "MLX_AOT_LOCK_TIMEOUT" in report.results[0].message
    with pytest.raises(LockTimeoutError, match="waiting for the build lock"):
        with file_lock(lock, 5):
            with file_lock(lock, 0.1):
                pass


def test_concurrent_compiles_build_once_and_agree(tmp_path):
    """Two processes at once: the second waits on the unit lock, re-checks, finds it fresh."""
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    slow = slow_compiler(tmp_path / "slowcxx", tmp_path / "compiled", 0.5)
    env = subprocess_env(CXX=str(slow))
    procs = [subprocess.Popen(compile_argv(manifest, out), cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        reports.append(json.loads(stdout)["results"][0])
    assert sorted(r["status"] for r in reports) == ["built", "fresh"]
    assert reports[0]["path"] == reports[1]["path"]
    index, problem = artifacts.read_index(out)
    assert problem is None and list(index) == [("toy", "cpu", None)]
    spec = toy(manifest)
    assert artifacts.check_entry(out, index[("toy", "cpu", None)], artifacts.source_inputs(spec, "cpu"), spec) is None
    assert [p.name for p in (out / "toy" / "cpu").iterdir()] == [Path(index[("toy", "cpu", None)].file).name]
    assert not list(out.glob(".tmp-*"))


def test_build_killed_while_compiling_leaves_nothing_loadable(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    marker = tmp_path / "compiled"
    slow = slow_compiler(tmp_path / "slowcxx", marker, 30)
    p = subprocess.Popen(compile_argv(manifest, out), cwd=PROJECT_ROOT, env=subprocess_env(CXX=str(slow)),
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(marker)                       # the object file exists in the temp dir; now kill everything
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    leftovers = list(out.glob(".tmp-toy.cpu.any-*"))
    assert leftovers and any(leftovers[0].iterdir())
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    found = artifacts.lookup(toy(manifest), "cpu")
    assert found.path is None and "no cpu artifact" in found.reason and artifacts.read_index(out)[0] == {}
    report = compile_kernels(targets="cpu", manifest=manifest, out_dir=out)     # its lock died with it
    assert statuses(report) == {("cpu", None): "built"}
    assert artifacts.lookup(toy(manifest), "cpu").path is not None
    assert not list(out.glob(".tmp-*"))                                          # leftovers removed


def test_build_killed_before_the_index_write_leaves_an_orphan_nothing_loads(tmp_path, monkeypatch):
    """The artifact is in place but the index (the commit marker) was never written."""
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    script = ("import os, signal, sys\n"
              "import build_tools.compiler as c\n"
              "c.write_index = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
              f"c.compile_kernels(targets='cpu', manifest={str(manifest)!r}, out_dir={str(out)!r})\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, env=subprocess_env(), timeout=120)
    assert p.returncode == -signal.SIGKILL
    orphans = list((out / "toy" / "cpu").iterdir())
    assert len(orphans) == 1 and orphans[0].suffix == ".so"
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    assert artifacts.lookup(toy(manifest), "cpu").path is None
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 8.0f\n")   # a different key: the orphan is superseded
    assert compile_kernels(targets="cpu", manifest=manifest, out_dir=out).ok
    found = artifacts.lookup(toy(manifest), "cpu")
    assert found.path is not None and list((out / "toy" / "cpu").iterdir()) == [found.path]


def test_sources_edited_during_the_build_are_not_indexed(tmp_path, cache, monkeypatch, fresh_toolchains):
    manifest = toy_project(tmp_path, cuda=False)
    edit = f"echo '// edited' >> {tmp_path / 'src' / 'toy.cpp'}"
    monkeypatch.setenv("CXX", str(slow_compiler(tmp_path / "editing-cxx", tmp_path / "m", 0, then=edit)))
    report = compile_kernels(targets="cpu", manifest=manifest)
    assert not report.ok and "sources changed while compiling" in report.results[0].message
    assert artifacts.read_index(cache)[0] == {}


def test_clean_removes_only_pipeline_paths(tmp_path):
    from build_tools.compiler import clean_artifacts

    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    compile_kernels(targets="cpu", manifest=manifest, out_dir=out)
    (out / "unrelated").mkdir()
    (out / ".tmp-toy.cpu.any-dead").mkdir()
    removed, refused = clean_artifacts(out, ["toy"], only=["toy"])
    assert str(out / "toy") in removed and refused == [] and artifacts.read_index(out) == ({}, None)
    assert (out / "index.json").is_file()
    compile_kernels(targets="cpu", manifest=manifest, out_dir=out)
    clean_artifacts(out, ["toy"])
    assert not (out / "index.json").exists() and not (out / "toy").exists()
    assert (out / "unrelated").is_dir() and not (out / ".tmp-toy.cpu.any-dead").exists()
    assert (out / ".locks").is_dir()     # lock files stay: see clean_artifacts
    shutil.rmtree(out)
    assert clean_artifacts(out, ["toy"]) == ([], [])
