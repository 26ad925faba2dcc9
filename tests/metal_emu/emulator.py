"""Run metal_src/*.metal kernels on a Linux CPU (docs/metal.md says what this does and does not verify).

A kernel source goes through the host C preprocessor (with a stand-in <metal_stdlib>), its
Metal-only syntax is rewritten onto tests/metal_emu/metal_shim.h, one table entry is generated per
kernel entry point ([[host_name]] instantiations of templates, plain kernels by name), and g++ or
clang++ builds it with tests/metal_emu/runtime.h into a runner executable under AddressSanitizer
and UndefinedBehaviorSanitizer. A launch writes its buffers to a request file; the runner
allocates each with its exact size, sets the function constants by index, runs every thread of
the grid threadgroup by threadgroup as dispatch_threads would, and writes the buffers back.

Every Metal feature outside the shim raises UnsupportedMetalFeature naming it: nothing is skipped.
`EmulatedMetal` stands in for registry._ext on the 'metal' backend, so a registry.native.Launcher
and the kernel's Python wrapper run unchanged on top of the emulation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
SUPPORT_FILES = (HERE / "metal_shim.h", HERE / "runtime.h", HERE / "include" / "metal_stdlib")

# [[attribute]] -> runtime.h ParamKind for the position attributes a kernel parameter may carry.
POSITION_ATTRIBUTES = {
    "thread_position_in_grid": 1,
    "thread_position_in_threadgroup": 2,
    "threadgroup_position_in_grid": 3,
    "threads_per_threadgroup": 4,
    "threads_per_grid": 5,
    "threadgroups_per_grid": 6,
    "thread_index_in_threadgroup": 7,
}
SUPPORTED_ATTRIBUTES = {"kernel", "buffer", "function_constant", "host_name", "max_total_threads_per_threadgroup",
                        "maybe_unused", "likely", "unlikely", *POSITION_ATTRIBUTES}
# Features that cannot run faithfully one thread at a time (or at all) on the host, by name.
UNSUPPORTED = [
    (r"\bsimd_\w+|\bsimdgroup\w*", "SIMD-group functions and matrices"),
    (r"\bquad_\w+", "quad-group functions"),
    (r"\batomic\w*", "atomics"),
    (r"\btexture\w*|\bsampler\b|\bimageblock\w*|\bdepth2d\w*", "textures, samplers and imageblocks"),
    (r"\bis_function_constant_defined\b", "optional function constants"),
    (r"\bvisible_function_table\b|\bintersection_function_table\b|\braytracing\b", "function tables and ray tracing"),
    (r"\bthreadgroup_imageblock\b|\bmesh\b|\bobject_data\b", "mesh/object shaders"),
]
METAL_ELEM = {"float32": "float", "float16": "half", "bfloat16": "bfloat", "int32": "int", "uint32": "uint"}
NUMPY_OF = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int32": np.int32,
            "uint32": np.uint32}
ORDERS = {"forward": 0, "reverse": 1, "shuffled": 2}


class EmulationError(RuntimeError):
    """The emulation could not build or run a kernel; the message says what and where."""


class UnsupportedMetalFeature(EmulationError):
    """The kernel uses a Metal feature the shim does not provide; the message names it."""


class LaunchError(EmulationError):
    """The runner refused a launch (unbound buffer, missing function constant, bad geometry...)."""


class AbiMismatch(EmulationError):
    """The .metal entry points disagree with kernels.yaml's signature (docs/kernel-abi.md)."""


class SanitizerError(EmulationError):
    """AddressSanitizer or UndefinedBehaviorSanitizer stopped the kernel."""

    def __init__(self, message: str, *, kind: str, access: str = "", buffer: int | None = None):
        super().__init__(message)
        self.kind = kind          # e.g. heap-buffer-overflow, misaligned address, signed integer overflow
        self.access = access      # READ / WRITE for ASan reports
        self.buffer = buffer      # the [[buffer(n)]] the bad address belongs to, when known


# ----------------------------------------------------------------------------- translation

@dataclass
class Param:
    kind: int                 # 0 = buffer, else POSITION_ATTRIBUTES value
    index: int                # buffer index (-1 for positions)
    name: str


@dataclass
class KernelDef:
    name: str
    templated: bool
    params: list[Param]
    max_threads: int = 0


@dataclass
class EntryPoint:
    host_name: str
    kernel: str
    template_args: str | None     # None for a plain kernel


def _cxx() -> str:
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise EmulationError("no C++ compiler found (set CXX, or install g++ or clang++) for the Metal emulation")


def metal_version(std: str | None) -> int:
    """'metal3.1' -> 310, the value of __METAL_VERSION__ the Metal compiler defines."""
    m = re.fullmatch(r"(?:metal|macos-metal)(\d+)\.(\d+)", std or "metal3.1")
    if not m:
        raise EmulationError(f"metal std {std!r}: expected metalX.Y (kernels.yaml metal.std)")
    return int(m.group(1)) * 100 + int(m.group(2)) * 10


def _blank(text: str) -> str:
    """Replacement keeping the line count, so the preprocessor's line markers stay right."""
    return "\n" * text.count("\n")


