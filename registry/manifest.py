"""kernels.yaml -> frozen KernelSpec dataclasses. The schema is documented in docs/manifest.md.

Loading uses yaml.SafeLoader semantics (no Python tags) with line numbers kept, and collects every
problem before raising one ManifestError whose lines read
    kernels.yaml:12: kernel 'rope_pool_fused': cuda.sources[0]: cuda_src/x.cu does not exist

Hostile input is bounded (docs/manifest.md, "Limits"): the file's size, YAML nesting, no aliases,
identifier and string lengths, compiler flags from an allow-list, and `wrapper`/`check` only in the
registry package (or MLX_AOT_HOOK_MODULES), checked without importing them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from . import envs
from .errors import ManifestError
from .expr import ExprError, Requirement, compile_requirement

SCHEMA_VERSION = 1
TARGETS = ("metal", "cuda", "cpu")
DTYPES = ("float16", "bfloat16", "float32")
FIXED_DTYPES = DTYPES + ("int32", "uint32")   # signature.buffers[].dtype: uint32 for packed quantized pools
BUFFER_ROLES = ("input", "output", "inplace")
DTYPE_GROUPS = ("pool",)           # signature.buffers[].dtype_group
SCALAR_TYPES = ("int32", "float32")

_IDENT = re.compile(r"^[a-z_][a-z0-9_]*\Z")
_ENV = re.compile(r"^[A-Z][A-Z0-9_]*\Z")
_C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_OBJREF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*\Z")
_CUDA_ARCH = re.compile(r"^sm_[0-9]{2,3}[af]?\Z")
_PTX_ARCH = re.compile(r"^compute_[0-9]{2,3}[af]?\Z")
_METAL_STD = re.compile(r"^metal[0-9]\.[0-9]\Z")
_MACOS = re.compile(r"^[0-9]{2}(\.[0-9]+){0,2}\Z")

# Limits (docs/manifest.md, "Limits").
MAX_MANIFEST_BYTES = 256 * 1024
MAX_YAML_DEPTH = 32
MAX_IDENT = 64                 # kernel names, kernel_attr, buffer/scalar names, env names
MAX_SYMBOL = 128               # entry symbols, wrapper/check references
MAX_TEXT = 4096                # description
MAX_PATH = 1024                # one source or include path
MAX_LIST = 64                  # sources, include_dirs, flags, archs, buffers, scalars
MAX_FLAG = 256                 # one compiler flag
MAX_INT_CHARS = 64             # an integer in the YAML (Python refuses to convert over 4300 digits)
HOOK_PACKAGE = "registry"      # wrapper/check modules live here (or in MLX_AOT_HOOK_MODULES)
_PUBLIC_IDENT = re.compile(r"^[a-z][a-z0-9_]*\Z")

# Compiler flags: the forms below and nothing else (docs/manifest.md lists them). No flag may name
# a file, another program or a linker/assembler pass-through: include paths go in include_dirs.
_FLAG_VALUE = r"[A-Za-z0-9_.+\-]*"           # no '/', '=', ',', quotes, spaces or shell syntax
_FLAG_FORMS = (
    re.compile(rf"^-D[A-Za-z_][A-Za-z0-9_]*(={_FLAG_VALUE})?\Z"),
    re.compile(r"^-U[A-Za-z_][A-Za-z0-9_]*\Z"),
    re.compile(r"^-O([0-3]|s|z|fast)?\Z"),
    re.compile(rf"^-f[a-z][a-z0-9\-+]*(={_FLAG_VALUE})?\Z"),
    re.compile(rf"^-W[a-z][a-z0-9\-+]*(={_FLAG_VALUE})?\Z"),   # -Wall, -Werror=..., never -Wl,/-Wa,/-Wp,
    re.compile(rf"^-m[a-z][a-z0-9\-+]*(={_FLAG_VALUE})?\Z"),   # -march=native, -mavx2
    re.compile(r"^-std=[a-z0-9+]+\Z"),
    re.compile(r"^-g[0-3]?\Z"),
)
# -f/-m/-W names that read or write files, load plugins or run other programs; ASan, whose runtime
# must be the process's first library (an artifact built with it ends the process that loads it).
_FLAG_DENY = re.compile(r"^-(fplugin|fprofile|fdump|fuse-ld|fld-path|f[a-z-]*prefix-map|fsanitize-[a-z]*list|"
                        r"fsanitize=[a-z-]*address|"
                        r"fsave-optimization-record|fopt-record|fcrash-diagnostics|fmodule|fprebuilt-module|"
                        r"fembed|fdebug-compilation-dir|fcoverage-data|fxray|fcs-profile|fauto-profile|"
                        r"mlinker|mabi=|specs)")
# nvcc switches (cuda only), with one or two dashes and '_' or '-' spelled either way.
_NVCC_SWITCHES = {"use_fast_math": None, "ftz": r"(true|false)", "prec_div": r"(true|false)",
                  "prec_sqrt": r"(true|false)", "fmad": r"(true|false)", "maxrregcount": r"[0-9]+",
                  "extra_device_vectorization": None, "restrict": None, "expt_relaxed_constexpr": None,
                  "expt_extended_lambda": None, "extended_lambda": None, "lineinfo": None,
                  "generate_line_info": None, "resource_usage": None, "default_stream": r"(legacy|per_thread)"}


# ----------------------------------------------------------------------------- dataclasses

@dataclass(frozen=True)
class EnableSpec:
    env: str
    default: bool


@dataclass(frozen=True)
class BufferSpec:
    name: str
    role: str                      # input | output | inplace
    like: str | None = None        # outputs: the input giving shape and dtype
    dtype: str | None = None       # fixed dtype (int32, uint32 or a float); None = the kernel's dtype
    dtype_group: str | None = None # 'pool': the entry key's pool dtype; None: its activation dtype
    strided: bool = False          # taken as the caller's array is; its strides reach the kernel


@dataclass(frozen=True)
class ScalarSpec:
    name: str
    type: str                      # int32 | float32
    specialize: bool = False       # Metal function constant


@dataclass(frozen=True)
class SignatureSpec:
    buffers: tuple[BufferSpec, ...]
    scalars: tuple[ScalarSpec, ...]

    @property
    def inputs(self) -> tuple[BufferSpec, ...]:
        return tuple(b for b in self.buffers if b.role in ("input", "inplace"))

    @property
    def outputs(self) -> tuple[BufferSpec, ...]:
        return tuple(b for b in self.buffers if b.role in ("output", "inplace"))


@dataclass(frozen=True)
class TargetSpec:
    """Sources and flags for one backend. Paths are relative to the manifest's directory."""
    target: str
    sources: tuple[str, ...]
    include_dirs: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    std: str | None = None             # metal: -std=...
    macos_min: str | None = None       # metal: -mmacosx-version-min
    archs: tuple[str, ...] = ()        # cuda: sm_XX cubins
    ptx_arch: str | None = None        # cuda: compute_XX PTX for forward compatibility


