"""Run metal_src/*.metal kernels on the CPU: the source is preprocessed, its Metal-only syntax is
mapped onto tests/metal_emu/metal_shim.h, it is compiled with the host C++ compiler, and every
thread of the launch grid runs in turn, threadgroup by threadgroup, exactly as dispatch_threads
would launch them (docs/metal.md says what this does and does not verify).

Any Metal feature outside the shim raises UnsupportedMetalFeature naming it; nothing is skipped.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SUPPORTED_ATTRIBUTES = ("kernel", "buffer", "thread_position_in_grid", "function_constant", "host_name")
# Features a kernel could use that the sequential emulation cannot reproduce faithfully.
UNSUPPORTED = ("threadgroup", "simdgroup", "simd_", "atomic", "barrier", "texture", "sampler", "imageblock",
               "mem_flags", "quad_")


class UnsupportedMetalFeature(RuntimeError):
    pass


@dataclass
class Param:
    kind: str          # "buffer" | "gid"
    index: int
    ctype: str         # C++ type with the template parameter still named
    name: str


def _cxx() -> str:
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("no C++ compiler (g++/clang++) found for the Metal emulation")


def _preprocess(source: Path, include_dirs: list[Path]) -> str:
    """Run the C preprocessor over the kernel (macros expanded, comments gone) without Metal's headers."""
    text = source.read_text()
    text = re.sub(r"#\s*include\s*<metal_stdlib>", "", text)
    p = subprocess.run([_cxx(), "-E", "-P", "-x", "c++", *[f"-I{d}" for d in include_dirs], "-"],
                       input=text, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"preprocessing {source} failed:\n{p.stderr}")
    return p.stdout


def _check_features(text: str, source: Path) -> None:
    for attr in re.findall(r"\[\[\s*([A-Za-z_]\w*)", text):
        if attr not in SUPPORTED_ATTRIBUTES:
            raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: attribute [[{attr}]] "
                                          f"(the emulator supports {', '.join(SUPPORTED_ATTRIBUTES)})")
    for word in UNSUPPORTED:
        m = re.search(rf"\b{word}\w*", text)
        if m:
            raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: {m.group(0)} (threadgroup memory, "
                                          f"SIMD-group, atomics and barriers need a real GPU)")


def _parse_kernel(text: str) -> tuple[str, str, list[Param]]:
    m = re.search(r"template\s*<\s*typename\s+(\w+)\s*>\s*\[\[\s*kernel\s*\]\]\s*void\s+(\w+)\s*\((.*?)\)\s*\{",
                  text, flags=re.S)
    if not m:
        raise UnsupportedMetalFeature("no `template <typename T> [[kernel]] void f(...)` found: the emulator "
                                      "drives templated kernels instantiated with [[host_name]]")
    tparam, name, params_text = m.group(1), m.group(2), m.group(3)
    params = []
    for raw in (p.strip() for p in params_text.split(",")):
        attr = re.search(r"\[\[\s*(buffer\s*\(\s*(\d+)\s*\)|thread_position_in_grid)\s*\]\]", raw)
        if not attr:
            raise UnsupportedMetalFeature(f"kernel parameter without a supported attribute: {raw!r}")
        decl = re.sub(r"\[\[.*?\]\]", "", raw).strip()
        pname = re.findall(r"(\w+)\s*$", decl)[0]
        ctype = decl[: decl.rfind(pname)].strip()
        if attr.group(2) is not None:
            params.append(Param("buffer", int(attr.group(2)), ctype, pname))
        else:
            params.append(Param("gid", -1, ctype, pname))
    return tparam, name, params


