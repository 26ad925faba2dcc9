"""`python -m build_tools` through click's CliRunner and as a subprocess: exit codes, progress lines,
--json, --dry-run, --verbose, list states, clean, doctor, validate."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from click.testing import CliRunner

from build_tools import toolchains
from build_tools.cli import cli
from registry.paths import PROJECT_ROOT
from tests.test_build_pipeline import TOY_CPP, compile_argv, subprocess_env, toy_project


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_validate(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    r = run("validate", "--manifest", str(manifest))
    assert r.exit_code == 0 and "OK (1 kernel(s): toy)" in r.output
    manifest.write_text(manifest.read_text().replace("src/toy.cpp", "src/gone.cpp").replace("kernel_attr: toy",
                                                                                          "kernel_attr: 9toy"))
    r = run("validate", "--manifest", str(manifest))
    assert r.exit_code == 1
    assert "cpu.sources[0]: src/gone.cpp does not exist" in r.output and "kernel_attr: '9toy'" in r.output
    assert "2 problem(s)" in r.output


def test_compile_json_dry_run_and_progress(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    common = ["--manifest", str(manifest), "--out", str(out)]
    r = run("compile", "--target", "cpu", "--dry-run", *common)
    assert r.exit_code == 0 and "[1/1] toy cpu" in r.output and "planned" in r.output
    assert "$ " in r.output and "-fPIC" in r.output and not out.exists()
    r = run("compile", "--target", "cpu", "--json", *common)
    assert r.exit_code == 0
    report = json.loads(r.stdout)
    assert report["ok"] and report["targets"] == ["cpu"] and report["counts"] == {"built": 1}
    assert report["results"][0]["status"] == "built" and report["results"][0]["path"].endswith(".so")
    assert "[1/1] toy cpu" in r.stderr and "built" in r.stderr and "1 built in" in r.stderr
    r = run("compile", "--target", "cpu", "--json", *common)
    assert json.loads(r.stdout)["counts"] == {"fresh": 1}


def test_compile_verbose_streams_commands_and_compiler_output(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    (tmp_path / "src" / "toy.cpp").write_text("#warning toy-warning-text\n" + TOY_CPP)
    r = run("compile", "--target", "cpu", "-v", "--manifest", str(manifest), "--out", str(tmp_path / "out"))
    assert r.exit_code == 0
    assert "[toy cpu] $ " in r.output and " -c " in r.output and "toy-warning-text" in r.output


def test_compile_errors_and_exit_codes(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    common = ["--manifest", str(manifest), "--out", str(tmp_path / "out")]
    r = run("compile", "--only", "nope", "--target", "cpu", *common)
    assert r.exit_code == 2 and "unknown kernel(s) nope" in r.output
    r = run("compile", "--arch", "volta", "--target", "cpu", *common)
    assert r.exit_code == 2 and "'volta' is not a CUDA arch" in r.output
    r = run("compile", "--target", "rocm", *common)
    assert r.exit_code == 2 and "unknown target 'rocm'" in r.output
    (tmp_path / "blocker").write_text("a file, not a directory")
    r = run("compile", "--target", "cpu", "--manifest", str(manifest), "--out", str(tmp_path / "blocker" / "x"))
    assert r.exit_code == 2 and "cannot use the output directory" in r.output
    (tmp_path / "src" / "toy.cpp").write_text("this is not C++\n")
    r = run("compile", "--target", "cpu", *common)
    assert r.exit_code == 1
    assert "build failed" in r.output and f"sources: {tmp_path / 'src' / 'toy.cpp'}" in r.output
    assert "command: " in r.output and "error" in r.output and "1 failed" in r.output


def test_targets_and_only_accept_comma_lists(tmp_path, monkeypatch):
    manifest = toy_project(tmp_path, cuda=False)
    gone = toolchains.Toolchain("metal", False, "", (), "xcrun not found (test)", "install Xcode")
    monkeypatch.setitem(toolchains.FINDERS, "metal", lambda: gone)
    monkeypatch.setattr(toolchains, "runs", lambda target: "")      # as on a Mac: auto skips only for the toolchain
    common = ["--dry-run", "--manifest", str(manifest), "--out", str(tmp_path / "o")]
    building = common[1:]
    r = run("compile", "--target", "cpu,metal", *building)        # explicit: a missing toolchain is an error
    assert r.exit_code == 2 and "target metal: xcrun not found (test)" in r.output and "fix: install Xcode" in r.output
    r = run("compile", "--target", "metal", "--json", *building)
    assert r.exit_code == 2 and json.loads(r.stdout) == {"ok": False, "error": r.stderr.split("error: ", 1)[1].rstrip()}
    assert not (tmp_path / "o").exists()
    with_metal = toy_project(tmp_path / "m", cuda=False, metal=True)
    r = run("compile", "--target", "cpu,metal", "--dry-run", "--manifest", str(with_metal), "--out", str(tmp_path / "o"))
    # a dry run plans it anyway (issue 12 item 26)
    assert r.exit_code == 0 and "not buildable here (xcrun not found (test))" in r.output
    assert "$ xcrun -sdk macosx metal" in r.output and "$ xcrun -sdk macosx metallib" in r.output
    r = run("compile", "--target", "auto,cpu", *common)           # auto: the same is a skip, with the reason
    assert r.exit_code == 0 and "skipped metal: xcrun not found (test) (fix: install Xcode)" in r.output
    r = run("compile", "--target", "cpu", "--only", "toy,toy", *common)
    assert r.exit_code == 0 and r.output.count("[1/1] toy cpu") == 1


def test_list_states_and_clean(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    common = ["--manifest", str(manifest), "--out", str(out)]
    r = run("list", *common)
    assert r.exit_code == 0 and "missing" in r.output
    assert "run: python -m build_tools compile --only toy --target cpu" in r.output
    run("compile", "--target", "cpu", *common)
    r = run("list", "--json", *common)
    [state] = json.loads(r.output)["artifacts"]
    assert state["state"] == "fresh" and state["path"].startswith(str(out))
    (tmp_path / "src" / "toy.h").write_text("#define TOY_VALUE 6.0f\n")
    r = run("list", *common)
    assert "stale" in r.output and "changed: src/toy.h" in r.output
    (out / "keep-me").mkdir()
    r = run("clean", *common)
    assert r.exit_code == 0 and "cleaned" in r.output
    assert not (out / "index.json").exists() and not (out / "toy").exists() and (out / "keep-me").is_dir()
    assert "missing" in run("list", *common).output


def test_doctor():
    r = run("doctor")
    assert r.exit_code == 0
    for target in ("metal", "cuda", "cpu"):
        line = next(line for line in r.output.splitlines() if re.match(rf"\[(ok|missing)\]\s+{target}\s", line))
        if line.startswith("[missing]"):
            assert toolchains.find(target).fix in r.output
    assert "artifacts are written to" in r.output
    assert re.search(r"builds what this machine runs: (\w+, )*cpu", r.output)   # the CPU always runs


def test_as_subprocess_noop_under_a_second(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    out = tmp_path / "out"
    env = subprocess_env()
    first = subprocess.run(compile_argv(manifest, out), cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["ok"] and "[1/1] toy cpu" in first.stderr
    start = time.monotonic()
    second = subprocess.run(compile_argv(manifest, out), cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    wall = time.monotonic() - start
    report = json.loads(second.stdout)
    assert second.returncode == 0 and report["counts"] == {"fresh": 1}
    assert report["seconds"] < 1.0                  # the command's own work
    assert wall < 5.0, f"a no-op compile took {wall:.1f}s including interpreter start-up"
    bad = subprocess.run([sys.executable, "-m", "build_tools", "validate", "--manifest", str(tmp_path / "none.yaml")],
                         cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "manifest not found" in bad.stderr
    helps = subprocess.run([sys.executable, "-m", "build_tools", "--help"], cwd=PROJECT_ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert helps.returncode == 0
    assert all(c in helps.stdout for c in ("compile", "list", "validate", "clean", "doctor"))


def test_cli_module_imports_cheaply():
    """Other helpers hang subcommands on the group: importing it must not pull in MLX or the registry."""
    code = ("import sys, build_tools.cli; "
            "print(sorted(m for m in ('mlx', 'mlx.core', 'registry', 'numpy', 'benchmarks') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, env=subprocess_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr
