"""Hostile input (issue 12): every bad manifest, index, artifact or CLI argument ends in a clear error
naming the file, field or argument, never in a traceback, crash or hang, and nothing outside the
artifact directory is deleted or loaded. Sentinel files outside stay intact in every case.

Most cases run the CLI in-process (click's runner: an uncaught exception shows as `r.exception`);
the ones where a crash, a hang or an import side effect is the failure run as subprocesses."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from build_tools import compile_kernels
from build_tools.cli import cli
from registry import artifacts
from registry.errors import ManifestError
from registry.manifest import _RESERVED_ATTRS, flag_problem, load_manifest
from registry.paths import PROJECT_ROOT
from tests.test_build_pipeline import TOY_CPP, edit_manifest, subprocess_env, toy_project
from tests.test_manifest import GOOD, write


def run(*args: str):
    r = CliRunner().invoke(cli, [str(a) for a in args])
    # SystemExit is how click commands exit; anything else escaped as a traceback.
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.output
    return r


def sentinel(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "keep.txt").write_text("keep")
    return victim


def intact(victim: Path) -> bool:
    return (victim / "keep.txt").is_file() and (victim / "keep.txt").read_text() == "keep"


# ----------------------------------------------------------------------------- manifests

LAUGHS = ("a: &l0 [x, x, x, x, x, x, x, x, x]\n"
          + "".join(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(1, 9))
          + "schema_version: 1\nkernels: *l8\n")


def _kernel(**changes):
    def mutate(d):
        d["kernels"][0].update(changes)
    return mutate


def _target(target, **changes):
    def mutate(d):
        d["kernels"][0][target].update(changes)
    return mutate


MANIFEST_CASES = {
    # item: (mutation of GOOD or raw text, expected in the message)
    "7 billion laughs": (LAUGHS, "YAML aliases (*l0) are not supported"),
    "11 nested list": ("schema_version: 1\nkernels: " + "[" * 20000 + "]" * 20000 + "\n", "nesting deeper than 32"),
    "8 string repetition": (_kernel(requires=["'x' * 99999999999 == 'x'"]), "requires[0]: `'x' * 99999999999"),
    "8 %-formatting": (_kernel(requires=["'%999999999d' % head_dim == 'x'"]), "%-formatting) is not allowed"),
    "11 deep not": (_kernel(requires=["not " * 50000 + "True"]), "characters; the limit is 2000"),
    "11 deep minus": (_kernel(requires=["-" * 50000 + "1"]), "characters; the limit is 2000"),
    "11 long sum": (_kernel(requires=["+".join(["1"] * 100000)]), "characters; the limit is 2000"),
    "11 many nodes": (_kernel(requires=["not " * 400 + "True"]), "more than 200 nodes"),
    "9 lone {": (_kernel(requires=[{"expr": "head_dim > 0", "reason": "{"}]), "requires[0]: `head_dim > 0`: reason"),
    "9 lone }": (_kernel(requires=[{"expr": "head_dim > 0", "reason": "}"}]), "is not a valid template"),
    "10 entries int": (_kernel(entries=5), "entries: expected a non-empty mapping"),
    "10 entries bool": (_kernel(entries=True), "entries: expected a non-empty mapping"),
    "12 NUL in a path": (_target("cpu", sources=["src/toy\0.cpp"]), "cpu.sources[0]: 'src/toy\\x00.cpp' is not a path"),
    "4 -B": (_target("cpu", flags=["-Bevil/"]), "cpu.flags[0]: '-Bevil/' is not an allowed compiler flag"),
    "4 -ccbin": (_target("cuda", flags=["-ccbin=evil"]), "cuda.flags[0]: '-ccbin=evil' is not an allowed"),
    "4 --compiler-bindir": (_target("cuda", flags=["--compiler-bindir=/tmp"]), "is not an allowed compiler flag"),
    "4 -Wl,": (_target("cpu", flags=["-Wl,-rpath,/tmp"]), "'-Wl,-rpath,/tmp' is not an allowed"),
    "4 -fplugin": (_target("cpu", flags=["-fplugin=evil.so"]), "'-fplugin=evil.so' is not an allowed"),
    "4 -fuse-ld": (_target("cpu", flags=["-fuse-ld=evil"]), "'-fuse-ld=evil' is not an allowed"),
    "-fsanitize=address": (_target("cpu", flags=["-fsanitize=address"]), "'-fsanitize=address' is not an allowed"),
    "4 -Xcompiler": (_target("cuda", flags=["-Xcompiler"]), "'-Xcompiler' is not an allowed"),
    "17 -I/etc": (_target("cpu", flags=["-I/etc"]), "cpu.flags[0]: '-I/etc': include paths and forced includes"),
    "17 -include": (_target("cpu", flags=["-include", "/abs/outside.h"]), "'-include': include paths"),
    "15 os:system": (_kernel(wrapper="os:system"), "wrapper: os:system: module 'os' is outside the registry package"),
    "20 unknown module": (_kernel(wrapper="registry.nosuch:build"), "module registry.nosuch not found"),
    "20 unknown attr": (_kernel(check="registry.manifest:nosuch"), "defines no top-level 'nosuch'"),
    "20 private attr": (_kernel(wrapper="registry.manifest:_read_text"), "private names"),
    "18 schema_version true": (lambda d: d.update(schema_version=True), "schema_version: True is not supported"),
    "19 dunder kernel_attr": (_kernel(kernel_attr="__class__"), "kernel_attr: '__class__' is not a public identifier"),
    "19 private kernel_attr": (_kernel(kernel_attr="_by_attr"), "kernel_attr: '_by_attr' is not a public identifier"),
    "24 200 kB name": (_kernel(name="k" * 200_000), "is longer than 64 characters"),
    "yaml integer of 5000 digits": ("schema_version: " + "9" * 5000 + "\nkernels: []\n",
                                    "kernels.yaml:1: not valid YAML: an integer of 5000 characters; the limit is 64"),
    "yaml !!int on a word": ("schema_version: 1\nkernels: []\nx: !!int x\n", "kernels.yaml:3: not valid YAML: "
                             "cannot read 'x' as !!int (ValueError: invalid literal"),
    "yaml !!timestamp out of range": ("schema_version: !!timestamp 2001-13-99\nkernels: []\n",
                                      "kernels.yaml:1: not valid YAML: cannot read '2001-13-99' as !!timestamp"),
    "yaml !!bool on a word": ("schema_version: !!bool x\nkernels: []\n", "kernels.yaml:1: not valid YAML: cannot read"),
    "yaml !!map on a scalar": ("schema_version: 1\nkernels: []\nx: !!map y\n",
                               "kernels.yaml:3: not valid YAML: !!map on a scalar: expected a mapping"),
    "control character": ("schema_version: 1\nkernels: []\n# \x1b[2J\n",
                          "kernels.yaml:3: not valid YAML: unacceptable character #x001b"),
    "25 5 MB manifest": ("schema_version: 1\nkernels: []\n" + "# padding\n" * 500_000, "the limit is 262144"),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_hostile_manifest_is_a_clear_error(tmp_path, case):
    mutate, expected = MANIFEST_CASES[case]
    if isinstance(mutate, str):
        path = write(tmp_path, text=mutate)
    else:
        data = copy.deepcopy(GOOD)
        mutate(data)
        path = write(tmp_path, data)
    r = run("validate", "--manifest", path)
    assert r.exit_code == 1, r.output
    assert expected in r.output
    assert r.output.startswith(("kernels.yaml:", str(path)))
    assert len(r.output) < 20_000           # nothing big is repr'd


def test_long_name_says_the_limit(tmp_path):
    data = copy.deepcopy(GOOD)
    data["kernels"][0]["name"] = "k" * 200_000
    with pytest.raises(ManifestError, match="200000 characters.* is longer than 64 characters"):
        load_manifest(write(tmp_path, data))


@pytest.mark.parametrize("flag", ["-DTOY=1", "-UNDEBUG", "-O2", "-ffast-math", "-fno-exceptions", "-Wall",
                                  "-Werror=shadow", "-march=native", "-std=c++20", "-g"])
def test_allowed_flags(flag):
    assert flag_problem(flag, "cpu") is None


@pytest.mark.parametrize("flag", ["--use_fast_math", "-use_fast_math", "--ftz=true", "--prec-div=false",
                                  "-lineinfo", "--maxrregcount=64", "-Xptxas=-v"])
def test_nvcc_switches(flag):
    assert (flag_problem(flag, "cuda") is None) is (flag != "-Xptxas=-v")
    assert flag_problem(flag, "cpu") is not None


@pytest.mark.parametrize("flag", ["-DX=$(rm)", "-DX=a b", "-D1X", "-o/tmp/x", "-specs=x", "@args.txt", "-MF/tmp/d",
                                  "-save-temps", "-lfoo", "-L/tmp", "-fprofile-generate", "-x", "-Wa,-x", "-Wp,-x",
                                  "-iquoteinc", "-isystem/usr", "-O2\n", "-DX=1\n"])
def test_refused_flags(flag):
    assert flag_problem(flag, "cpu") is not None


def test_nvcc_switch_with_a_trailing_newline_is_refused():
    assert flag_problem("--maxrregcount=64\n", "cuda") is not None


def test_allowed_flags_reach_the_command(tmp_path):
    manifest = toy_project(tmp_path, cuda=False)
    edit_manifest(manifest, lambda k: k["cpu"].update(flags=["-DTOY_EXTRA=2", "-O2"]))
    r = compile_kernels(targets="cpu", manifest=manifest, out_dir=tmp_path / "o", dry_run=True)
    assert "-DTOY_EXTRA=2" in r.results[0].commands[0]


def test_reserved_attrs_cover_kernel_set():
    from registry.core import KernelSet
    public = {a for a in dir(KernelSet) if not a.startswith("_")}
    assert public <= _RESERVED_ATTRS


def test_hook_that_is_not_callable(tmp_path):
    from registry import KernelRegistry
    data = copy.deepcopy(GOOD)
    data["kernels"][0]["wrapper"] = "registry.manifest:SCHEMA_VERSION"
    data["kernels"][0]["requires"] = []
    reg = KernelRegistry.from_yaml(write(tmp_path, data))
    with pytest.raises(ManifestError, match="wrapper: registry.manifest:SCHEMA_VERSION is a int, not a function"):
        reg.build_kernel_set(sample_attn=None, n_kv_heads=2, head_dim=32)


def test_many_kernels_parse_each_hook_module_once(tmp_path, monkeypatch):
    """A 256 kB manifest of ~2900 kernels naming hooks took 64 s: every hook re-parsed its module."""
    import ast
    from registry import manifest as manifest_module
    parses = []
    real_parse = ast.parse
    monkeypatch.setattr(manifest_module.ast, "parse", lambda *a, **kw: parses.append(1) or real_parse(*a, **kw))
    kernel = '- {wrapper: "registry.manifest:load_manifest", check: "registry.core:build_kernel_set"}\n'
    path = write(tmp_path, text="schema_version: 1\nkernels:\n" + kernel * 200)
    with pytest.raises(ManifestError, match="kernels.yaml:3: kernels\\[0\\]: missing required key"):
        load_manifest(path)
    assert len(parses) <= 2


def test_hooks_outside_the_allow_list_are_never_imported(tmp_path):
    # `this` prints the Zen of Python when imported: the message must come without it.
    data = copy.deepcopy(GOOD)
    data["kernels"][0]["wrapper"] = "this:s"
    path = write(tmp_path, data)
    p = subprocess.run([sys.executable, "-m", "build_tools", "validate", "--manifest", str(path)], cwd=PROJECT_ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "wrapper: this:s: module 'this' is outside the registry package" in p.stderr
    assert "Beautiful is better than ugly" not in p.stdout + p.stderr and "Traceback" not in p.stderr


def test_fifo_manifest_does_not_hang(tmp_path):
    fifo = tmp_path / "kernels.yaml"
    os.mkfifo(fifo)
    p = subprocess.run([sys.executable, "-m", "build_tools", "validate", "--manifest", str(fifo)], cwd=PROJECT_ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "not a regular file" in p.stderr and "Traceback" not in p.stderr


def test_an_include_of_a_fifo_is_an_error_not_a_hang(tmp_path):
    """A source whose #include resolves to a FIFO: the compiler would block reading it. compile fails that
    unit naming the source line, `list` shows the artifact stale with the same line, and the registry's
    lookup says why there is no artifact; none of them hangs or raises a traceback."""
    manifest = toy_project(tmp_path / "p", cuda=False)
    src = manifest.parent / "src"
    os.mkfifo(src / "evil.h")
    (src / "toy.cpp").write_text(TOY_CPP.replace('#include "toy.h"', '#include "toy.h"\n#include "evil.h"'))
    out = tmp_path / "out"
    says = f'toy.cpp:2: #include "evil.h" resolves to {(src / "evil.h").resolve()}, which is not a regular file'
    p = subprocess.run([sys.executable, "-m", "build_tools", "compile", "--manifest", str(manifest), "--target", "cpu",
                        "--out", str(out)], cwd=PROJECT_ROOT, env=subprocess_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and says in p.stdout + p.stderr and "Traceback" not in p.stderr, p.stdout + p.stderr
    r = run("list", "--manifest", manifest, "--out", out)
    assert says in r.output and "stale" in r.output, r.output
    found = artifacts.lookup(load_manifest(manifest).kernel("toy"), "cpu")
    assert found.path is None and says in found.reason, found


def test_requirement_bounds_at_selection_time():
    from registry.expr import compile_requirement
    ctx = dict(attention="mha", rope=None, rope_error="x", n_heads=8, n_kv_heads=2, head_dim=4000000000,
               dtype="float16", backend="cpu")
    assert compile_requirement("dtype * head_dim == 'x'").holds(ctx) is False          # no repetition
    assert compile_requirement("head_dim * head_dim * head_dim > 0").holds(ctx) is False  # beyond 2**63
    assert compile_requirement("rope_error + dtype == 'xfloat16'").holds(ctx) is False   # numbers only
    assert compile_requirement("head_dim * 2 > 0").holds(ctx) is True


# ----------------------------------------------------------------------------- built toy artifacts

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One toy CPU build, copied per test (a compile is the slow part)."""
    root = tmp_path_factory.mktemp("built")
    manifest = toy_project(root, cuda=False)
    report = compile_kernels(targets="cpu", manifest=manifest, out_dir=root / "out")
    assert report.ok
    return root


