"""kernels.yaml -> frozen KernelSpec dataclasses. The schema is documented in docs/manifest.md.

Loading uses yaml.SafeLoader semantics (no Python tags) with line numbers kept, and collects every
problem before raising one ManifestError whose lines read
    kernels.yaml:12: kernel 'rope_pool_fused': cuda.sources[0]: cuda_src/x.cu does not exist
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from .errors import ManifestError
from .expr import ExprError, Requirement, compile_requirement

SCHEMA_VERSION = 1
TARGETS = ("metal", "cuda", "cpu")
DTYPES = ("float16", "bfloat16", "float32")
BUFFER_ROLES = ("input", "output", "inplace")
DTYPE_GROUPS = ("pool",)           # signature.buffers[].dtype_group
SCALAR_TYPES = ("int32", "float32")

_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
_ENV = re.compile(r"^[A-Z][A-Z0-9_]*$")
_C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OBJREF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
_CUDA_ARCH = re.compile(r"^sm_[0-9]{2,3}[af]?$")
_PTX_ARCH = re.compile(r"^compute_[0-9]{2,3}[af]?$")
_METAL_STD = re.compile(r"^metal[0-9]\.[0-9]$")
_MACOS = re.compile(r"^[0-9]{2}(\.[0-9]+){0,2}$")


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
    dtype: str | None = None       # fixed dtype (e.g. int32); None = the kernel's dtype
    dtype_group: str | None = None # 'pool': the entry key's pool dtype; None: its activation dtype


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
        raise KeyError(f"{self.path}: no kernel named {name!r}; declared: "
                       f"{', '.join(k.name for k in self.kernels) or '(none)'}")


# ----------------------------------------------------------------------------- YAML with lines

class _LineDict(dict):
    line: int = 0
    key_lines: dict


class _Loader(yaml.SafeLoader):
    """SafeLoader that records line numbers and rejects duplicate keys (safe_load keeps the last)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False):
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
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if key in result:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {result.key_lines[key]})",
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


def _line(d: Any, key: str | None = None) -> int:
    if isinstance(d, _LineDict):
        if key is not None and key in d.key_lines:
            return d.key_lines[key]
        return d.line
    return 0


def _type_name(value: Any) -> str:
    return {dict: "a mapping", _LineDict: "a mapping", list: "a list", str: "a string",
            bool: "a boolean", int: "an integer", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


class _Checker:
    def __init__(self, problems: _Problems, root: Path, where: str):
        self.p = problems
        self.root = root
        self.where = where

    def err(self, d: Any, key: str | None, msg: str) -> None:
        self.p.add(_line(d, key), self.where, msg)

    def keys(self, d: dict, allowed: set[str], required: set[str], field_name: str) -> None:
        prefix = f"{field_name}: " if field_name else ""
        for k in d:
            if k not in allowed:
                self.err(d, k, f"{prefix}unknown key {k!r}; allowed: {', '.join(sorted(allowed))}")
        for k in sorted(required - set(d)):
            self.err(d, None, f"{prefix}missing required key {k!r}")

    def typed(self, d: dict, key: str, types: tuple, expected: str, field_name: str) -> Any:
        value = d.get(key)
        if key in d and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            self.err(d, key, f"{field_name}: expected {expected}, got {_type_name(value)} {value!r}")
            return None
        return value

    def ident(self, d: dict, key: str, pattern: re.Pattern, expected: str, field_name: str) -> str | None:
        value = self.typed(d, key, (str,), "a string", field_name)
        if value is not None and not pattern.match(value):
            self.err(d, key, f"{field_name}: {value!r} is not {expected}")
            return None
        return value

    def rel_path(self, d: Any, key: str | None, value: Any, field_name: str, want_dir: bool) -> str | None:
        if not isinstance(value, str) or not value:
            self.err(d, key, f"{field_name}: expected a relative path string, got {_type_name(value)} {value!r}")
            return None
        pure = PurePosixPath(value)
        if pure.is_absolute() or value.startswith("~") or re.match(r"^[A-Za-z]:[\\/]", value):
            self.err(d, key, f"{field_name}: {value!r} is absolute; paths are relative to "
                             f"{self.root}")
            return None
        resolved = (self.root / value).resolve()
        try:
            resolved.relative_to(self.root.resolve())
        except ValueError:
            self.err(d, key, f"{field_name}: {value!r} escapes the project root {self.root}")
            return None
        if want_dir and not resolved.is_dir():
            self.err(d, key, f"{field_name}: directory {value} does not exist")
        elif not want_dir and not resolved.is_file():
            self.err(d, key, f"{field_name}: {value} does not exist")
        return value

    def str_list(self, d: dict, key: str, field_name: str, *, nonempty: bool = False) -> list | None:
        value = d.get(key)
        if key not in d:
            return [] if not nonempty else None
        if not isinstance(value, list) or (nonempty and not value):
            self.err(d, key, f"{field_name}: expected a {'non-empty ' if nonempty else ''}list, "
                             f"got {_type_name(value)} {value!r}")
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
                                 f"{{expr, reason}}, got {_type_name(item)} {item!r}")
                continue
            try:
                out.append(compile_requirement(text, reason))
            except ExprError as e:
                self.err(holder, "expr" if holder is not d else key, f"{fname}: `{text}`: {e}")
        return tuple(out)