def _matching(text: str, start: int, open_: str, close: str) -> int:
    """Index of the bracket closing text[start] (which is open_)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise EmulationError(f"unbalanced {open_}{close} in the preprocessed kernel")


def _split_params(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [p.strip() for p in out]


def preprocess(source: Path, include_dirs: Sequence[Path] = (), defines: Sequence[str] = (),
               std: str | None = None) -> str:
    """The kernel with macros expanded and comments gone, keeping line markers to the .metal file.
    No system headers: an #include other than <metal_stdlib> or the kernel's own headers fails."""
    cmd = [_cxx(), "-E", "-x", "c++", "-std=c++17", "-undef", "-nostdinc", "-nostdinc++", f"-I{HERE / 'include'}",
           *[f"-I{d}" for d in include_dirs], f"-D__METAL_VERSION__={metal_version(std)}", "-D__METAL_MACOS__",
           *[f"-D{d}" for d in defines], str(source)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        header = re.search(r"fatal error: ([\w./]+): No such file|fatal error: '([\w./]+)' file not found", p.stderr)
        if header:
            name = header.group(1) or header.group(2)
            raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: header <{name}> "
                                          f"(the emulation provides only <metal_stdlib>, via metal_shim.h)")
        raise EmulationError(f"preprocessing {source} failed:\n{p.stderr[-3000:]}")
    return p.stdout


def _code_only(text: str) -> str:
    """Text without line markers (they hold file paths) and string literals."""
    return re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', _without_line_markers(text))


def _without_line_markers(text: str) -> str:
    return re.sub(r"^#.*$", "", text, flags=re.M)


def check_features(text: str, source: Path) -> None:
    code = _code_only(text)
    for attr in re.findall(r"\[\[\s*([A-Za-z_][\w:]*)", code):
        if attr not in SUPPORTED_ATTRIBUTES:
            raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: attribute [[{attr}]] (the emulation "
                                          f"supports {', '.join(sorted(SUPPORTED_ATTRIBUTES))})")
    for pattern, what in UNSUPPORTED:
        m = re.search(pattern, code)
        if m:
            raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: {m.group(0)} ({what} cannot be "
                                          f"emulated one thread at a time; only a Mac verifies them)")


def parse(text: str, source: Path) -> tuple[dict[str, KernelDef], list[EntryPoint]]:
    """Kernel definitions and entry points of a preprocessed source."""
    code = _without_line_markers(text)
    kernels: dict[str, KernelDef] = {}
    entries: list[EntryPoint] = []
    head = re.compile(r"(\[\[\s*kernel\s*\]\]|\bkernel\b)((?:\s*\[\[[^\]]*\]\])*)\s*void\s+([A-Za-z_]\w*)\s*")
    for m in head.finditer(code):
        name, pos = m.group(3), m.end()
        targs = None
        if pos < len(code) and code[pos] == "<":
            end = _matching(code, pos, "<", ">")
            targs, pos = code[pos + 1:end].strip(), end + 1
            while code[pos].isspace():
                pos += 1
        if pos >= len(code) or code[pos] != "(":
            raise EmulationError(f"{source}: cannot parse the parameters of kernel {name}")
        close = _matching(code, pos, "(", ")")
        after = code[close + 1:].lstrip()
        prefix = code[max(0, m.start() - 400):m.start()]
        attrs = prefix[max(prefix.rfind(";"), prefix.rfind("}")) + 1:] + m.group(2)  # around [[kernel]]
        host = re.search(r'\[\[\s*host_name\s*\(\s*"([^"]+)"\s*\)\s*\]\]', attrs)
        if after.startswith(";"):                          # explicit instantiation of a template
            if targs is None or host is None:
                raise EmulationError(f"{source}: declaration of kernel {name} without template arguments and "
                                     f"[[host_name(\"...\")]]: the emulation cannot name its entry")
            entries.append(EntryPoint(host.group(1), name, targs))
            continue
        if not after.startswith("{"):
            raise EmulationError(f"{source}: cannot parse kernel {name}")
        bare = re.sub(r"(\s*\[\[[^\]]*\]\])+\s*$", "", prefix)
        templated = re.search(r"template\s*<[^;{}]*>\s*$", bare) is not None
        params = [_param(p, name, source) for p in _split_params(code[pos + 1:close])]
        mt = re.search(r"max_total_threads_per_threadgroup\s*\(\s*(\d+)\s*\)", attrs)
        kernels[name] = KernelDef(name, templated, params, int(mt.group(1)) if mt else 0)
        if not templated:
            entries.append(EntryPoint(host.group(1) if host else name, name, None))
    for e in entries:
        if e.kernel not in kernels:
            raise EmulationError(f"{source}: entry {e.host_name} instantiates {e.kernel}, which is not defined here")
    if not entries:
        raise EmulationError(f"{source}: no kernel entry point (a [[kernel]] function, or [[host_name(...)]] "
                             f"instantiations of a [[kernel]] template)")
    names = [e.host_name for e in entries]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise EmulationError(f"{source}: entry names defined twice: {sorted(dupes)}")
    return kernels, entries