@pytest.fixture
def toy(built, tmp_path, monkeypatch):
    shutil.copytree(built, tmp_path / "p", symlinks=True)
    root = tmp_path / "p"
    monkeypatch.setenv("MLX_AOT_CACHE_DIR", str(root / "out"))
    return root


def spec_of(root: Path):
    return load_manifest(root / "kernels.yaml").kernel("toy")


def index_json(root: Path) -> dict:
    return json.loads((root / "out" / "index.json").read_text())


def set_index(root: Path, **fields) -> None:
    data = index_json(root)
    data["artifacts"][0].update(fields)
    (root / "out" / "index.json").write_text(json.dumps(data))


def so_path(root: Path) -> Path:
    return root / "out" / index_json(root)["artifacts"][0]["file"]


def test_toy_lookup_baseline(toy):
    found = artifacts.lookup(spec_of(toy), "cpu")
    assert found.path == so_path(toy) and found.data == so_path(toy).read_bytes()


INDEX_CASES = {
    # item: (edit of the index entry, expected in the reason)
    "5 entries not the manifest's": (dict(entries={"float32": "other_f32"}),
                                      "float32: 'other_f32' in the index, 'toy_f32' in kernels.yaml"),
    "6 absolute file": (dict(file="/etc/passwd"), "is '/etc/passwd', not toy/cpu/toy."),
    "6 dotdot file": (dict(file="../victim/keep.txt"), "is '../victim/keep.txt', not toy/cpu/"),
    "13 file int": (dict(file=123), "artifacts[0].file: expected a relative path string, got int 123"),
    "13 arch list": (dict(arch=["sm_90"]), "artifacts[0].arch: expected null or a CUDA arch"),
    "13 entries str": (dict(entries="abc"), "artifacts[0].entries: expected a mapping"),
    "13 size str": (dict(size="12"), "artifacts[0].size: expected a non-negative integer"),
    "13 kernel path": (dict(kernel="../victim"), "artifacts[0].kernel: expected a kernel name"),
    "kernel name with a newline": (dict(kernel="toy\n"), "artifacts[0].kernel: expected a kernel name"),
    "13 cpu with arch": (dict(arch="sm_90"), "only cuda artifacts have an arch"),
    "size mismatch": (dict(size=1), "the index says 1 (corrupt or half-written)"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_hostile_index_falls_back_with_the_reason(toy, case):
    edit, expected = INDEX_CASES[case]
    set_index(toy, **edit)
    found = artifacts.lookup(spec_of(toy), "cpu")
    assert found.path is None and found.data is None and expected in found.reason
    r = run("list", "--manifest", toy / "kernels.yaml", "--out", toy / "out")
    assert r.exit_code == 0 and "stale" in r.output and expected in r.output


def test_symlinked_artifact_is_refused(toy, tmp_path):
    so = so_path(toy)
    outside = tmp_path / "outside.so"
    shutil.copy(so, outside)             # the right bytes, but not inside the artifact directory
    so.unlink()
    so.symlink_to(outside)
    found = artifacts.lookup(spec_of(toy), "cpu")
    assert found.path is None and "is a symlink" in found.reason


def test_symlinked_kernel_dir_is_refused(toy, tmp_path):
    (toy / "out" / "toy").rename(tmp_path / "elsewhere")
    (toy / "out" / "toy").symlink_to(tmp_path / "elsewhere")
    found = artifacts.lookup(spec_of(toy), "cpu")
    assert found.path is None and "is a symlink or not a directory" in found.reason


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dev-zero"])
def test_special_index_files_are_refused_without_hanging(toy, kind):
    index = toy / "out" / "index.json"
    index.unlink()
    if kind == "symlink":
        (toy / "elsewhere.json").write_text(json.dumps({"schema": artifacts.INDEX_SCHEMA, "artifacts": []}))
        index.symlink_to(toy / "elsewhere.json")
    elif kind == "fifo":
        os.mkfifo(index)
    else:
        index.symlink_to("/dev/zero")
    _, problem = artifacts.read_index(toy / "out")
    assert problem and ("is a symlink" in problem or "not a regular file" in problem)
    code = "from registry import artifacts; import sys; print(artifacts.read_index(sys.argv[1])[1])"
    p = subprocess.run([sys.executable, "-c", code, str(toy / "out")], cwd=PROJECT_ROOT, env=subprocess_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "unreadable index" in p.stdout


def test_oversized_artifact_is_refused(toy, monkeypatch):
    monkeypatch.setattr(artifacts, "MAX_ARTIFACT_BYTES", 100)
    found = artifacts.lookup(spec_of(toy), "cpu")
    assert found.path is None and "the limit is 100" in found.reason


def test_missing_entry_symbol_is_refused_at_lookup(toy):
    # A .so with the recorded sha256 but without the entry: only possible if the index is forged.
    so = so_path(toy)
    data = so.read_bytes().replace(b"toy_f32", b"toy_g32")
    so.write_bytes(data)
    import hashlib
    set_index(toy, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    found = artifacts.lookup(spec_of(toy), "cpu")
    assert found.path is None and "entry symbol(s) toy_f32 of kernels.yaml are not in it" in found.reason


def _forged_elf(n_syms: int, name_len: int, n_tables: int, distinct_names: bool) -> bytes:
    """A 64-bit ELF whose `n_tables` .dynsym sections all cover the same `n_syms` symbols, named
    into one `name_len`-byte string without a NUL (each at its own offset when `distinct_names`)."""
    import struct
    syms = b"".join(struct.pack("<IBBHQQ", 1 + (i if distinct_names else 0), 0x12, 0, 1, 0, 0) for i in range(n_syms))
    strtab = b"\0" + b"A" * name_len + b"\0"
    header = bytearray(64)
    header[0:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, 64 + len(syms) + len(strtab))
    struct.pack_into("<HH", header, 0x3A, 64, n_tables + 1)
    sections = struct.pack("<IIQQQQIIQQ", 0, 3, 0, 0, 64 + len(syms), len(strtab), 0, 0, 0, 0)
    sections += struct.pack("<IIQQQQIIQQ", 0, 11, 0, 0, 64, len(syms), 0, 0, 0, 24) * n_tables
    return bytes(header) + syms + strtab + sections


@pytest.mark.parametrize("tables, distinct, expected", [
    (10, False, "symbol tables larger than the file"),     # was ~200 MB and 0.4 s per 25 kB of file
    (1, True, "symbol names longer than the file"),        # was ~20 MB per 20 kB: quadratic
])
def test_forged_elf_costs_no_more_than_its_size(toy, tables, distinct, expected):
    """An artifact whose index entry matches it (sha256, size) but whose symbol tables overlap: the
    entry check refuses it in time and memory linear in its size."""
    import hashlib
    data = _forged_elf(1000, 20_000, tables, distinct)
    so_path(toy).write_bytes(data)
    set_index(toy, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    found = artifacts.lookup(spec_of(toy), "cpu")
    assert found.path is None and f"malformed ELF file ({expected})" in found.reason


def test_ptx_entry_scan_is_linear():
    import time
    from registry.symbols import ptx_entries
    start = time.monotonic()
    assert ptx_entries(b"\n" * 30_000 + b"x\n.visible .entry toy_f32(\n") == {"toy_f32"}   # was ~20 s
    assert time.monotonic() - start < 2


def _launcher(root: Path):
    from registry.native import load_launcher
    launcher, why = load_launcher(spec_of(root), "cpu")
    assert launcher is not None, why
    return launcher


def _run_toy(launcher) -> float:
    x = mx.zeros((4,), dtype=mx.float32)
    # A CPU artifact runs on the CPU stream, also where the default device is a GPU.
    [out] = launcher.launch("float32", {"x": x}, {}, grid=(1, 1, 1), threadgroup=(1, 1, 1), stream=mx.cpu)
    mx.eval(out)
    return float(np.array(out)[0])


def test_swapped_artifact_after_verification_never_runs(toy, tmp_path):
    """Item 1: the launcher loads the bytes it verified; a file swapped in afterwards (constructor
    included) is never loaded."""
    evil_root = tmp_path / "evil"
    marker = tmp_path / "constructor-ran"
    manifest = toy_project(evil_root, cuda=False)
    (evil_root / "src" / "toy.cpp").write_text(
        '#include <cstdio>\n__attribute__((constructor)) static void evil() { FILE* f = fopen("'
        + str(marker) + '", "w"); if (f) fclose(f); }\n' + TOY_CPP.replace("TOY_VALUE", "7.0f"))
    assert compile_kernels(targets="cpu", manifest=manifest, out_dir=evil_root / "out").ok
    [evil_so] = (evil_root / "out" / "toy" / "cpu").glob("*.so")
    launcher = _launcher(toy)
    shutil.copy(evil_so, so_path(toy))       # swapped between verification and the first call
    assert _run_toy(launcher) == 1.0
    assert not marker.exists()
    if sys.platform.startswith("linux"):
        assert "memfd:mlx_aot" in Path("/proc/self/maps").read_text()


# ----------------------------------------------------------------------------- clean

@pytest.mark.parametrize("only", ["../victim", "/abs/path", "nosuch", "", "toy,../victim"])
def test_clean_only_names_manifest_kernels(toy, tmp_path, only):
    victim = sentinel(toy)            # toy/victim == out/../victim
    r = run("clean", "--manifest", toy / "kernels.yaml", "--out", toy / "out", "--only", only)
    assert r.exit_code == 2 and "--only:" in r.output
    assert intact(victim) and so_path(toy).is_file()


def test_clean_ignores_hostile_index_names(toy):
    victim = sentinel(toy)
    data = index_json(toy)
    data["artifacts"][0]["kernel"] = "../victim"
    (toy / "out" / "index.json").write_text(json.dumps(data))
    r = run("clean", "--manifest", toy / "kernels.yaml", "--out", toy / "out")
    assert r.exit_code == 0 and intact(victim)
    assert not (toy / "out" / "toy").exists()         # the manifest's own kernel is still cleaned


def test_clean_refuses_symlinked_kernel_dir(toy, tmp_path):
    victim = sentinel(tmp_path)
    shutil.rmtree(toy / "out" / "toy")
    (toy / "out" / "toy").symlink_to(victim)
    r = run("clean", "--manifest", toy / "kernels.yaml", "--out", toy / "out")
    assert r.exit_code == 1 and f"refused to remove {toy / 'out' / 'toy'}" in r.output
    assert intact(victim)


def test_build_refuses_symlinked_kernel_dir(toy, tmp_path):
    victim = sentinel(tmp_path)
    shutil.rmtree(toy / "out" / "toy")
    (toy / "out" / "toy").symlink_to(victim)
    r = compile_kernels(targets="cpu", manifest=toy / "kernels.yaml", out_dir=toy / "out")
    assert not r.ok and "is or passes through a symlink" in r.results[0].message
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]


# ----------------------------------------------------------------------------- CLI arguments

@pytest.mark.parametrize("args, expected", [
    (["compile", "--target", ""], "targets: empty"),
    (["compile", "--target", "cpu", "--arch", "sm_90"], "--arch sets CUDA archs, but no cuda target is built"),
    (["compile", "--target", "cpu", "--only", ""], "only: an empty value"),
    (["compile", "--target", "cpu", "--only", "../victim"], "only: unknown kernel(s) ../victim"),
])
def test_bad_compile_arguments(toy, args, expected):
    r = run(*args, "--manifest", toy / "kernels.yaml", "--out", toy / "out", "--dry-run")
    assert r.exit_code == 2 and expected in r.output


@pytest.mark.parametrize("command", ["compile", "list", "clean"])
def test_empty_out_is_an_error_not_the_current_directory(toy, monkeypatch, command):
    monkeypatch.chdir(toy)   # holds index.json-like files nobody asked to touch
    r = run(command, "--manifest", toy / "kernels.yaml", "--out", "")
    assert r.exit_code == 2 and "'--out': an empty path" in r.output, r.output


def test_relative_out_builds_there(tmp_path, monkeypatch):
    """The compiler runs in the manifest's directory: a relative --out is taken from the caller's
    working directory, not silently from there (the build failed with a missing dependency file)."""
    manifest = toy_project(tmp_path / "proj", cuda=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = run("compile", "--target", "cpu", "--manifest", manifest, "--out", "rel")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "elsewhere" / "rel" / "index.json").is_file() and not (tmp_path / "proj" / "rel").exists()


@pytest.mark.parametrize("only", ["", "../victim"])
def test_bad_list_only(toy, only):
    r = run("list", "--manifest", toy / "kernels.yaml", "--out", toy / "out", "--only", only)
    assert r.exit_code == 2 and "only: " in r.output


def test_env_table_file_that_is_not_text(tmp_path):
    binary = tmp_path / "env.md"
    binary.write_bytes(b"\xff\xfe table")
    r = run("env-table", "--file", binary)
    assert r.exit_code == 2 and f"--file {binary}: cannot read it as UTF-8 text" in r.output, r.output


def test_env_table_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "env.md"
    os.mkfifo(fifo)
    p = subprocess.run([sys.executable, "-m", "build_tools", "env-table", "--file", str(fifo)], cwd=PROJECT_ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "not a regular file" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_doctor_with_a_missing_manifest_fails(tmp_path):
    r = run("doctor", "--manifest", tmp_path / "missing.yaml")
    assert r.exit_code == 1 and "manifest not found" in r.output


def test_killed_build_temp_dirs_are_swept(toy):
    """Item 27: a kill -9 during a --force rebuild leaves a temp dir although the unit stays fresh."""
    from build_tools.compiler import UNIT_LOCKS, file_lock
    out = toy / "out"
    dead = out / ".tmp-toy.cpu.any-dead1234"
    dead.mkdir()
    (dead / "0_toy.o").write_text("half")
    live = out / ".tmp-toy.cuda.sm_90-live5678"
    live.mkdir()
    unrelated = out / ".tmp-notes"
    unrelated.mkdir()
    with file_lock(out / UNIT_LOCKS / "toy.cuda.sm_90.lock", 1):   # a build of that unit is running
        r = compile_kernels(targets="cpu", manifest=toy / "kernels.yaml", out_dir=out)
    assert r.ok and r.results[0].status == "fresh"
    assert not dead.exists() and live.is_dir() and unrelated.is_dir()


def test_fp32_position_limit_is_documented():
    """Item 28: positions beyond 2**24 are not representable as fp32 (the angle is computed in fp32),
    so neighbouring positions collide; the limit is documented where the ABI is."""
    assert np.float32(2**24 + 1) == np.float32(2**24) and np.float32(2**24 - 1) != np.float32(2**24)
    text = (PROJECT_ROOT / "docs" / "kernel-abi.md").read_text()
    assert "2^24" in text and "16,777,216" in text
