"""Finding the compilers, their identities (part of every artifact key) and the fix when one is missing.

One finder per target, cached per process (`clear_cache()` after changing PATH/CXX/TOOLCHAINS):
  metal  xcrun -sdk macosx --find metal / metallib, then `metal --version` (Xcode 26 ships the Metal
         toolchain as a separate download: xcrun finds a stub that fails until it is installed)
  cuda   nvcc on PATH, $CUDA_HOME, $CUDA_PATH or /usr/local/cuda
  cpu    $CXX (may carry arguments, e.g. "ccache g++"), else c++, g++, clang++
and which targets this machine can run (`runs`: MLX's backends and devices), for `--target auto`.
"""

from __future__ import annotations

import functools
import os
import platform
import shlex
import shutil
import subprocess
from dataclasses import dataclass

XCRUN = ("xcrun", "-sdk", "macosx")
METAL_FIX = ("install Xcode (the Command Line Tools lack `metal`) and select it: `sudo xcode-select --switch "
             "/Applications/Xcode.app/Contents/Developer`; Xcode 26+ also needs `xcodebuild -downloadComponent "
             "MetalToolchain`; to use another toolchain set TOOLCHAINS")
NVCC_FIX = ("install the CUDA toolkit (12.8+ for sm_100/sm_120; 13.0 tested) and put its bin/ on PATH, "
            "or set CUDA_HOME")
CXX_FIX = ("install a C++17 compiler (Debian/Ubuntu: `apt-get install g++`; macOS: `xcode-select --install`) "
           "or point CXX at one")


@dataclass(frozen=True)
class Toolchain:
    target: str
    available: bool
    identity: str                 # compiler + version + what steers it; hashed into artifact keys
    command: tuple[str, ...]      # argv prefix that runs the compiler
    detail: str                   # what was found, or why not
    fix: str                      # how to get it ("" when available)


def _run(argv: list[str] | tuple[str, ...]) -> tuple[int, str]:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return p.returncode, (p.stdout + p.stderr).strip()


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "?")


def _env_note(*names: str) -> str:
    return " ".join(f"{n}={os.environ.get(n, '')}" for n in names)


@functools.lru_cache(maxsize=None)
def metal() -> Toolchain:
    if shutil.which("xcrun") is None:
        why = "this is not macOS" if platform.system() != "Darwin" else "xcrun is not on PATH"
        return Toolchain("metal", False, "", (), f"xcrun not found ({why})", METAL_FIX)
    rc, metal_path = _run([*XCRUN, "--find", "metal"])
    rc2, lib_path = _run([*XCRUN, "--find", "metallib"])
    if rc != 0 or rc2 != 0:
        return Toolchain("metal", False, "", (),
                         f"`xcrun -sdk macosx --find metal|metallib` failed: {metal_path if rc else lib_path}", METAL_FIX)
    rc, version = _run([*XCRUN, "metal", "--version"])
    if rc != 0:
        return Toolchain("metal", False, "", (),
                         f"xcrun finds {metal_path} but it does not run (Metal toolchain missing?): "
                         f"{_first_line(version)}", METAL_FIX)
    _, sdk = _run([*XCRUN, "--show-sdk-version"])
    # xcrun picks the toolchain from TOOLCHAINS and DEVELOPER_DIR itself; both go into the identity
    # so switching either rebuilds.
    identity = (f"metal {_first_line(version)} ({metal_path}, {lib_path}) sdk {sdk} "
                f"{_env_note('TOOLCHAINS', 'DEVELOPER_DIR')}")
    return Toolchain("metal", True, identity, XCRUN, f"{metal_path}, {lib_path} (SDK {sdk}; {_first_line(version)})", "")