def _param(raw: str, kernel: str, source: Path) -> Param:
    attr = re.search(r"\[\[\s*(\w+)\s*(?:\(\s*([^)]*?)\s*\))?\s*\]\]", raw)
    decl = re.sub(r"\[\[.*?\]\]", "", raw).strip()
    names = re.findall(r"([A-Za-z_]\w*)\s*$", decl)
    if not names:
        raise EmulationError(f"{source}: kernel {kernel}: cannot find the parameter name in {raw!r}")
    if attr is None:
        raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: kernel {kernel} parameter {names[0]!r} "
                                      f"has no [[buffer(n)]] or position attribute")
    if attr.group(1) == "buffer":
        return Param(0, int(attr.group(2), 0), names[0])
    if attr.group(1) in POSITION_ATTRIBUTES:
        return Param(POSITION_ATTRIBUTES[attr.group(1)], -1, names[0])
    raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: kernel parameter attribute "
                                  f"[[{attr.group(1)}]] ({names[0]})")


def rewrite(text: str, source: Path) -> str:
    """Metal-only syntax -> the shim's host C++, keeping every line where it was."""
    fc_decl = re.compile(r"\bconstant\s+([A-Za-z_]\w*)\s+([A-Za-z_]\w*)\s*"
                         r"\[\[\s*function_constant\s*\(\s*(\d+)\s*\)\s*\]\]\s*;")
    fc_names = [m.group(2) for m in fc_decl.finditer(text)]
    text = fc_decl.sub(lambda m: f"METAL_EMU_FUNCTION_CONSTANT({m.group(1)}, {m.group(2)}, {m.group(3)});"
                       + _blank(m.group(0)), text)
    if re.search(r"\[\[\s*function_constant", text):
        line = next(ln for ln in text.splitlines() if "function_constant" in ln)
        raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: function constant declaration "
                                      f"{line.strip()!r} (expected `constant T NAME [[function_constant(i)]];`)")
    # A program-scope constant computed from a function constant is evaluated at pipeline creation on
    # a GPU; on the host it would be computed before any launch set the function constant.
    for m in re.finditer(r"\bconstant\s+[\w:<>, ]+?\s+([A-Za-z_]\w*)\s*=\s*([^;]*);", text):
        used = [n for n in fc_names if re.search(rf"\b{n}\b", m.group(2))]
        if used:
            raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature: program-scope constant "
                                          f"{m.group(1)} initialised from function constant {used[0]}; use "
                                          f"the expression inside the kernel")
    counter = iter(range(1, 1 << 30))
    # `threadgroup T name[N]...;` -> storage shared by the running threadgroup (runtime.h).
    text = re.sub(r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)\s+([A-Za-z_]\w*)\s*"
                  r"((?:\[[^\]]*\]\s*)*);",
                  lambda m: f"auto& {m.group(2)} = metal_emu::tg_var<{m.group(1)}{m.group(3).replace(' ', '')}>"
                            f"({next(counter)});" + _blank(m.group(0)), text)
    text = re.sub(r"\bthreadgroup_barrier\s*\(", lambda m: f"metal_emu::barrier({next(counter)}, ", text)
    text = re.sub(r"\[\[.*?\]\]", lambda m: _blank(m.group(0)), text, flags=re.S)
    # Metal's half literals (1.5h) as conversions.
    text = re.sub(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?[hH]\b", r"half(\1\2)", text)
    # The shim spells the read-only constant address space `const`; `const constant` would repeat it.
    text = re.sub(r"\bconst\s+constant\b|\bconstant\s+const\b", "constant", text)
    return re.sub(r"\bkernel\b(?=\s+void\b)", "", text)


def translate(source: Path, include_dirs: Sequence[Path] = (), defines: Sequence[str] = (),
              std: str | None = None) -> tuple[str, list[EntryPoint]]:
    """(host C++ of the kernel + its entry table + runtime, entry points)."""
    source = Path(source)
    text = preprocess(source, [*include_dirs, source.parent], defines, std)
    check_features(text, source)
    kernels, entries = parse(text, source)
    uses_barriers = re.search(r"\bthreadgroup_barrier\s*\(", _code_only(text)) is not None
    body = rewrite(text, source)
    gen = ['#line 1 "<metal_emu generated>"', '#include "runtime.h"']
    table = []
    for i, e in enumerate(entries):
        k = kernels[e.kernel]
        params = ", ".join(f'{{{p.kind}, {p.index}, "{p.name}"}}' for p in k.params)
        gen.append(f"static const metal_emu::Param metal_emu_params_{i}[] = {{{params}}};")
        fn = f"&{k.name}<{e.template_args}>" if e.template_args is not None else f"&{k.name}"
        table.append(f'  metal_emu::make_entry<{fn}>("{e.host_name}", metal_emu_params_{i}, {len(k.params)}, '
                     f'{"true" if uses_barriers else "false"}, {k.max_threads}),')
    gen.append("static const metal_emu::EntryDef metal_emu_entries[] = {\n" + "\n".join(table) + "\n};")
    gen.append(f"int main(int argc, char** argv) {{ return metal_emu::main(argc, argv, metal_emu_entries, "
               f"{len(entries)}); }}")
    return '#include "metal_shim.h"\n' + body + "\n" + "\n".join(gen) + "\n", entries


# ----------------------------------------------------------------------------- compilation

# -O0: builds in less than half the time of -O1 and the test launches are small; -g lets sanitizer
# reports name .metal lines (the preprocessor's line markers survive translation).
CXXFLAGS = ["-std=c++17", "-O0", "-g", "-fno-strict-aliasing", "-fno-omit-frame-pointer",
            "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-Wall", "-Wextra",
            "-Wno-unused-parameter", "-Wno-attributes"]
_MISSING = [
    r"‘([\w:]+)’ was not declared in this scope", r"‘([\w:]+)’ is not a member of ‘[\w:]+’",
    r"‘([\w:]+)’ does not name a type", r"‘([\w:]+)’ has not been declared", r"has no member named ‘(\w+)’",
    r"use of undeclared identifier '([\w:]+)'", r"no member named '(\w+)' in", r"unknown type name '([\w:]+)'",
    r"'([\w:]+)' was not declared in this scope", r"'([\w:]+)' is not a member of '[\w:]+'",
    r"'([\w:]+)' does not name a type", r"has no member named '(\w+)'",
]


def _compiler_identity(cxx: str) -> str:
    p = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return p.stdout.splitlines()[0] if p.stdout else cxx


def compile_source(source: Path, cache_dir: Path, *, include_dirs: Sequence[Path] = (),
                   defines: Sequence[str] = (), std: str | None = None) -> "KernelLibrary":
    """Build (or reuse from cache_dir, keyed by the sha256 of everything that goes into it) the
    sanitized runner of one .metal source."""
    source = Path(source)
    code, entries = translate(source, include_dirs, defines, std)
    cxx = _cxx()
    digest = hashlib.sha256()
    for part in (code, " ".join(CXXFLAGS), _compiler_identity(cxx), *(f.read_text() for f in SUPPORT_FILES)):
        digest.update(part.encode())
        digest.update(b"\0")
    out = Path(cache_dir) / f"{source.stem}.{digest.hexdigest()[:20]}.runner"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
            cpp = Path(tmp) / f"{source.stem}.cpp"
            cpp.write_text(code)
            exe = Path(tmp) / out.name
            p = subprocess.run([cxx, *CXXFLAGS, f"-I{HERE}", str(cpp), "-o", str(exe)], capture_output=True, text=True)
            if p.returncode != 0:
                _raise_compile_error(source, p.stderr)
            (Path(tmp) / "warnings.txt").write_text(p.stderr)
            os.replace(Path(tmp) / "warnings.txt", out.with_suffix(".warnings"))
            os.replace(exe, out)   # atomic: a concurrent build of the same key writes the same file
    return KernelLibrary(out, source, entries)


def _raise_compile_error(source: Path, stderr: str) -> None:
    missing = []
    for pattern in _MISSING:
        missing += re.findall(pattern, stderr)
    if missing:
        names = ", ".join(dict.fromkeys(missing))
        raise UnsupportedMetalFeature(f"{source}: unsupported Metal feature (not in tests/metal_emu/metal_shim.h): "
                                      f"{names}\n{stderr[-2500:]}")
    raise EmulationError(f"compiling the host translation of {source} failed:\n{stderr[-4000:]}")


# ----------------------------------------------------------------------------- running

@dataclass(frozen=True)
class Constant:
    """A function-constant value as the launcher passes it: MTLDataType name and 32-bit pattern."""
    type: str        # int32 | float32 | bool | uint32
    bits: int

    @staticmethod
    def of(type_: str, value: int | float | bool) -> "Constant":
        if type_ == "float32":
            return Constant(type_, struct.unpack("<I", struct.pack("<f", float(value)))[0])
        return Constant(type_, int(value) & 0xFFFFFFFF)


@dataclass
class KernelLibrary:
    """A built runner: `describe()` and `run(...)`."""
    path: Path
    source: Path
    entries: list[EntryPoint]
    _description: dict | None = field(default=None, repr=False)

    @property
    def warnings(self) -> str:
        w = self.path.with_suffix(".warnings")
        return w.read_text() if w.exists() else ""

    def describe(self) -> dict:
        """{'entries': [{'name', 'params': [{'name','kind','index','elem','const','ref'}], ...}],
        'function_constants': [{'index','name','type'}]} with C++-resolved types."""
        if self._description is None:
            p = subprocess.run([str(self.path), "--describe"], capture_output=True, text=True, env=_sanitizer_env())
            if p.returncode != 0:
                raise LaunchError(f"{self.source}: {p.stderr.strip()}")
            self._description = json.loads(p.stdout)
        return self._description

    def entry(self, name: str) -> dict:
        for e in self.describe()["entries"]:
            if e["name"] == name:
                return e
        names = [e["name"] for e in self.describe()["entries"]]
        raise LaunchError(f"{self.source} has no entry {name!r} (it has {names})")

    def run(self, entry: str, buffers: Mapping[int, np.ndarray], constants: Mapping[int, Constant],
            grid: Sequence[int], group: Sequence[int], *, order: str = "forward", seed: int = 0,
            offsets: Mapping[int, int] | None = None, timeout: float = 600) -> dict[int, np.ndarray]:
        """One dispatch_threads(grid, group) of `entry`; returns every buffer's contents afterwards
        (new arrays, same dtypes and shapes). `offsets`: buffer index -> the byte of that buffer the
        kernel's pointer is at (setBuffer:offset:; a strided view's first element), 0 by default.
        Raises LaunchError, SanitizerError or EmulationError."""
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: expected one of {sorted(ORDERS)}")
        grid, group = tuple(int(g) for g in grid), tuple(int(g) for g in group)
        if len(grid) != 3 or len(group) != 3:
            raise ValueError(f"grid {grid} and threadgroup {group} must have 3 axes")
        req = bytearray(b"METALEMU" + struct.pack("<I", 2))
        name = entry.encode()
        req += struct.pack("<I", len(name)) + name + struct.pack("<3i3iIQ", *grid, *group, ORDERS[order], seed)
        req += struct.pack("<I", len(constants))
        for index, c in sorted(constants.items()):
            t = c.type.encode()
            req += struct.pack("<iI", index, len(t)) + t + struct.pack("<I", c.bits)
        arrays = {}
        for index, a in sorted(buffers.items()):
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise ValueError(f"buffer({index}) must be a C-contiguous numpy array, got {type(a).__name__}")
            arrays[index] = a
        offsets = dict(offsets or {})
        for index, off in offsets.items():
            if index not in arrays or not 0 <= off <= arrays[index].nbytes:
                raise ValueError(f"offset {off} for buffer({index}): expected a bound buffer and 0 <= offset <= "
                                 f"its size")
        req += struct.pack("<I", len(arrays))
        with tempfile.TemporaryDirectory(prefix="metal_emu_") as tmp:
            request, response = Path(tmp) / "request", Path(tmp) / "response"
            with open(request, "wb") as f:
                f.write(req)
                for index, a in arrays.items():
                    f.write(struct.pack("<iQQ", index, a.nbytes, offsets.get(index, 0)))
                    f.write(a.tobytes())
            p = subprocess.run([str(self.path), str(request), str(response)], capture_output=True, text=True,
                               timeout=timeout, env=_sanitizer_env())
            if p.returncode != 0:
                raise self._error(entry, p.returncode, p.stderr)
            data = response.read_bytes()
        return self._read_response(data, arrays)

    @staticmethod
    def _read_response(data: bytes, arrays: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        if data[:8] != b"METALEMU":
            raise EmulationError("bad response from the runner")
        (n,), pos, out = struct.unpack_from("<I", data, 8), 12, {}
        for _ in range(n):
            index, nbytes = struct.unpack_from("<iQ", data, pos)
            pos += 12
            like = arrays[index]
            out[index] = np.frombuffer(data, dtype=like.dtype, count=like.size, offset=pos).reshape(like.shape).copy()
            pos += nbytes
        return out

    def _error(self, entry: str, rc: int, stderr: str) -> EmulationError:
        launch_lines = [ln[len("metal_emu: "):] for ln in stderr.splitlines()
                        if ln.startswith("metal_emu: ") and not re.match(r"metal_emu: buffer\(\d+\) at ", ln)]
        where = _kernel_frame(stderr)
        asan = re.search(r"ERROR: AddressSanitizer: ([\w-]+) on address (0x[0-9a-f]+)", stderr)
        if asan:
            access = re.search(r"(READ|WRITE) of size (\d+)", stderr)
            addr = int(asan.group(2), 16)
            index, detail = self._buffer_of(addr, stderr, entry)
            what = f"{access.group(1)} of {access.group(2)} bytes" if access else "access"
            return SanitizerError(f"{self.source}: {entry}: AddressSanitizer: {asan.group(1)}: {what} {detail}"
                                  f"{where}\n{_tail(stderr)}", kind=asan.group(1),
                                  access=access.group(1) if access else "", buffer=index)
        ub = re.search(r"^(.*?): runtime error: (.*)$", stderr, flags=re.M)
        if ub:
            kind = re.sub(r" (of|at|for|in) .*$", "", ub.group(2))
            return SanitizerError(f"{self.source}: {entry}: UndefinedBehaviorSanitizer at {ub.group(1)}: {ub.group(2)}"
                                  f"\n{_tail(stderr)}", kind=kind)
        if rc == 2 and launch_lines:
            return LaunchError(f"{self.source}: {entry}: " + "; ".join(launch_lines))
        return EmulationError(f"{self.source}: {entry}: runner exited with {rc}\n{_tail(stderr)}")

    def _buffer_of(self, addr: int, stderr: str, entry: str) -> tuple[int | None, str]:
        """The buffer an address lies in or just past (ASan's redzone), from the runner's map."""
        names = {}
        try:
            names = {p["index"]: p["name"] for p in self.entry(entry)["params"] if p["kind"] == 0}
        except EmulationError:
            pass
        best = None
        for m in re.finditer(r"metal_emu: buffer\((\d+)\) at (0x[0-9a-f]+|\(nil\)) size (\d+)", stderr):
            if m.group(2) == "(nil)":
                continue
            index, lo, size = int(m.group(1)), int(m.group(2), 16), int(m.group(3))
            if lo - 4096 <= addr < lo + size + 4096:
                dist = 0 if lo <= addr < lo + size else min(abs(addr - lo), abs(addr - (lo + size)))
                if best is None or dist < best[0]:
                    best = (dist, index, lo, size)
        if best is None:
            return None, "outside every bound buffer"
        _, index, lo, size = best
        label = f"buffer({index})" + (f" {names[index]}" if index in names else "")
        return index, f"at byte {addr - lo} of {label} ({size} bytes)"


def _kernel_frame(stderr: str) -> str:
    """', in <function> at <file>.metal:<line>' for the innermost stack frame in a .metal source."""
    m = re.search(r"#\d+ 0x[0-9a-f]+ in (.+?) (\S+\.metal):(\d+)", stderr)
    if not m:
        return ""
    name = m.group(1)
    if name.startswith("_Z") and shutil.which("c++filt"):   # frames symbolised without demangling
        name = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip() or name
    return f", in {name} at {m.group(2)}:{m.group(3)}"


def _tail(stderr: str, n: int = 40) -> str:
    lines = [ln for ln in stderr.splitlines()
             if not re.match(r"metal_emu: buffer\(\d+\) at |==\d+==WARNING: ASan doesn't fully support", ln)]
    return "\n".join(lines[:n])


def _sanitizer_env() -> dict[str, str]:
    env = dict(os.environ)
    # The runner's buffers live until exit; leak checks would only report them.
    env["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:allocator_may_return_null=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


# ----------------------------------------------------------------------------- the manifest's view

def compile_kernel(spec: Any, cache_dir: Path, *, source: Path | None = None) -> KernelLibrary:
    """The runner of a KernelSpec's Metal target (its one source, include dirs, -D flags and std)."""
    target = spec.targets.get("metal")
    if target is None:
        raise EmulationError(f"{spec.name}: kernels.yaml declares no metal target")
    if source is None:
        if len(target.sources) != 1:
            raise EmulationError(f"{spec.name}: the emulation builds one .metal source per kernel, "
                                 f"kernels.yaml lists {list(target.sources)}")
        source = spec.root / target.sources[0]
    defines = [f[2:] for f in target.flags if f.startswith("-D")]
    unknown = [f for f in target.flags if not f.startswith("-D")]
    if unknown:
        raise EmulationError(f"{spec.name}: metal.flags {unknown} have no host equivalent in the emulation "
                             f"(only -D definitions do)")
    return compile_source(source, cache_dir, include_dirs=[spec.root / d for d in target.include_dirs],
                          defines=defines, std=target.std)


def check_abi(library: KernelLibrary, spec: Any) -> None:
    """Raise AbiMismatch unless every entry of `spec` exists in the source with kernels.yaml's buffer
    indices, element types, constness, scalar buffers, strides buffers and function constants
    (docs/kernel-abi.md)."""
    sig = spec.signature
    n_buffers = len(sig.buffers)
    by_name = {b.name: b for b in sig.buffers}
    desc = library.describe()
    where = f"{library.source}"
    fcs = {c["index"]: c for c in desc["function_constants"]}
    specialised = [s for s in sig.scalars if s.specialize]
    for k, s in enumerate(specialised):
        c = fcs.get(k)
        if c is None:
            raise AbiMismatch(f"{where}: no [[function_constant({k})]] for scalar {s.name} "
                              f"(specialised scalars are function constants 0..{len(specialised) - 1} in order)")
        if c["type"] != METAL_ELEM[s.type]:
            raise AbiMismatch(f"{where}: function constant {k} ({c['name']}) is {c['type']}, but scalar {s.name} is "
                              f"{s.type}: the launcher passes it as {METAL_ELEM[s.type]} (MTLDataType) and Metal "
                              f"refuses a mismatched type")
    extra = sorted(set(fcs) - set(range(len(specialised))))
    if extra:
        raise AbiMismatch(f"{where}: function constants {extra} are not specialised scalars of kernels.yaml; the "
                          f"launcher never sets them")
    for dtype, entry_name in spec.entries.items():
        act, _, pool = dtype.partition("/")   # an entry key: '<act>' or '<act>/<pool>'
        entry = library.entry(entry_name) if any(e["name"] == entry_name for e in desc["entries"]) else None
        if entry is None:
            raise AbiMismatch(f"{where}: no entry {entry_name!r} for {dtype} (kernels.yaml entries); the source has "
                              f"{[e['name'] for e in desc['entries']]}")
        bufs: dict[int, dict] = {}
        for p in entry["params"]:
            if p["kind"] == 0:
                if p["index"] in bufs:
                    raise AbiMismatch(f"{where}: {entry_name}: [[buffer({p['index']})]] used twice")
                bufs[p["index"]] = p
        for i, b in enumerate(sig.buffers):
            src = by_name[b.like] if b.role == "output" and b.like else b
            want = src.dtype or (pool or act if src.dtype_group == "pool" else act)
            p = bufs.pop(i, None)
            if p is None:
                raise AbiMismatch(f"{where}: {entry_name}: no [[buffer({i})]] for {b.name}")
            if p["ref"] or p["elem"] != METAL_ELEM[want]:
                raise AbiMismatch(f"{where}: {entry_name}: [[buffer({i})]] {p['name']} is "
                                  f"{'a reference to ' if p['ref'] else 'a pointer to '}{p['elem']}, kernels.yaml "
                                  f"buffer {b.name} needs a pointer to {METAL_ELEM[want]} ({want})")
            if p["const"] != (b.role == "input"):
                why = "inputs are read-only (const device T*)" if b.role == "input" else "the kernel writes it"
                raise AbiMismatch(f"{where}: {entry_name}: [[buffer({i})]] {p['name']} is "
                                  f"{'const' if p['const'] else 'writable'}, but {b.name} is role {b.role}: {why}")
        j = n_buffers
        for s in sig.scalars:
            if s.specialize:
                continue
            p = bufs.pop(j, None)
            if p is None or not p["ref"] or not p["const"] or p["elem"] != METAL_ELEM[s.type]:
                got = "nothing" if p is None else f"{p['name']} ({p['elem']}{' &' if p['ref'] else ' *'})"
                raise AbiMismatch(f"{where}: {entry_name}: scalar {s.name} belongs at [[buffer({j})]] as "
                                  f"`constant {METAL_ELEM[s.type]}&`, found {got}")
            j += 1
        for b in sig.buffers:
            if not b.strided:
                continue
            p = bufs.pop(j, None)
            name = f"{b.name}_strides"
            if p is None or not p["ref"] or not p["const"] or p["elem"] != "int4" or p["name"] != name:
                got = "nothing" if p is None else f"{p['name']} ({p['elem']}{' &' if p['ref'] else ' *'})"
                raise AbiMismatch(f"{where}: {entry_name}: the strides of strided buffer {b.name} belong at "
                                  f"[[buffer({j})]] as `constant int4& {name}`, found {got}")
            j += 1
        if bufs:
            raise AbiMismatch(f"{where}: {entry_name}: buffers {sorted(bufs)} are not in kernels.yaml's signature")


# ----------------------------------------------------------------------------- registry._ext stand-in

class EmulatedMetal:
    """registry._ext for the 'metal' backend, run by the emulation: `launcher()` returns a real
    registry.native.Launcher whose plans the kernel's wrapper builds exactly as on a Mac; `launch`
    binds them as csrc/aot_launch_metal.cpp does (each buffer checked against the plan's dtype for
    it): buffers i at [[buffer(i)]], non-specialised scalars as 4-byte buffers after them, then one
    int32[4] per strided buffer (its element strides, right-aligned), specialised scalars as function
    constants 0.. with their types, no dispatch for an empty grid. A strided input is bound as it
    lies, not copied: the emulation gets the storage its elements span and the kernel a pointer at
    its first element, so a stride the kernel misapplies reads outside that span (ASan) or the wrong
    element. Fresh outputs start as 0xFF bytes (NaN) so unwritten elements show."""

    def __init__(self, library: KernelLibrary, spec: Any, *, order: str = "forward", seed: int = 0):
        check_abi(library, spec)
        self.library, self.spec, self.order, self.seed = library, spec, order, seed
        self.launches = 0

    def launcher(self):
        from registry.native import Launcher
        return Launcher(self.spec, "metal", str(self.library.path), self.spec.entries, self)

    # -- the registry._ext API that registry.native.Launcher uses
    def KernelBinary(self, *, key, path, target, roles, like, scalar_types, specialize, strided):  # noqa: N802
        if len(roles) != len(like) or len(roles) != len(strided) or len(scalar_types) != len(specialize):
            raise ValueError("roles, like and strided, or scalar_types and specialize, differ in length")
        for i, (role, st) in enumerate(zip(roles, strided)):
            if st and role == 2:   # as the extension's binding: an aliased pool is row-contiguous
                raise ValueError(f"in-place buffer {i} cannot be strided")
        return SimpleNamespace(key=key, path=path, target=target, roles=list(roles), like=list(like),
                               strided=[int(x) for x in strided], scalar_types=list(scalar_types),
                               specialize=list(specialize))

    def LaunchArgs(self, entry, scalars, grid, group, dtype="", buffer_dtypes=(), input_shapes=()):  # noqa: N802
        grid, group = tuple(grid), tuple(group)
        if any(g < 0 for g in grid) or any(g < 1 for g in group):
            raise ValueError("grid must be >= 0 and threadgroup >= 1 on every axis")
        return SimpleNamespace(entry=entry, dtype=dtype, scalars=[int(s) & 0xFFFFFFFF for s in scalars], grid=grid,
                               group=group, buffer_dtypes=list(buffer_dtypes),
                               input_shapes=[tuple(s) for s in input_shapes])

    def launch(self, binary, plan, inputs, stream=None):
        roles = binary.roles
        n_inputs = sum(r in (0, 2) for r in roles)
        if len(inputs) != n_inputs:
            raise ValueError(f"{plan.entry}: expected {n_inputs} input arrays, got {len(inputs)}")
        if len(plan.scalars) != len(binary.scalar_types):
            raise ValueError(f"{plan.entry}: expected {len(binary.scalar_types)} scalars, got {len(plan.scalars)}")
        if len(plan.buffer_dtypes) != len(roles):
            raise ValueError(f"{plan.entry}: expected {len(roles)} buffer dtypes, got {len(plan.buffer_dtypes)}")
        shapes_of_plan = getattr(plan, "input_shapes", [])
        for i, (want, a) in enumerate(zip(shapes_of_plan, inputs) if shapes_of_plan else ()):
            if tuple(a.shape) != want:     # as the extension: a plan is for one shape signature
                raise ValueError(f"{plan.entry}: input {i} has shape {'x'.join(map(str, a.shape))}, the plan was "
                                 f"made for {'x'.join(map(str, want))}; make a plan for these shapes")
        it = iter(inputs)
        host: dict[int, np.ndarray] = {}
        offsets: dict[int, int] = {}
        strides: dict[int, tuple[int, ...]] = {}
        shapes: dict[int, tuple[int, ...]] = {}
        mx_dtypes: dict[int, Any] = {}
        for b, role in enumerate(roles):
            if role in (0, 2):
                a = next(it)
                # As the extension: the kernel indexes memory with its entry's element size.
                want = plan.buffer_dtypes[b]
                got = str(a.dtype).removeprefix("mlx.core.")
                if got != want:
                    raise ValueError(f"[mlx_aot] {plan.entry}: buffer {b} has dtype {got}, the entry expects {want}")
                if binary.strided[b]:
                    host[b], offsets[b], strides[b] = strided_storage(a)
                else:
                    host[b] = to_numpy(a)
                shapes[b], mx_dtypes[b] = tuple(a.shape), a.dtype
        for b, role in enumerate(roles):
            if role == 1:   # fresh output, row-contiguous: uninitialised on a GPU
                like = binary.like[b]
                shapes[b], mx_dtypes[b] = shapes[like], mx_dtypes[like]
                n = int(np.prod(shapes[b], dtype=np.int64))
                host[b] = np.frombuffer(b"\xff" * (n * host[like].itemsize), dtype=host[like].dtype).copy()
                strides[b] = row_contiguous_strides(shapes[b])
        constants, slot = {}, len(roles)
        for i, bits in enumerate(plan.scalars):
            if binary.specialize[i]:
                constants[len(constants)] = Constant("float32" if binary.scalar_types[i] == 1 else "int32", bits)
            else:
                host[slot] = np.array([bits], dtype=np.uint32)
                slot += 1
        for b in range(len(roles)):
            if binary.strided[b]:
                host[slot] = kernel_strides(strides[b], plan.entry, b)
                slot += 1
        if all(g > 0 for g in plan.grid):
            host = self.library.run(plan.entry, host, constants, plan.grid, plan.group, order=self.order,
                                    seed=self.seed + self.launches, offsets=offsets)
        self.launches += 1
        return [from_numpy(host[b].reshape(shapes[b]), mx_dtypes[b]) for b, role in enumerate(roles)
                if role in (1, 2)]


def row_contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """A fresh MLX array's element strides (as mlx::core computes them, zero-size dimensions too)."""
    out, n = [], 1
    for dim in reversed(shape):
        out.append(n)
        n *= int(dim)
    return tuple(reversed(out))


def kernel_strides(strides: Sequence[int], entry: str, buffer: int) -> np.ndarray:
    """The int32[4] the launcher passes for a strided buffer: its element strides right-aligned
    (docs/kernel-abi.md, "Strided buffers"); an error past int32 or past 4 dimensions."""
    if len(strides) > 4:
        raise ValueError(f"[mlx_aot] {entry}: strided buffer {buffer} has {len(strides)} dimensions; at most 4")
    for s in strides:
        if not -2**31 <= s < 2**31:
            raise ValueError(f"[mlx_aot] {entry}: strided buffer {buffer} has a stride of {s} elements, beyond "
                             f"int32; pass a smaller or contiguous array")
    return np.array([0] * (4 - len(strides)) + list(strides), dtype=np.int32)


def strided_storage(a) -> tuple[np.ndarray, int, tuple[int, ...]]:
    """(the bytes an mx.array view's elements span, as a 1-D array of its element type; the byte
    offset of its first element in them; its element strides): what the launcher binds for a
    strided buffer, with nothing outside the view's own elements, so ASan reports any read past them."""
    import ctypes
    import mlx.core as mx
    view = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)   # MLX's buffer: its strides, no copy
    item = view.itemsize
    if any(s % item for s in view.strides):
        raise EmulationError(f"a view with byte strides {view.strides} that are not whole elements")
    strides = tuple(s // item for s in view.strides)
    if view.size == 0:
        return np.zeros(0, view.dtype), 0, strides
    lo = sum(min(0, (n - 1) * s) for n, s in zip(view.shape, strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(view.shape, strides))
    start = view.__array_interface__["data"][0] + lo * item
    span = np.frombuffer((ctypes.c_char * ((hi - lo + 1) * item)).from_address(start), dtype=view.dtype).copy()
    return span, -lo * item, strides


def to_numpy(a) -> np.ndarray:
    """An mx.array as a C-contiguous numpy array of its storage (bfloat16 as uint16 bits)."""
    import mlx.core as mx
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def from_numpy(x: np.ndarray, dtype) -> Any:
    import mlx.core as mx
    if dtype == mx.bfloat16:
        return mx.array(x.view(np.uint16)).view(mx.bfloat16)
    return mx.array(x)


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even, NaN kept), as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def from_bfloat16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint32) << 16).view(np.float32)
