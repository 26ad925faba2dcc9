"""Finding the compilers, their identities (part of every artifact key) and the fix when one is missing."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Toolchain:
    target: str
    available: bool
    identity: str          # compiler name + version text, hashed into artifact keys
    command: tuple[str, ...]  # argv prefix that runs the compiler
    detail: str            # what was found, or why not
    fix: str               # how to get it ("" when available)


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return p.returncode, (p.stdout + p.stderr).strip()


def _xcrun() -> list[str]:
    # TOOLCHAINS is honoured by xcrun itself; it is recorded in the identity so switching it rebuilds.
    return ["xcrun", "-sdk", "macosx"]


@functools.lru_cache(maxsize=None)
def metal() -> Toolchain:
    fix = ("install Xcode (the Command Line Tools lack `metal`), then `sudo xcode-select --switch "
           "/Applications/Xcode.app/Contents/Developer`; on Xcode 16+ also run "
           "`xcodebuild -downloadComponent MetalToolchain`")
    if shutil.which("xcrun") is None:
        where = "not macOS" if platform.system() != "Darwin" else "xcrun not on PATH"
        return Toolchain("metal", False, "", (), f"xcrun not found ({where})", fix)
    rc, metal_path = _run([*_xcrun(), "--find", "metal"])
    rc2, lib_path = _run([*_xcrun(), "--find", "metallib"])
    if rc != 0 or rc2 != 0:
        return Toolchain("metal", False, "", (), f"xcrun cannot find metal/metallib: {metal_path or lib_path}", fix)
    _, version = _run([*_xcrun(), "metal", "--version"])
    _, sdk = _run(["xcrun", "--sdk", "macosx", "--show-sdk-version"])
    identity = f"metal {version.splitlines()[0] if version else '?'} sdk {sdk} TOOLCHAINS={os.environ.get('TOOLCHAINS', '')}"
    return Toolchain("metal", True, identity, tuple(_xcrun()), f"{metal_path}, {lib_path} (SDK {sdk})", "")


@functools.lru_cache(maxsize=None)
def nvcc() -> Toolchain:
    fix = "install the CUDA toolkit (nvcc 12.8+; 13.0 tested) and put its bin/ on PATH, or set CUDA_HOME"
    candidates = [shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "nvcc"))
    path = next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)
    if path is None:
        return Toolchain("cuda", False, "", (), "nvcc not found on PATH, $CUDA_HOME or /usr/local/cuda", fix)
    rc, out = _run([path, "--version"])
    if rc != 0:
        return Toolchain("cuda", False, "", (), f"{path} --version failed: {out}", fix)
    release = next((line.strip() for line in out.splitlines() if "release" in line), out.splitlines()[-1])
    return Toolchain("cuda", True, f"nvcc {release}", (path,), f"{path} ({release})", "")


@functools.lru_cache(maxsize=None)
def cxx() -> Toolchain:
    fix = "install a C++17 compiler (Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install) or set CXX"
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in names:
        path = shutil.which(name)
        if path:
            rc, out = _run([path, "--version"])
            if rc == 0:
                return Toolchain("cpu", True, f"{name} {out.splitlines()[0]}", (path,), f"{path} ({out.splitlines()[0]})", "")
    return Toolchain("cpu", False, "", (), f"no C++ compiler among {', '.join(names)}", fix)


FINDERS = {"metal": metal, "cuda": nvcc, "cpu": cxx}


def find(target: str) -> Toolchain:
    return FINDERS[target]()


def clear_cache() -> None:
    for f in FINDERS.values():
        f.cache_clear()