@dataclass(frozen=True)
class KernelSpec:
    name: str
    kernel_attr: str
    description: str
    wrapper: str                       # "module:attr" building the kernel object
    enable: EnableSpec
    requires: tuple[Requirement, ...]
    prefer: tuple[Requirement, ...]
    check: str | None
    signature: SignatureSpec
    entries: dict[str, str] = field(hash=False, compare=True)   # '<act>' or '<act>/<pool>' -> entry symbol
    targets: dict[str, TargetSpec] = field(hash=False, compare=True)
    root: Path = field(default=Path("."), compare=False)
    line: int = 0
    raw: dict = field(default_factory=dict, hash=False, compare=False, repr=False)

    def source_paths(self, target: str) -> list[Path]:
        return [self.root / s for s in self.targets[target].sources]

    def include_paths(self, target: str) -> list[Path]:
        return [self.root / s for s in self.targets[target].include_dirs]


@dataclass(frozen=True)
class Manifest:
    path: Path
    schema_version: int
    kernels: tuple[KernelSpec, ...]

    @property
    def root(self) -> Path:
        return self.path.parent

    def kernel(self, name: str) -> KernelSpec:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(f"{self.path}: no kernel named {_short(name)}; declared: "
                       f"{', '.join(k.name for k in self.kernels) or '(none)'}")


# ----------------------------------------------------------------------------- YAML with lines

class _LineDict(dict):
    line: int = 0
    key_lines: dict