def _nvcc_path() -> str | None:
    candidates = [shutil.which("nvcc")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


@functools.lru_cache(maxsize=None)
def nvcc() -> Toolchain:
    path = _nvcc_path()
    if path is None:
        return Toolchain("cuda", False, "", (), "nvcc not found on PATH, $CUDA_HOME, $CUDA_PATH or /usr/local/cuda",
                         NVCC_FIX)
    rc, out = _run([path, "--version"])
    if rc != 0:
        return Toolchain("cuda", False, "", (), f"`{path} --version` failed: {_first_line(out)}", NVCC_FIX)
    release = next((line.strip() for line in out.splitlines() if "release" in line), _first_line(out))
    # nvcc reads these on every run, so they are part of what produced the binary.
    identity = f"nvcc {release} ({path}) {_env_note('NVCC_PREPEND_FLAGS', 'NVCC_APPEND_FLAGS')}"
    return Toolchain("cuda", True, identity, (path,), f"{path} ({release})", "")


@functools.lru_cache(maxsize=None)
def nvcc_archs() -> tuple[frozenset[str], str]:
    """(sm_XX and compute_XX values this nvcc can build, problem) from --list-gpu-code/--list-gpu-arch."""
    tc = nvcc()
    if not tc.available:
        return frozenset(), tc.detail
    rc, codes = _run([*tc.command, "--list-gpu-code"])
    rc2, archs = _run([*tc.command, "--list-gpu-arch"])
    if rc or rc2:
        return frozenset(), f"`nvcc --list-gpu-code/--list-gpu-arch` failed: {_first_line(codes if rc else archs)}"
    return frozenset((codes + "\n" + archs).split()), ""


@functools.lru_cache(maxsize=None)
def cxx() -> Toolchain:
    if os.environ.get("CXX", "").strip():
        candidates = [shlex.split(os.environ["CXX"])]
    else:
        candidates = [["c++"], ["g++"], ["clang++"]]
    tried = []
    for argv in candidates:
        path = shutil.which(argv[0])
        if path is None:
            tried.append(f"{argv[0]} (not found)")
            continue
        command = (path, *argv[1:])
        rc, out = _run([*command, "--version"])
        if rc != 0:
            tried.append(f"{' '.join(command)} (--version failed: {_first_line(out)})")
            continue
        identity = f"{' '.join(command)}: {_first_line(out)}"
        return Toolchain("cpu", True, identity, command, f"{' '.join(command)} ({_first_line(out)})", "")
    src = "$CXX" if os.environ.get("CXX", "").strip() else "c++, g++, clang++"
    return Toolchain("cpu", False, "", (), f"no working C++ compiler from {src}: {', '.join(tried)}", CXX_FIX)


FINDERS = {"metal": metal, "cuda": nvcc, "cpu": cxx}


def _mlx():
    import mlx.core as mx    # here, not at import: the CLI's other commands never load MLX
    return mx


@functools.lru_cache(maxsize=None)
def runs(target: str) -> str:
    """"" when this machine can run `target`'s kernels (the installed MLX has that backend and finds
    a device for it), else why not: what `compile --target auto` builds. The CPU always runs."""
    if target == "cpu":
        return ""
    if target == "metal" and platform.system() != "Darwin":
        return "this is not macOS"
    try:
        mx = _mlx()
    except ImportError as e:
        return f"MLX does not import ({e})"
    if target == "metal":
        return "" if mx.metal.is_available() else "MLX finds no Metal device"
    if not mx.cuda.is_available():
        return "the installed MLX has no CUDA backend (that is mlx[cuda13])"
    # is_available() says only that the backend is built in; the device count asks the driver
    return "" if mx.device_count(mx.gpu) > 0 else "MLX's CUDA backend finds no GPU"


def planned(target: str) -> Toolchain:
    """The found toolchain, else one with the usual command names (xcrun -sdk macosx, nvcc, c++) for
    printing a dry run's commands on a machine without it; never run."""
    tc = find(target)
    if tc.available:
        return tc
    command = {"metal": XCRUN, "cuda": ("nvcc",), "cpu": ("c++",)}[target]
    return Toolchain(target, False, "", command, tc.detail, tc.fix)


def find(target: str) -> Toolchain:
    return FINDERS[target]()


def clear_cache() -> None:
    for f in (*FINDERS.values(), nvcc_archs, runs):
        f.cache_clear()
