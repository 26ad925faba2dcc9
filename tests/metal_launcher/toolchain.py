"""Building csrc/'s Metal launcher on Linux against MLX 0.32.4's real macOS headers.

The macOS wheel mlx-metal==0.32.4 ships MLX's headers with metal-cpp (Apple's C++ Metal API); the
Apple system headers those include get the stand-ins of tests/apple_stubs/. `fetch_headers` downloads
the wheel once with pip and keeps its `mlx/include` in a cache directory (tests use pytest's cache:
.pytest_cache/d/mlx-metal-0.32.4/). What the extension compiles on Metal and with which flags is read
from csrc/CMakeLists.txt and the wheel's MLX CMake package, so a change there is followed here.
Used by tests/test_metal_launcher_compiles.py and tests/test_metal_launcher_abi.py (docs/metal.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from registry.paths import PROJECT_ROOT

HERE = Path(__file__).resolve().parent
CSRC = PROJECT_ROOT / "csrc"
STUBS = PROJECT_ROOT / "tests" / "apple_stubs"
MLX_METAL = "mlx-metal==0.32.4"
PLATFORM = "macosx_14_0_arm64"
CACHE_NAME = "mlx-metal-0.32.4"
INSTALL_CLANG = "apt-get update && apt-get install -y clang"

# pip's words (at -vv) for "the index could not be reached": DNS, refused, timeouts, proxies, TLS. An
# index that answers (a 404, no such version) is not among them and fails the test.
_NETWORK = re.compile(r"connection error|NewConnectionError|ConnectTimeoutError|ReadTimeoutError|"
                      r"Connection refused|Network is unreachable|Temporary failure in name resolution|"
                      r"Name or service not known|No route to host|ProxyError|SSLError|connection broken|"
                      r"timed out", re.I)


class RegistryUnreachable(RuntimeError):
    """pip could not reach the package index: the only reason these tests may skip."""


class BuildSetupError(RuntimeError):
    """The build description (CMakeLists.txt, the wheel) is not what this module can read."""


def clang() -> str:
    """clang++ from PATH. g++ cannot parse metal-cpp (it uses Apple's blocks extension, -fblocks)."""
    found = shutil.which("clang++")
    if found is None:
        raise FileNotFoundError(f"clang++ is not on PATH: the Metal launcher type-check needs clang (metal-cpp uses "
                                f"blocks, -fblocks, which g++ lacks); install it with `{INSTALL_CLANG}` "
                                f"(CI's .ci/run does)")
    return found


def pip_download(dest: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """Download the macOS wheel into dest; RegistryUnreachable when pip cannot reach the index."""
    cmd = [sys.executable, "-m", "pip", "download", "-vv", "--no-deps", "--only-binary=:all:", "--platform", PLATFORM,
           "--timeout", "30", "--retries", "1", "-d", str(dest), *pip_args, MLX_METAL]
    p = subprocess.run(cmd, capture_output=True, text=True)
    out = p.stdout + p.stderr
    wheels = sorted(dest.glob("mlx_metal-*.whl"))
    if p.returncode == 0 and wheels:
        return wheels[0]
    lines = [ln for ln in out.splitlines() if re.search(r"^ERROR|^WARNING|rror", ln) and "is ignored" not in ln]
    tail = "\n".join(lines[-12:])
    if _NETWORK.search(out):
        raise RegistryUnreachable(f"the package registry cannot be reached (`pip download {MLX_METAL}` failed "
                                  f"for network reasons):\n{tail}")
    raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {p.returncode}), not for a network reason:\n{tail}")


def fetch_headers(cache_dir: Path) -> Path:
    """mlx/include of the mlx-metal wheel, downloaded and extracted once into cache_dir/<CACHE_NAME>/."""
    root = cache_dir / CACHE_NAME
    include = root / "include"
    if (include / "mlx" / "backend" / "metal" / "device.h").is_file():
        return include
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download-", dir=root) as tmp:
        wheel = pip_download(Path(tmp))
        staged = Path(tmp) / "include"
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                name = info.filename
                if not name.startswith("mlx/include/") or info.is_dir():
                    continue
                rel = Path(name[len("mlx/include/"):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise RuntimeError(f"{wheel.name}: unsafe path {name!r} in the wheel")
                target = staged / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(info))
            cmake = z.read("mlx/share/cmake/MLX/MLXTargets.cmake")
        (staged / ".MLXTargets.cmake").write_bytes(cmake)  # the C++ standard MLX's consumers must use
        (staged / ".wheel").write_text(f"{wheel.name} sha256={hashlib.sha256(wheel.read_bytes()).hexdigest()}\n")
        try:
            os.replace(staged, include)  # atomic: a concurrent run either sees all of it or none
        except OSError:
            if not (include / "mlx" / "backend" / "metal" / "device.h").is_file():
                raise
    return include


@dataclass(frozen=True)
class MetalBuild:
    """What csrc/CMakeLists.txt compiles with the Metal backend, and how."""
    sources: tuple[Path, ...]
    std: str                 # -std=c++20
    defines: tuple[str, ...]

    def flags(self, include: Path) -> list[str]:
        """clang++ flags for one translation unit against the wheel's headers."""
        import nanobind  # the build's nanobind (pyproject's build-system pin, the `test` extra)
        import sysconfig

        return [self.std, "-fblocks", *[f"-D{d}" for d in self.defines], f"-I{include}", f"-I{include / 'metal_cpp'}",
                f"-I{CSRC}", "-isystem", str(STUBS), "-isystem", nanobind.include_dir(),
                "-isystem", sysconfig.get_paths()["include"]]


def _cmake_list(text: str, pattern: str, what: str) -> list[str]:
    m = re.search(pattern, text, re.S)
    if m is None:
        raise BuildSetupError(f"csrc/CMakeLists.txt: cannot find {what} (pattern {pattern!r}); update "
                              f"tests/metal_launcher/toolchain.py to follow it")
    return m.group(1).split()


def metal_build(include: Path, cmake_lists: Path = CSRC / "CMakeLists.txt") -> MetalBuild:
    """Sources, C++ standard and definitions of the Metal build, read from CMakeLists.txt; the standard
    must be the one MLX's CMake package requires of its consumers (INTERFACE_COMPILE_FEATURES)."""
    text = cmake_lists.read_text()
    common = _cmake_list(text, r"set\(SOURCES\s+([^)]*)\)", "`set(SOURCES ...)`")
    metal = _cmake_list(text, r'elseif\(BACKEND STREQUAL "metal"\)\s*list\(APPEND SOURCES\s+([^)]*)\)',
                        'the metal branch `list(APPEND SOURCES ...)`')
    std = _cmake_list(text, r"set\(CMAKE_CXX_STANDARD\s+(\d+)\)", "`set(CMAKE_CXX_STANDARD N)`")[0]
    mlx_std = re.search(r'INTERFACE_COMPILE_FEATURES\s+"cxx_std_(\d+)"', (include / ".MLXTargets.cmake").read_text())
    if mlx_std is None:
        raise BuildSetupError(f"{include}/.MLXTargets.cmake: no cxx_std_N compile feature for the mlx target")
    if mlx_std.group(1) != std:
        raise BuildSetupError(f"csrc/CMakeLists.txt builds with C++{std}, but MLX 0.32.4 requires C++{mlx_std.group(1)} "
                              f"of code including its headers (cxx_std_{mlx_std.group(1)})")
    module = _cmake_list(text, r"nanobind_add_module\(([^)]*)\)", "`nanobind_add_module(...)`")
    defines = ["NDEBUG"]  # CMAKE_BUILD_TYPE Release (setup.py passes it too)
    if "NB_DOMAIN" in module:
        defines.append(f"NB_DOMAIN={module[module.index('NB_DOMAIN') + 1]}")
    if "STABLE_ABI" in module and sys.version_info >= (3, 12):
        defines.append("Py_LIMITED_API=0x030C0000")  # nanobind's linked stable ABI, Python >= 3.12 only
    return MetalBuild(tuple(cmake_lists.parent / s for s in common + metal), f"-std=c++{std}", tuple(defines))


def _run_all(cmds: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run commands two at a time (CI has two cores)."""
    done = []
    for i in range(0, len(cmds), 2):
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds[i:i + 2]]
        for c, p in zip(cmds[i:i + 2], procs):
            out, err = p.communicate()
            done.append(subprocess.CompletedProcess(c, p.returncode, out, err))
    return done


def syntax_check(sources, flags: list[str], cache: Path | None = None) -> dict[Path, subprocess.CompletedProcess]:
    """`clang++ -fsyntax-only` of each source. With `cache`, a result is kept under the sha256 of
    everything the compile reads but the immutable wheel and system headers: the compiler, the
    flags, the source, the headers beside it, the stand-ins, nanobind's version and Python's."""
    cxx = clang()
    sources = list(sources)
    keys: dict[Path, Path] = {}
    if cache is not None:
        import nanobind

        cache.mkdir(parents=True, exist_ok=True)
        common = hashlib.sha256("\0".join([subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout,
                                           *flags, nanobind.__version__, sys.version]).encode())
        for f in sorted(STUBS.rglob("*.h")):
            common.update(f.read_bytes())
        for src in sources:
            h = common.copy()
            for f in [src, *sorted(src.parent.glob("*.h"))]:
                h.update(f.name.encode() + b"\0" + f.read_bytes())
            keys[src] = cache / f"{src.stem}-{h.hexdigest()[:24]}.json"
    results: dict[Path, subprocess.CompletedProcess] = {}
    for src in sources:
        if src in keys and keys[src].is_file():
            r = json.loads(keys[src].read_text())
            results[src] = subprocess.CompletedProcess(r["args"], r["returncode"], "", r["stderr"])
    todo = [s for s in sources if s not in results]
    for src, r in zip(todo, _run_all([[cxx, "-fsyntax-only", *flags, str(s)] for s in todo])):
        results[src] = r
        if src in keys:
            tmp = keys[src].with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"args": r.args, "returncode": r.returncode, "stderr": r.stderr}))
            os.replace(tmp, keys[src])
    return {s: results[s] for s in sources}


# ----------------------------------------------------------------------------- the launcher probe

PROBE_SOURCES = (HERE / "probe.cpp", HERE / "probe_msgsend.cpp", HERE / "probe_selectors.cpp")


def _libmlx() -> Path:
    import mlx.core as mx

    lib = Path(mx.__file__).resolve().parent / "lib"
    found = sorted(lib.glob("libmlx.*"))
    if not found:
        raise BuildSetupError(f"no libmlx in {lib}: install mlx[cpu]==0.32.4")
    return found[0]


def build_probe(cache_dir: Path, include: Path, launcher_dir: Path = CSRC) -> Path:
    """The probe executable: tests/metal_launcher/probe*.cpp + the launcher (the Metal build's sources
    but the bindings, from launcher_dir), linked with the Linux libmlx. Objects and the executable are
    keyed by the sha256 of what goes into them (sources, csrc headers, stand-ins, flags, compiler),
    under cache_dir/metal_launcher_probe/, so a changed launcher source recompiles only itself."""
    build = metal_build(include, launcher_dir / "CMakeLists.txt")
    launcher = [launcher_dir / s.name for s in build.sources if s.name != "bindings.cpp"]
    flags = [build.std, "-fblocks", "-O0", f"-I{include}", f"-I{include / 'metal_cpp'}", f"-I{launcher_dir}",
             "-isystem", str(STUBS)]
    lib = _libmlx()
    cxx = clang()
    common = hashlib.sha256("\0".join([*flags[:-3], subprocess.run(
        [cxx, "--version"], capture_output=True, text=True).stdout]).encode())
    for f in sorted([*launcher_dir.glob("*.h"), *STUBS.rglob("*.h")]):
        common.update(str(f.relative_to(f.parent.parent)).encode() + b"\0" + f.read_bytes())
    root = cache_dir / "metal_launcher_probe"
    (root / "obj").mkdir(parents=True, exist_ok=True)
    objects, compiles = [], []
    for src in [*PROBE_SOURCES, *launcher]:
        h = common.copy()
        h.update(src.name.encode() + b"\0" + src.read_bytes())
        obj = root / "obj" / f"{src.stem}-{h.hexdigest()[:20]}.o"
        objects.append(obj)
        if not obj.is_file():
            compiles.append((obj, [cxx, *flags, "-c", str(src), "-o", f"{obj}.{os.getpid()}.tmp"]))
    for (obj, cmd), p in zip(compiles, _run_all([c for _, c in compiles])):
        if p.returncode != 0:
            raise RuntimeError(f"building the launcher probe failed:\n{' '.join(cmd)}\n{p.stderr[-4000:]}")
        os.replace(f"{obj}.{os.getpid()}.tmp", obj)
    key = hashlib.sha256("\0".join([str(lib), str(lib.stat().st_size), *(o.name for o in objects)]).encode())
    exe = root / f"probe-{key.hexdigest()[:20]}"
    if exe.is_file():
        return exe
    tmp = f"{exe}.{os.getpid()}.tmp"
    cmd = [cxx, *map(str, objects), f"-L{lib.parent}", "-lmlx", f"-Wl,-rpath,{lib.parent}", "-o", tmp]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"linking the launcher probe failed:\n{' '.join(cmd)}\n{p.stderr[-4000:]}")
    os.replace(tmp, exe)
    return exe