class _Loader(yaml.SafeLoader):
    """SafeLoader that records line numbers, rejects duplicate keys (safe_load keeps the last),
    refuses aliases (no "billion laughs": nothing is ever expanded) and bounds nesting."""

    _depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{_short(event.anchor, 40)[1:-1]}) are not supported in a "
                            f"manifest; write the value out", event.start_mark)
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nesting deeper than {MAX_YAML_DEPTH} levels", event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        """PyYAML's constructors raise plain ValueError/KeyError/... for a value its explicit tag cannot
        hold (`!!int x`, `!!timestamp 2001-13-99`, `!!map` on a scalar) and for an integer of more than
        4300 digits: a YAML error at the node instead."""
        if node.tag == "tag:yaml.org,2002:int" and isinstance(node.value, str) and len(node.value) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} characters; the limit is {MAX_INT_CHARS}",
                node.start_mark)
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:   # never a YAMLError
            what = _short(node.value) if isinstance(node, yaml.ScalarNode) else f"this {node.id}"
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {what} as {tag} ({e.__class__.__name__}: {e})",
                node.start_mark) from None


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False):
    if not isinstance(node, yaml.MappingNode):   # `!!map` on a scalar or a list
        raise yaml.constructor.ConstructorError(
            None, None, f"!!map on a {node.id}: expected a mapping", node.start_mark)
    loader.flatten_mapping(node)
    result = _LineDict()
    result.line = node.start_mark.line + 1
    result.key_lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {_short(key)}", key_node.start_mark) from None
        if key in result:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {_short(key)} (first at line {result.key_lines[key]})",
                key_node.start_mark)
        result[key] = loader.construct_object(value_node, deep=True)
        result.key_lines[key] = key_node.start_mark.line + 1
    return result


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _plain(obj: Any) -> Any:
    """Strip line bookkeeping (for hashing and JSON)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- validation

class _Problems:
    def __init__(self, path: Path):
        self.path = path
        self.items: list[str] = []

    def add(self, line: int, where: str, msg: str) -> None:
        self.items.append(f"{self.path.name}:{line}: {where}{msg}")


_MAPPING = object()   # _line's key when the line wanted is the mapping's own


def _line(d: Any, key: Any = _MAPPING) -> int:
    """The line of `key` in mapping `d` (any key, `null` too), else of the mapping; 0 if unknown."""
    if isinstance(d, _LineDict):
        if key is not _MAPPING and key in d.key_lines:
            return d.key_lines[key]
        return d.line
    return 0


def _short(value: Any, limit: int = 60) -> str:
    """repr(value) cut to about `limit` characters, without building the whole repr of a big value."""
    if isinstance(value, str):
        text = repr(value[:limit])
        return text if len(value) <= limit else text + f"... ({len(value)} characters)"
    if isinstance(value, (dict, list)):
        n = len(value)
        return f"{'a mapping' if isinstance(value, dict) else 'a list'} of {n} item{'s' * (n != 1)}"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _key(key: Any) -> str:
    """A mapping key as the file spells it: `null` for None, else _short."""
    return "null" if key is None else _short(key)


