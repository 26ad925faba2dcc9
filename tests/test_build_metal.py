"""Metal builds on any OS through tests/fake_xcrun/xcrun, a recording stand-in put first on PATH:
the exact argv of every xcrun call, TOOLCHAINS passed through and keyed, function checks on the
metallib, incremental rebuilds, a missing Metal toolchain; plus a real build on macOS."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from build_tools import MissingToolchainError, compile_kernels, toolchains
from build_tools.cli import cli
from build_tools.symbols import metallib_functions
from registry import artifacts
from registry.manifest import load_manifest
from tests.test_build_pipeline import TOY_METAL, edit_manifest, failures, statuses, toy, toy_project

FAKE_XCRUN_DIR = Path(__file__).resolve().parent / "fake_xcrun"


@pytest.fixture
def xcrun_log(tmp_path, monkeypatch):
    """The fake xcrun first on PATH; yields a function returning the argv of each call so far."""
    log = tmp_path / "xcrun.log"
    monkeypatch.setenv("PATH", f"{FAKE_XCRUN_DIR}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(log))
    monkeypatch.delenv("TOOLCHAINS", raising=False)
    monkeypatch.delenv("FAKE_XCRUN_NO_TOOLCHAIN", raising=False)
    toolchains.clear_cache()

    def calls(builds_only: bool = True) -> list[dict]:
        out = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if builds_only:   # drop the toolchain probes (--find, --version, --show-sdk-version)
            out = [c for c in out if c["argv"][2] in ("metal", "metallib") and "--version" not in c["argv"]]
        return out
    yield calls
    toolchains.clear_cache()


def test_metal_commands_exact_argv_and_artifact(tmp_path, xcrun_log, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    (tmp_path / "src" / "extra.metal").write_text("// a second translation unit\n")
    edit_manifest(manifest, lambda k: k["metal"].update(sources=["src/toy.metal", "src/extra.metal"],
                                                        flags=["-ffast-math"], std="metal3.2"))
    monkeypatch.setenv("TOOLCHAINS", "com.example.metal")
    toolchains.clear_cache()
    out = tmp_path / "out"
    report = compile_kernels(targets="metal", manifest=manifest, out_dir=out)
    assert report.ok, failures(report)
    compile_a, compile_b, link = (c["argv"] for c in xcrun_log())
    build = Path(compile_a[compile_a.index("-o") + 1]).parent
    src = tmp_path / "src"
    assert compile_a == ["-sdk", "macosx", "metal", "-std=metal3.2", "-O3", "-mmacosx-version-min=14.0",
                         f"-I{src}", "-ffast-math", "-MMD", "-MF", f"{build}/0_toy.air.d",
                         "-c", f"{src}/toy.metal", "-o", f"{build}/0_toy.air"]
    assert compile_b[-6:] == ["-MF", f"{build}/1_extra.air.d", "-c", f"{src}/extra.metal", "-o", f"{build}/1_extra.air"]
    assert link == ["-sdk", "macosx", "metallib", f"{build}/0_toy.air", f"{build}/1_extra.air", "-o",
                    f"{build}/toy.metallib"]
    assert build.parent == out and build.name.startswith(".tmp-toy.metal.any-") and not build.exists()
    assert all(c["TOOLCHAINS"] == "com.example.metal" for c in xcrun_log(builds_only=False))
    entry = artifacts.read_index(out)[0][("toy", "metal", None)]
    lib = out / entry.file
    assert lib.name == f"toy.{entry.key[:16]}.metallib" and metallib_functions(lib, ["toy_f32"]) == {"toy_f32"}
    assert "TOOLCHAINS=com.example.metal" in entry.compiler and "32023.404" in entry.compiler
    assert set(entry.inputs) == {artifacts.MANIFEST_INPUT, "src/toy.metal", "src/extra.metal", "src/toy.h"}
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    assert artifacts.lookup(toy(manifest), "metal").path == lib


def test_metal_incremental_and_toolchains_switch_rebuilds(tmp_path, xcrun_log, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    out = tmp_path / "out"
    assert statuses(compile_kernels(targets="metal", manifest=manifest, out_dir=out)) == {("metal", None): "built"}
    n = len(xcrun_log())
    assert statuses(compile_kernels(targets="metal", manifest=manifest, out_dir=out)) == {("metal", None): "fresh"}
    assert len(xcrun_log()) == n                                       # nothing compiled
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 4.0f\n")  # a header of the .metal source
    assert statuses(compile_kernels(targets="metal", manifest=manifest, out_dir=out)) == {("metal", None): "built"}
    monkeypatch.setenv("TOOLCHAINS", "metal.beta")                      # another toolchain: another key
    toolchains.clear_cache()
    assert statuses(compile_kernels(targets="metal", manifest=manifest, out_dir=out)) == {("metal", None): "built"}
    assert len(list((out / "toy" / "metal").iterdir())) == 1


def test_metallib_without_the_entry_function_fails(tmp_path, xcrun_log):
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    (tmp_path / "src" / "toy.metal").write_text(TOY_METAL.replace('host_name("toy_f32")', 'host_name("xtoy_f32")'))
    report = compile_kernels(targets="metal", manifest=manifest, out_dir=tmp_path / "out")
    assert not report.ok
    assert "toy_f32" in report.results[0].message and "function of the metallib" in report.results[0].message


def test_metal_compile_error_shows_command_output_and_source(tmp_path, xcrun_log):
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    (tmp_path / "src" / "toy.metal").write_text("#error no such thing\n")
    result = CliRunner().invoke(cli, ["compile", "--target", "metal", "--manifest", str(manifest),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert f"sources: {tmp_path / 'src' / 'toy.metal'}" in result.output
    assert "command: xcrun -sdk macosx metal -std=metal3.1" in result.output
    assert "toy.metal:1:2: error: no such thing" in result.output


def test_missing_metal_toolchain(tmp_path, xcrun_log, monkeypatch):
    """Xcode 26 without its Metal toolchain: xcrun finds `metal`, which then refuses to run."""
    manifest = toy_project(tmp_path, cuda=False, metal=True)
    monkeypatch.setenv("FAKE_XCRUN_NO_TOOLCHAIN", "1")
    toolchains.clear_cache()
    with pytest.raises(MissingToolchainError, match="(?s)missing Metal Toolchain.*downloadComponent MetalToolchain"):
        compile_kernels(targets="metal", manifest=manifest, out_dir=tmp_path / "out")
    report = compile_kernels(targets="auto", manifest=manifest, out_dir=tmp_path / "out", archs="sm_90")
    assert "metal" in report.skipped and "metal" not in report.targets
    result = CliRunner().invoke(cli, ["compile", "--target", "metal", "--manifest", str(manifest),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "xcodebuild -downloadComponent MetalToolchain" in result.output
    doctor = CliRunner().invoke(cli, ["doctor", "--manifest", str(manifest)])
    assert doctor.exit_code == 0 and "[missing] metal" in doctor.output and "downloadComponent" in doctor.output


def test_doctor_finds_the_metal_tools(xcrun_log):
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0
    assert "[ok]      metal  /fake/Toolchains/XcodeDefault.xctoolchain/usr/bin/metal" in result.output
    finds = [c["argv"] for c in xcrun_log(builds_only=False) if "--find" in c["argv"]]
    assert ["-sdk", "macosx", "--find", "metal"] in finds and ["-sdk", "macosx", "--find", "metallib"] in finds


@pytest.mark.macos
def test_real_metal_compile_of_the_manifest(tmp_path, monkeypatch):
    toolchains.clear_cache()
    spec = load_manifest().kernel("rope_pool_fused")
    out = tmp_path / "out"
    report = compile_kernels(targets="metal", out_dir=out)
    assert report.ok, failures(report)
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(out))
    found = artifacts.lookup(spec, "metal")
    assert found.path is not None and found.path.read_bytes()[:4] == b"MTLB", found.reason
    assert metallib_functions(found.path, list(spec.entries.values())) == set(spec.entries.values())