def _target(c: _Checker, d: Any, target: str) -> TargetSpec | None:
    if not isinstance(d, dict):
        c.err(d, None, f"{target}: expected a mapping, got {_type_name(d)} {d!r}")
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
    for i, f in enumerate(flags):
        if not isinstance(f, str) or not f.startswith("-"):
            c.err(d, "flags", f"{target}.flags[{i}]: expected a compiler flag string starting "
                              f"with '-', got {f!r}")
    kw: dict[str, Any] = {}
    if target == "metal":
        kw["std"] = c.ident(d, "std", _METAL_STD, "a Metal language standard like metal3.1",
                            "metal.std") or "metal3.1"
        if "macos_min" in d and not isinstance(d["macos_min"], str):
            c.err(d, "macos_min", f"metal.macos_min: expected a quoted version string like \"14.0\", "
                                  f"got {_type_name(d['macos_min'])} {d['macos_min']!r}")
        else:
            kw["macos_min"] = c.ident(d, "macos_min", _MACOS, "a macOS version like 14.0",
                                      "metal.macos_min") or "14.0"
    if target == "cuda":
        archs = c.str_list(d, "archs", "cuda.archs", nonempty=True) if "archs" in d else []
        for i, a in enumerate(archs or []):
            if not isinstance(a, str) or not _CUDA_ARCH.match(a):
                c.err(d, "archs", f"cuda.archs[{i}]: {a!r} is not an arch like sm_90")
        if archs and len(set(archs)) != len(archs):
            c.err(d, "archs", "cuda.archs: duplicate entries")
        kw["archs"] = tuple(archs or ())
        kw["ptx_arch"] = c.ident(d, "ptx_arch", _PTX_ARCH, "a PTX arch like compute_80", "cuda.ptx_arch")
    return TargetSpec(target=target, sources=tuple(s for s in srcs if s),
                      include_dirs=tuple(s for s in incs if s),
                      flags=tuple(f for f in flags if isinstance(f, str)), **kw)