def _type_name(value: Any) -> str:
    return {dict: "a mapping", _LineDict: "a mapping", list: "a list", str: "a string",
            bool: "a boolean", int: "an integer", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


class _Checker:
    def __init__(self, problems: _Problems, root: Path, where: str):
        self.p = problems
        self.root = root
        self.where = where

    def err(self, d: Any, key: Any, msg: str) -> None:
        """A problem at `key`'s line in `d` (any key, `null` too; _MAPPING: the mapping's own line)."""
        self.p.add(_line(d, key), self.where, msg)

    def keys(self, d: dict, allowed: set[str], required: set[str], field_name: str) -> None:
        prefix = f"{field_name}: " if field_name else ""
        for k in d:
            if k not in allowed:
                self.err(d, k, f"{prefix}unknown key {_key(k)}; allowed: {', '.join(sorted(allowed))}")
        for k in sorted(required - set(d)):
            self.err(d, _MAPPING, f"{prefix}missing required key {_short(k)}")

    def typed(self, d: dict, key: str, types: tuple, expected: str, field_name: str) -> Any:
        value = d.get(key)
        if key in d and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            self.err(d, key, f"{field_name}: expected {expected}, got {_type_name(value)} {_short(value)}")
            return None
        return value

    def ident(self, d: dict, key: str, pattern: re.Pattern, expected: str, field_name: str,
              limit: int = MAX_IDENT) -> str | None:
        value = self.typed(d, key, (str,), "a string", field_name)
        if value is not None and len(value) > limit:
            self.err(d, key, f"{field_name}: {_short(value)} is longer than {limit} characters")
            return None
        if value is not None and not pattern.match(value):
            self.err(d, key, f"{field_name}: {_short(value)} is not {expected}")
            return None
        return value

    def rel_path(self, d: Any, key: str | None, value: Any, field_name: str, want_dir: bool) -> str | None:
        if not isinstance(value, str) or not value:
            self.err(d, key, f"{field_name}: expected a relative path string, got {_type_name(value)} {_short(value)}")
            return None
        if len(value) > MAX_PATH or any(ord(ch) < 32 for ch in value):
            self.err(d, key, f"{field_name}: {_short(value)} is not a path (longer than {MAX_PATH} "
                             f"characters, or holds a NUL or control character)")
            return None
        pure = PurePosixPath(value)
        if pure.is_absolute() or value.startswith("~") or re.match(r"^[A-Za-z]:[\\/]", value):
            self.err(d, key, f"{field_name}: {_short(value)} is absolute; paths are relative to "
                             f"{self.root}")
            return None
        try:
            resolved = (self.root / value).resolve()
            inside = resolved.is_relative_to(self.root.resolve())
            exists = resolved.is_dir() if want_dir else resolved.is_file()
            other = not exists and resolved.exists()   # a directory as a source, a file as a dir, a FIFO
        except (OSError, RuntimeError, ValueError) as e:   # a name too long, a symlink loop
            self.err(d, key, f"{field_name}: {_short(value)} cannot be resolved ({e.__class__.__name__}: {e})")
            return None
        if not inside:
            self.err(d, key, f"{field_name}: {_short(value)} escapes the project root {self.root}")
            return None
        if other:
            self.err(d, key, f"{field_name}: {value} is not a {'directory' if want_dir else 'regular file'}")
        elif want_dir and not exists:
            self.err(d, key, f"{field_name}: directory {value} does not exist")
        elif not want_dir and not exists:
            self.err(d, key, f"{field_name}: {value} does not exist")
        return value

    def str_list(self, d: dict, key: str, field_name: str, *, nonempty: bool = False) -> list | None:
        value = d.get(key)
        if key not in d:
            return [] if not nonempty else None
        if not isinstance(value, list) or (nonempty and not value):
            self.err(d, key, f"{field_name}: expected a {'non-empty ' if nonempty else ''}list, "
                             f"got {_type_name(value)} {_short(value)}")
            return None
        if len(value) > MAX_LIST:
            self.err(d, key, f"{field_name}: {len(value)} items; the limit is {MAX_LIST}")
            return None
        return value

    def requirements(self, d: dict, key: str) -> tuple[Requirement, ...]:
        items = self.str_list(d, key, key)
        out = []
        for i, item in enumerate(items or []):
            fname = f"{key}[{i}]"
            if isinstance(item, str):
                text, reason, holder = item, "", d
            elif isinstance(item, dict):
                self.keys(item, {"expr", "reason"}, {"expr"}, fname)
                text = self.typed(item, "expr", (str,), "a string", f"{fname}.expr")
                reason = self.typed(item, "reason", (str,), "a string", f"{fname}.reason") or ""
                holder = item
                if text is None:
                    continue
            else:
                self.err(d, key, f"{fname}: expected an expression string or "
                                 f"{{expr, reason}}, got {_type_name(item)} {_short(item)}")
                continue
            try:
                out.append(compile_requirement(text, reason))
            except ExprError as e:
                shown = text if len(text) <= 80 else text[:80] + "..."
                self.err(holder, "expr" if holder is not d else key, f"{fname}: `{shown}`: {e}")
        return tuple(out)


def _target(c: _Checker, d: Any, target: str, parent: dict) -> TargetSpec | None:
    if not isinstance(d, dict):
        c.err(parent, target, f"{target}: expected a mapping, got {_type_name(d)} {_short(d)}")
        return None
    common = {"sources", "include_dirs", "flags"}
    extra = {"metal": {"std", "macos_min"}, "cuda": {"archs", "ptx_arch"}, "cpu": set()}[target]
    c.keys(d, common | extra, {"sources"}, target)
    sources = c.str_list(d, "sources", f"{target}.sources", nonempty=True) or []
    srcs = [c.rel_path(d, "sources", s, f"{target}.sources[{i}]", want_dir=False)
            for i, s in enumerate(sources)]
    incs = [c.rel_path(d, "include_dirs", s, f"{target}.include_dirs[{i}]", want_dir=True)
            for i, s in enumerate(c.str_list(d, "include_dirs", f"{target}.include_dirs") or [])]
    flags = c.str_list(d, "flags", f"{target}.flags") or []
    bad_flags = False
    for i, f in enumerate(flags):
        why = flag_problem(f, target)
        if why:
            bad_flags = True
            c.err(d, "flags", f"{target}.flags[{i}]: {why}")
    kw: dict[str, Any] = {}
    if target == "metal":
        kw["std"] = c.ident(d, "std", _METAL_STD, "a Metal language standard like metal3.1",
                            "metal.std") or "metal3.1"
        if "macos_min" in d and not isinstance(d["macos_min"], str):
            c.err(d, "macos_min", f"metal.macos_min: expected a quoted version string like \"14.0\", "
                                  f"got {_type_name(d['macos_min'])} {_short(d['macos_min'])}")
        else:
            kw["macos_min"] = c.ident(d, "macos_min", _MACOS, "a macOS version like 14.0",
                                      "metal.macos_min") or "14.0"
    if target == "cuda":
        archs = c.str_list(d, "archs", "cuda.archs", nonempty=True) if "archs" in d else []
        for i, a in enumerate(archs or []):
            if not isinstance(a, str) or not _CUDA_ARCH.match(a):
                c.err(d, "archs", f"cuda.archs[{i}]: {_short(a)} is not an arch like sm_90")
        if archs and all(isinstance(a, str) for a in archs) and len(set(archs)) != len(archs):
            c.err(d, "archs", "cuda.archs: duplicate entries")
        kw["archs"] = tuple(archs or ())
        kw["ptx_arch"] = c.ident(d, "ptx_arch", _PTX_ARCH, "a PTX arch like compute_80", "cuda.ptx_arch")
    if bad_flags:
        return None
    return TargetSpec(target=target, sources=tuple(s for s in srcs if s),
                      include_dirs=tuple(s for s in incs if s), flags=tuple(flags), **kw)


def flag_problem(flag: Any, target: str) -> str | None:
    """None if `flag` is one of the allowed forms (docs/manifest.md, "Compiler flags"), else why not."""
    if not isinstance(flag, str):
        return f"expected a compiler flag string, got {_type_name(flag)} {_short(flag)}"
    if len(flag) > MAX_FLAG:
        return f"{_short(flag)} is longer than {MAX_FLAG} characters"
    if re.match(r"^-(I|isystem|iquote|idirafter|include|imacros|-include)", flag):
        return (f"{_short(flag)}: include paths and forced includes are not flags; list directories "
                f"inside the project in include_dirs")
    if target == "cuda":
        m = re.match(r"^--?([a-z_\-]+)(?:=(.*))?\Z", flag)
        if m and m.group(1).replace("-", "_") in _NVCC_SWITCHES:
            want = _NVCC_SWITCHES[m.group(1).replace("-", "_")]
            if (want is None) == (m.group(2) is None) and (want is None or re.fullmatch(want, m.group(2))):
                return None
            return f"{_short(flag)}: nvcc switch {m.group(1)} takes " + (
                "no value" if want is None else f"a value matching {want}")
    if _FLAG_DENY.match(flag) or not any(form.match(flag) for form in _FLAG_FORMS):
        return (f"{_short(flag)} is not an allowed compiler flag; allowed: -D<NAME>[=value], -U<NAME>, "
                f"-O<level>, -f<option>, -W<warning>, -m<machine option>, -std=<standard>, -g"
                + (", nvcc switches such as --use_fast_math" if target == "cuda" else "")
                + " (docs/manifest.md, \"Compiler flags\")")
    return None


def _signature(c: _Checker, d: Any, parent: dict) -> SignatureSpec | None:
    if not isinstance(d, dict):
        c.err(parent, "signature", f"signature: expected a mapping, got {_type_name(d)} {_short(d)}")
        return None
    c.keys(d, {"buffers", "scalars"}, {"buffers"}, "signature")
    buffers: list[BufferSpec] = []
    names: set[str] = set()
    for i, b in enumerate(c.str_list(d, "buffers", "signature.buffers", nonempty=True) or []):
        fname = f"signature.buffers[{i}]"
        if not isinstance(b, dict):
            c.err(d, "buffers", f"{fname}: expected a mapping, got {_type_name(b)} {_short(b)}")
            continue
        c.keys(b, {"name", "role", "like", "dtype", "dtype_group", "strided"}, {"name", "role"}, fname)
        name = c.ident(b, "name", _IDENT, "an identifier", f"{fname}.name")
        role = c.typed(b, "role", (str,), "a string", f"{fname}.role")
        if role is not None and role not in BUFFER_ROLES:
            c.err(b, "role", f"{fname}.role: {_short(role)} is not one of {', '.join(BUFFER_ROLES)}")
            role = None
        like = c.typed(b, "like", (str,), "a string", f"{fname}.like")
        dtype = c.typed(b, "dtype", (str,), "a string", f"{fname}.dtype")
        if dtype is not None and dtype not in FIXED_DTYPES:
            c.err(b, "dtype", f"{fname}.dtype: {_short(dtype)} is not one of {', '.join(FIXED_DTYPES)}")
        group = c.typed(b, "dtype_group", (str,), "a string", f"{fname}.dtype_group")
        if group is not None and group not in DTYPE_GROUPS:
            c.err(b, "dtype_group", f"{fname}.dtype_group: {_short(group)} is not one of {', '.join(DTYPE_GROUPS)}")
        elif group is not None and (dtype is not None or role == "output"):
            c.err(b, "dtype_group", f"{fname}.dtype_group: only an input or inplace buffer without a fixed "
                                    f"dtype takes a group (outputs follow their `like`)")
        strided = c.typed(b, "strided", (bool,), "true or false", f"{fname}.strided")
        if strided and (dtype is not None or role == "inplace"):
            c.err(b, "strided", f"{fname}.strided: only an activation input or output (no fixed dtype, not "
                                f"inplace) is strided: in-place buffers are aliased row-contiguous")
        if role == "output" and like is None:
            c.err(b, _MAPPING, f"{fname}: an output needs `like: <input>` for its shape and dtype")
        if role != "output" and like is not None:
            c.err(b, "like", f"{fname}.like: only outputs take `like`")
        if like is not None and like not in {x.name for x in buffers if x.role != "output"}:
            c.err(b, "like", f"{fname}.like: {_short(like)} is not an input declared before it")
        if name in names:
            c.err(b, "name", f"{fname}.name: duplicate buffer name {_short(name)}")
        if name and role:
            names.add(name)
            buffers.append(BufferSpec(name=name, role=role, like=like, dtype=dtype, dtype_group=group,
                                      strided=bool(strided)))
    scalars: list[ScalarSpec] = []
    for i, s in enumerate(c.str_list(d, "scalars", "signature.scalars") or []):
        fname = f"signature.scalars[{i}]"
        if not isinstance(s, dict):
            c.err(d, "scalars", f"{fname}: expected a mapping, got {_type_name(s)} {_short(s)}")
            continue
        c.keys(s, {"name", "type", "specialize"}, {"name", "type"}, fname)
        name = c.ident(s, "name", _IDENT, "an identifier", f"{fname}.name")
        typ = c.typed(s, "type", (str,), "a string", f"{fname}.type")
        if typ is not None and typ not in SCALAR_TYPES:
            c.err(s, "type", f"{fname}.type: {_short(typ)} is not one of {', '.join(SCALAR_TYPES)}")
            typ = None
        spec = c.typed(s, "specialize", (bool,), "true or false", f"{fname}.specialize")
        if name in names:
            c.err(s, "name", f"{fname}.name: {_short(name)} is already a buffer or scalar name")
        if name and typ:
            names.add(name)
            scalars.append(ScalarSpec(name=name, type=typ, specialize=bool(spec)))
    if buffers and not any(b.role != "input" for b in buffers):
        c.err(d, "buffers", "signature.buffers: a kernel needs at least one output or inplace buffer")
    return SignatureSpec(buffers=tuple(buffers), scalars=tuple(scalars))


def _entry_key_problem(key: Any, has_pool: bool) -> str | None:
    """Why an `entries` key is not '<act>' or '<act>/<pool>' (docs/manifest.md), or None."""
    parts = key.split("/") if isinstance(key, str) else None
    if parts is None or len(parts) > 2 or any(p not in DTYPES for p in parts):
        return f"is not one of {', '.join(DTYPES)}, nor '<activation dtype>/<pool dtype>' of two of them"
    if len(parts) == 2 and not has_pool:
        return "names a pool dtype, but no signature buffer has `dtype_group: pool`"
    if len(parts) == 2 and parts[0] == parts[1]:
        return f"repeats one dtype: write {parts[0]!r}"
    return None


_KERNEL_KEYS = {"name", "kernel_attr", "description", "wrapper", "enable", "requires", "prefer",
                "check", "signature", "entries", *TARGETS}
_REQUIRED = {"name", "kernel_attr", "description", "wrapper", "enable", "signature", "entries"}


def _kernel(problems: _Problems, root: Path, d: Any, index: int, line: int) -> KernelSpec | None:
    where = f"kernels[{index}]: "
    if not isinstance(d, dict):
        problems.add(line, where, f"expected a mapping, got {_type_name(d)} {_short(d)}")
        return None
    raw_name = d.get("name")
    if isinstance(raw_name, str):
        where = f"kernel {_short(raw_name)}: "
    c = _Checker(problems, root, where)
    c.keys(d, _KERNEL_KEYS, _REQUIRED, "")
    name = c.ident(d, "name", _IDENT, "an identifier ([a-z_][a-z0-9_]*)", "name")
    attr = c.ident(d, "kernel_attr", _PUBLIC_IDENT, "a public identifier ([a-z][a-z0-9_]*)", "kernel_attr")
    desc = c.typed(d, "description", (str,), "a string", "description")
    if desc is not None and len(desc) > MAX_TEXT:
        c.err(d, "description", f"description: {len(desc)} characters; the limit is {MAX_TEXT}")
        desc = None
    wrapper = c.ident(d, "wrapper", _OBJREF, "a 'module.path:attr' reference", "wrapper", MAX_SYMBOL)
    check = c.ident(d, "check", _OBJREF, "a 'module.path:attr' reference", "check", MAX_SYMBOL)
    for key, ref in (("wrapper", wrapper), ("check", check)):
        why = hook_problem(ref) if ref else None
        if why:
            c.err(d, key, f"{key}: {why}")
            if key == "wrapper":
                wrapper = None

    enable = None
    e = d.get("enable")
    if "enable" in d:
        if not isinstance(e, dict):
            c.err(d, "enable", f"enable: expected a mapping with env and default, got {_type_name(e)} {_short(e)}")
        else:
            c.keys(e, {"env", "default"}, {"env", "default"}, "enable")
            env = c.ident(e, "env", _ENV, "an environment variable name ([A-Z][A-Z0-9_]*)", "enable.env")
            default = c.typed(e, "default", (bool,), "true or false", "enable.default")
            if env and default is not None:
                enable = EnableSpec(env=env, default=default)

    requires = c.requirements(d, "requires")
    prefer = c.requirements(d, "prefer")
    signature = _signature(c, d["signature"], d) if "signature" in d else None

    entries: dict[str, str] = {}
    ent = d.get("entries")
    entries_ok = "entries" in d
    if "entries" in d:
        if not isinstance(ent, dict) or not ent:
            entries_ok = False
            c.err(d, "entries", f"entries: expected a non-empty mapping dtype -> entry symbol, got "
                                f"{_type_name(ent)} {_short(ent)}")
        else:
            has_pool = signature is not None and any(b.dtype_group == "pool" for b in signature.buffers)
            for dt, sym in ent.items():
                problem = _entry_key_problem(dt, has_pool)
                if problem:
                    entries_ok = False
                    c.err(ent, dt, f"entries: {_key(dt)} {problem}")
                elif not isinstance(sym, str) or len(sym) > MAX_SYMBOL or not _C_IDENT.match(sym):
                    entries_ok = False
                    c.err(ent, dt, f"entries.{dt}: {_short(sym)} is not a C identifier of at most "
                                   f"{MAX_SYMBOL} characters")
                else:
                    entries[dt] = sym
            if len(set(entries.values())) != len(entries):
                entries_ok = False
                c.err(d, "entries", "entries: each dtype needs its own entry symbol")

    targets = {}
    targets_ok = True
    for t in TARGETS:
        if t in d:
            spec = _target(c, d[t], t, d)
            if spec is not None:
                targets[t] = spec
            else:
                targets_ok = False
    if not any(t in d for t in TARGETS):
        c.err(d, _MAPPING, f"declares no backend: give at least one of {', '.join(TARGETS)}")

    if None in (name, attr, desc, wrapper, enable, signature) or not entries_ok or not targets_ok:
        return None
    return KernelSpec(name=name, kernel_attr=attr, description=desc.strip(), wrapper=wrapper,
                      enable=enable, requires=requires, prefer=prefer, check=check,
                      signature=signature, entries=entries, targets=targets, root=root,
                      line=_line(d), raw=_plain(d))


def _read_text(path: Path) -> str:
    """The manifest's text: a regular file (a FIFO or device is refused without blocking), at most
    MAX_MANIFEST_BYTES, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ManifestError([f"{path}: manifest not found"]) from None
    except (OSError, ValueError) as e:
        raise ManifestError([f"{path}: cannot read manifest ({e})"]) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError([f"{path}: the manifest is not a regular file"])
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError([f"{path}: the manifest is {st.st_size} bytes; the limit is "
                                 f"{MAX_MANIFEST_BYTES} (docs/manifest.md, \"Limits\")"])
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ManifestError([f"{path}: cannot read manifest ({e})"]) from None
    finally:
        os.close(fd)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError([f"{path}: the manifest is over {MAX_MANIFEST_BYTES} bytes"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError([f"{path}: cannot read manifest (not UTF-8: {e})"]) from None


def hook_module_allowed(module: str) -> bool:
    """wrapper/check modules: the registry package, or a module named in MLX_AOT_HOOK_MODULES."""
    return module == HOOK_PACKAGE or module.startswith(HOOK_PACKAGE + ".") or (
        module in envs.get_list("MLX_AOT_HOOK_MODULES"))


@functools.lru_cache(maxsize=64)
def _top_level_names(origin: str, mtime_ns: int, size: int) -> frozenset[str]:
    """The names a module's source defines at top level, parsed once per file version (a manifest
    of thousands of kernels naming hooks would otherwise parse the module thousands of times)."""
    with open(origin, "rb") as f:
        tree = ast.parse(f.read(4 * 1024 * 1024))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def hook_problem(ref: str) -> str | None:
    """None if `module:attr` names an allowed module whose source defines `attr` at top level, else
    why not. Only `find_spec` runs (it imports the parent packages, which are the registry's own or
    allow-listed); the module itself is read, never executed."""
    module, attr = ref.split(":")
    if not hook_module_allowed(module):
        return (f"{ref}: module {module!r} is outside the {HOOK_PACKAGE} package; a wrapper or check "
                f"lives in {HOOK_PACKAGE}.* or in a module listed in MLX_AOT_HOOK_MODULES")
    if attr.startswith("_") or any(part.startswith("_") for part in module.split(".")):
        return f"{ref}: private names (leading '_') are not hooks"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        return f"{ref}: cannot find module {module} ({e})"
    if spec is None:
        return f"{ref}: module {module} not found"
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return f"{ref}: module {module} is not a Python source file ({origin or 'no file'})"
    try:
        st = os.stat(origin)
        names = _top_level_names(origin, st.st_mtime_ns, st.st_size)
    except (OSError, SyntaxError, ValueError) as e:
        return f"{ref}: cannot read {origin} ({e})"
    if attr not in names:
        return f"{ref}: {origin} defines no top-level {attr!r}"
    return None


def load_manifest(path: str | Path | None = None) -> Manifest:
    """Load and validate a manifest (default: the packaged kernels.yaml). Raises ManifestError."""
    from .paths import default_manifest_path

    path = Path(path) if path is not None else default_manifest_path()
    problems = _Problems(path)
    text = _read_text(path)
    try:
        data = yaml.load(text, Loader=_Loader)  # SafeLoader subclass: no Python object tags
    except RecursionError:   # a flow collection the composer's depth check has not reached yet
        raise ManifestError([f"{path.name}: not valid YAML: nesting deeper than {MAX_YAML_DEPTH} levels"]) from None
    except yaml.reader.ReaderError as e:   # a control character: no mark, a position in the text
        line = text.count("\n", 0, e.position) + 1
        char = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        raise ManifestError([f"{path.name}:{line}: not valid YAML: unacceptable character {char}: "
                             f"{e.reason}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ManifestError([f"{path.name}{line}: not valid YAML: "
                             f"{getattr(e, 'problem', None) or e}"]) from None
    if not isinstance(data, dict):
        raise ManifestError([f"{path.name}:1: expected a mapping with schema_version and kernels, "
                             f"got {_type_name(data)}"])
    top = _Checker(problems, path.parent, "")
    top.keys(data, {"schema_version", "kernels"}, {"schema_version", "kernels"}, "")
    version = data.get("schema_version")
    if "schema_version" in data and (type(version) is not int or version != SCHEMA_VERSION):
        top.err(data, "schema_version", f"schema_version: {_short(version)} is not supported; this "
                                        f"version of mlx-aot-kernels reads schema_version {SCHEMA_VERSION}")
    kernels_raw = data.get("kernels")
    kernels: list[KernelSpec] = []
    if "kernels" in data and not isinstance(kernels_raw, list):
        top.err(data, "kernels", f"kernels: expected a list, got {_type_name(kernels_raw)}")
    for i, entry in enumerate(kernels_raw if isinstance(kernels_raw, list) else []):
        spec = _kernel(problems, path.parent, entry, i, _line(data, "kernels"))
        if spec is not None:
            kernels.append(spec)
    seen_names: dict[str, int] = {}
    seen_attrs: dict[str, str] = {}
    for k in kernels:
        if k.name in seen_names:
            problems.add(k.line, f"kernel {k.name!r}: ", f"name: duplicate kernel name (first at line "
                                                         f"{seen_names[k.name]})")
        seen_names.setdefault(k.name, k.line)
        if k.kernel_attr in seen_attrs:
            problems.add(k.line, f"kernel {k.name!r}: ", f"kernel_attr: {k.kernel_attr!r} is already "
                                                         f"filled by kernel {seen_attrs[k.kernel_attr]!r}")
        seen_attrs.setdefault(k.kernel_attr, k.name)
        if k.kernel_attr in _RESERVED_ATTRS:
            problems.add(k.line, f"kernel {k.name!r}: ", f"kernel_attr: {k.kernel_attr!r} is reserved "
                                                         f"by KernelSet ({', '.join(sorted(_RESERVED_ATTRS))})")
    if problems.items:
        raise ManifestError(problems.items)
    return Manifest(path=path, schema_version=version, kernels=tuple(kernels))


# KernelSet's own attributes (tests/test_hardening.py checks this covers every public one).
_RESERVED_ATTRS = frozenset({"selected_kernel_names", "rejections", "explain", "kernels", "context",
                             "get", "items"})