def translate(source: Path, include_dirs: list[Path] | None = None) -> str:
    """The kernel as host C++ with one `extern "C"` driver per [[host_name]] instantiation."""
    text = _preprocess(source, include_dirs or [source.parent])
    _check_features(text, source)
    tparam, kernel_name, params = _parse_kernel(text)
    instances = re.findall(r"template\s*\[\[\s*host_name\s*\(\s*\"(\w+)\"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*void\s+"
                           + kernel_name + r"\s*<\s*(\w+)\s*>\s*\(.*?\)\s*;", text, flags=re.S)
    if not instances:
        raise UnsupportedMetalFeature(f"{source}: no [[host_name(...)]] instantiation of {kernel_name}")
    text = re.sub(r"template\s*\[\[\s*host_name.*?\)\s*;", "", text, flags=re.S)      # instantiations
    text = re.sub(r"constant\s+(\w+)\s+(\w+)\s*\[\[\s*function_constant\s*\(\s*(\d+)\s*\)\s*\]\]\s*;",
                  r"AOT_FUNCTION_CONSTANT(\1, \2, \3);", text)
    text = re.sub(r"\[\[.*?\]\]", "", text)
    drivers = []
    for host_name, tname in instances:
        args = []
        for p in params:
            if p.kind == "gid":
                args.append("uint3{(uint)x, (uint)y, (uint)z}")
                continue
            ctype = re.sub(rf"\b{tparam}\b", tname, re.sub(r"\bdevice\b|\bconstant\b", "", p.ctype))
            ctype = re.sub(r"\s+", " ", ctype).strip()
            if ctype.endswith("&"):
                args.append(f"*({ctype[:-1].strip()}*)buffers[{p.index}]")
            else:
                args.append(f"({ctype})buffers[{p.index}]")
        drivers.append(f'''
extern "C" void {host_name}(void** buffers, const int* grid, const int* group, const uint32_t* constants,
                            int n_constants) {{
  for (auto& c : metal_emu::function_constants()) {{
    if (c.index < n_constants) std::memcpy(c.ptr, &constants[c.index], c.size);
  }}
  // dispatch_threads: whole threadgroups, edge groups clipped to the grid, x fastest.
  for (int gz = 0; gz < (grid[2] + group[2] - 1) / group[2]; ++gz)
  for (int gy = 0; gy < (grid[1] + group[1] - 1) / group[1]; ++gy)
  for (int gx = 0; gx < (grid[0] + group[0] - 1) / group[0]; ++gx)
  for (int tz = 0; tz < group[2]; ++tz)
  for (int ty = 0; ty < group[1]; ++ty)
  for (int tx = 0; tx < group[0]; ++tx) {{
    const int x = gx * group[0] + tx, y = gy * group[1] + ty, z = gz * group[2] + tz;
    if (x >= grid[0] || y >= grid[1] || z >= grid[2]) continue;
    {kernel_name}<{tname}>({", ".join(args)});
  }}
}}''')
    return '#include "metal_shim.h"\n' + text + "\n".join(drivers) + "\n"


def compile_kernel(source: Path, cache_dir: Path, *, sanitize: bool = False, extra: str = "") -> Path:
    """Compile the translated kernel (+ `extra` C++, e.g. a main()) into a shared library, or an
    executable when sanitizing; cached by content."""
    code = translate(source) + extra
    flags = ["-std=c++17", "-O1", "-g", f"-I{HERE}", "-Wno-attributes"]
    flags += ["-fsanitize=address", "-fno-omit-frame-pointer"] if sanitize else ["-shared", "-fPIC"]
    key = hashlib.sha256((code + " ".join(flags) + (HERE / "metal_shim.h").read_text()).encode()).hexdigest()[:16]
    out = cache_dir / f"{source.stem}.{key}.{'asan' if sanitize else 'so'}"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src = Path(tmp) / f"{source.stem}.cpp"
        src.write_text(code)
        p = subprocess.run([_cxx(), *flags, str(src), "-o", str(Path(tmp) / out.name)], capture_output=True, text=True)
        if p.returncode != 0:
            missing = re.findall(r"[‘'](\w+)[’'] (?:was not declared|is not a member|does not name a type)", p.stderr)
            if missing:
                raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature (not in metal_shim.h): "
                                              f"{', '.join(dict.fromkeys(missing))}\n{p.stderr[-2000:]}")
            raise RuntimeError(f"compiling the translated {source} failed:\n{p.stderr[-4000:]}")
        os.replace(Path(tmp) / out.name, out)
    return out


class EmulatedKernel:
    """A compiled kernel library: call(entry, buffers, constants, grid, group)."""

    def __init__(self, library: Path):
        self.lib = ctypes.CDLL(str(library))

    def call(self, entry: str, buffers: list[np.ndarray], constants: list[int], grid, group) -> None:
        fn = getattr(self.lib, entry)
        ptrs = (ctypes.c_void_p * len(buffers))(*[b.ctypes.data for b in buffers])
        g = (ctypes.c_int * 3)(*grid)
        t = (ctypes.c_int * 3)(*group)
        c = (ctypes.c_uint32 * max(1, len(constants)))(*constants)
        fn(ptrs, g, t, c, len(constants))


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def from_bfloat16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)