def _signature(c: _Checker, d: Any) -> SignatureSpec | None:
    if not isinstance(d, dict):
        c.err(d, None, f"signature: expected a mapping, got {_type_name(d)} {d!r}")
        return None
    c.keys(d, {"buffers", "scalars"}, {"buffers"}, "signature")
    buffers: list[BufferSpec] = []
    names: set[str] = set()
    for i, b in enumerate(c.str_list(d, "buffers", "signature.buffers", nonempty=True) or []):
        fname = f"signature.buffers[{i}]"
        if not isinstance(b, dict):
            c.err(d, "buffers", f"{fname}: expected a mapping, got {_type_name(b)} {b!r}")
            continue
        c.keys(b, {"name", "role", "like", "dtype", "dtype_group"}, {"name", "role"}, fname)
        name = c.ident(b, "name", _IDENT, "an identifier", f"{fname}.name")
        role = c.typed(b, "role", (str,), "a string", f"{fname}.role")
        if role is not None and role not in BUFFER_ROLES:
            c.err(b, "role", f"{fname}.role: {role!r} is not one of {', '.join(BUFFER_ROLES)}")
            role = None
        like = c.typed(b, "like", (str,), "a string", f"{fname}.like")
        dtype = c.typed(b, "dtype", (str,), "a string", f"{fname}.dtype")
        if dtype is not None and dtype not in DTYPES + ("int32",):
            c.err(b, "dtype", f"{fname}.dtype: {dtype!r} is not one of {', '.join(DTYPES + ('int32',))}")
        group = c.typed(b, "dtype_group", (str,), "a string", f"{fname}.dtype_group")
        if group is not None and group not in DTYPE_GROUPS:
            c.err(b, "dtype_group", f"{fname}.dtype_group: {group!r} is not one of {', '.join(DTYPE_GROUPS)}")
        elif group is not None and (dtype is not None or role == "output"):
            c.err(b, "dtype_group", f"{fname}.dtype_group: only an input or inplace buffer without a fixed "
                                    f"dtype takes a group (outputs follow their `like`)")
        if role == "output" and like is None:
            c.err(b, None, f"{fname}: an output needs `like: <input>` for its shape and dtype")
        if role != "output" and like is not None:
            c.err(b, "like", f"{fname}.like: only outputs take `like`")
        if like is not None and like not in {x.name for x in buffers if x.role != "output"}:
            c.err(b, "like", f"{fname}.like: {like!r} is not an input declared before it")
        if name in names:
            c.err(b, "name", f"{fname}.name: duplicate buffer name {name!r}")
        if name and role:
            names.add(name)
            buffers.append(BufferSpec(name=name, role=role, like=like, dtype=dtype, dtype_group=group))
    scalars: list[ScalarSpec] = []
    for i, s in enumerate(c.str_list(d, "scalars", "signature.scalars") or []):
        fname = f"signature.scalars[{i}]"
        if not isinstance(s, dict):
            c.err(d, "scalars", f"{fname}: expected a mapping, got {_type_name(s)} {s!r}")
            continue
        c.keys(s, {"name", "type", "specialize"}, {"name", "type"}, fname)
        name = c.ident(s, "name", _IDENT, "an identifier", f"{fname}.name")
        typ = c.typed(s, "type", (str,), "a string", f"{fname}.type")
        if typ is not None and typ not in SCALAR_TYPES:
            c.err(s, "type", f"{fname}.type: {typ!r} is not one of {', '.join(SCALAR_TYPES)}")
            typ = None
        spec = c.typed(s, "specialize", (bool,), "true or false", f"{fname}.specialize")
        if name in names:
            c.err(s, "name", f"{fname}.name: {name!r} is already a buffer or scalar name")
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
        problems.add(line, where, f"expected a mapping, got {_type_name(d)} {d!r}")
        return None
    raw_name = d.get("name")
    if isinstance(raw_name, str):
        where = f"kernel {raw_name!r}: "
    c = _Checker(problems, root, where)
    c.keys(d, _KERNEL_KEYS, _REQUIRED, "")
    name = c.ident(d, "name", _IDENT, "an identifier ([a-z_][a-z0-9_]*)", "name")
    attr = c.ident(d, "kernel_attr", _IDENT, "an identifier ([a-z_][a-z0-9_]*)", "kernel_attr")
    desc = c.typed(d, "description", (str,), "a string", "description")
    wrapper = c.ident(d, "wrapper", _OBJREF, "a 'module.path:attr' reference", "wrapper")
    check = c.ident(d, "check", _OBJREF, "a 'module.path:attr' reference", "check")

    enable = None
    e = d.get("enable")
    if "enable" in d:
        if not isinstance(e, dict):
            c.err(d, "enable", f"enable: expected a mapping with env and default, got {_type_name(e)} {e!r}")
        else:
            c.keys(e, {"env", "default"}, {"env", "default"}, "enable")
            env = c.ident(e, "env", _ENV, "an environment variable name ([A-Z][A-Z0-9_]*)", "enable.env")
            default = c.typed(e, "default", (bool,), "true or false", "enable.default")
            if env and default is not None:
                enable = EnableSpec(env=env, default=default)

    requires = c.requirements(d, "requires")
    prefer = c.requirements(d, "prefer")
    signature = _signature(c, d["signature"]) if "signature" in d else None

    entries: dict[str, str] = {}
    ent = d.get("entries")
    if "entries" in d:
        if not isinstance(ent, dict) or not ent:
            c.err(d, "entries", f"entries: expected a non-empty mapping dtype -> entry symbol, got "
                                f"{_type_name(ent)} {ent!r}")
        else:
            has_pool = signature is not None and any(b.dtype_group == "pool" for b in signature.buffers)
            for dt, sym in ent.items():
                problem = _entry_key_problem(dt, has_pool)
                if problem:
                    c.err(ent, dt, f"entries: {dt!r} {problem}")
                elif not isinstance(sym, str) or not _C_IDENT.match(sym):
                    c.err(ent, dt, f"entries.{dt}: {sym!r} is not a C identifier")
                else:
                    entries[dt] = sym
            if len(set(entries.values())) != len(entries):
                c.err(d, "entries", "entries: each dtype needs its own entry symbol")

    targets = {}
    for t in TARGETS:
        if t in d:
            spec = _target(c, d[t], t)
            if spec is not None:
                targets[t] = spec
    if not any(t in d for t in TARGETS):
        c.err(d, None, f"declares no backend: give at least one of {', '.join(TARGETS)}")

    if None in (name, attr, desc, wrapper, enable, signature) or len(entries) != len(ent or {}):
        return None
    return KernelSpec(name=name, kernel_attr=attr, description=desc.strip(), wrapper=wrapper,
                      enable=enable, requires=requires, prefer=prefer, check=check,
                      signature=signature, entries=entries, targets=targets, root=root,
                      line=_line(d), raw=_plain(d))


def load_manifest(path: str | Path | None = None) -> Manifest:
    """Load and validate a manifest (default: the packaged kernels.yaml). Raises ManifestError."""
    from .paths import default_manifest_path

    path = Path(path) if path is not None else default_manifest_path()
    problems = _Problems(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError([f"{path}: manifest not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError([f"{path}: cannot read manifest ({e})"]) from None
    try:
        data = yaml.load(text, Loader=_Loader)  # SafeLoader subclass: no Python object tags
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
    if "schema_version" in data and version != SCHEMA_VERSION:
        top.err(data, "schema_version", f"schema_version: {version!r} is not supported; this "
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


_RESERVED_ATTRS = frozenset({"selected_kernel_names", "rejections", "explain", "kernels", "context",
                             "get", "items"})
