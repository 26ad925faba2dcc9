"""The Metal launcher's side of the kernel ABI matches metal_src/ and docs/kernel-abi.md, per kernel.

The emulation (tests/test_metal_emulation.py) checks the kernels against kernels.yaml; this checks the
launcher. For every kernel of kernels.yaml with a metal target and every entry, the plan is made by
the real registry.native.Launcher from the manifest signature, and the real eval_gpu of
csrc/aot_launch_metal.cpp runs it in tests/metal_launcher/probe.cpp (built against MLX 0.32.4's
macOS headers, its Metal calls recorded). What it binds and dispatches is then compared with:
- the .metal source (parsed and C++-type-resolved by tests/metal_emu: `[[buffer(i)]]` parameters,
  `[[function_constant(i)]]` constants): every buffer index the launcher binds is declared with the
  signature's name, element type and constness; set_bytes scalars are `constant T&` at their index;
  each strided buffer's int32[4] follows them, in buffer order, as `constant int4& <buffer>_strides`,
  holding the right-aligned strides of the array bound there (the probe's strided inputs are
  transposed views, distinct per buffer); function constants have the launcher's index and type and
  the scalar's name; nothing is left unbound;
- docs/kernel-abi.md's tables for the kernel (buffer index, name, role, dtype; scalar type and Metal
  slot; the strides' Metal buffers);
- the plan: one dispatch_threads(grid, threadgroup) with the wrapper's total-threads grid, none for
  an empty grid;
- the emulator's stand-in for the launcher (EmulatedMetal), which must bind exactly the same way.
"""

from __future__ import annotations

import re
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from registry.manifest import load_manifest
from registry.native import Launcher
from registry.paths import PROJECT_ROOT
from tests.metal_emu.emulator import METAL_ELEM, AbiMismatch, EmulatedMetal, compile_kernel, compile_source
from tests.metal_launcher import toolchain
from tests.test_metal_launcher_compiles import metal_headers  # noqa: F401  (the cached wheel headers)

MANIFEST = load_manifest()
METAL_KERNELS = [k for k in MANIFEST.kernels if "metal" in k.targets]
ENTRIES = [(k.name, dtype) for k in METAL_KERNELS for dtype in k.entries]
KERNEL_ABI = PROJECT_ROOT / "docs" / "kernel-abi.md"
GRID, GROUP = (7, 5, 3), (4, 2, 1)  # distinct on every axis, so a swapped axis shows
IMAGE = "verified metallib bytes"   # the KernelBinary.image the probe gives the launcher


@pytest.fixture(scope="session")
def cache_dir(request, tmp_path_factory) -> Path:
    try:
        return Path(request.config.cache.mkdir("metal_launcher"))
    except AttributeError:  # -p no:cacheprovider
        return tmp_path_factory.mktemp("metal_launcher")


@pytest.fixture(scope="session")
def probe(metal_headers, cache_dir) -> Path:  # noqa: F811
    return toolchain.build_probe(cache_dir, metal_headers)


@pytest.fixture(scope="session")
def emu_cache(request, tmp_path_factory) -> Path:
    try:  # shared with tests/test_metal_emulation.py: the runners are built once
        return Path(request.config.cache.mkdir("metal_emu"))
    except AttributeError:
        return tmp_path_factory.mktemp("metal_emu")


# ----------------------------------------------------------------------------- the launcher's side

def sentinel(index: int, type_: str) -> int | float:
    """A value per scalar that identifies it from its bits alone."""
    return 1000 + index if type_ == "int32" else 1000.5 + index


class _RecordingExt:
    """The registry._ext calls registry.native.Launcher makes, kept as plain values."""
    @staticmethod
    def KernelBinary(**kw):  # noqa: N802
        return SimpleNamespace(kwargs=kw, **kw)

    @staticmethod
    def LaunchArgs(entry, scalars, grid, threadgroup, dtype, buffer_dtypes, input_shapes=()):  # noqa: N802
        return SimpleNamespace(entry=entry, scalars=list(scalars), grid=tuple(grid), group=tuple(threadgroup),
                               dtype=dtype, buffer_dtypes=list(buffer_dtypes))


def python_plan(spec, dtype: str, grid=GRID, group=GROUP, values=None):
    """(binary, plan) exactly as registry.native.Launcher builds them from the manifest signature;
    scalars are their sentinels unless `values` says otherwise."""
    launcher = Launcher(spec, "metal", "/probe/artifact.metallib", spec.entries, _RecordingExt())
    scalars = {s.name: sentinel(j, s.type) for j, s in enumerate(spec.signature.scalars)}
    scalars.update(values or {})
    return launcher._binary, launcher.plan(dtype, scalars, grid=grid, threadgroup=group)


@dataclass
class LauncherAbi:
    """What one eval_gpu bound and dispatched, in the signature's terms."""
    buffers: dict[int, tuple[str, str]] = field(default_factory=dict)   # index -> (name, read|write|bytes|strides)
    strides: dict[int, tuple[int, ...]] = field(default_factory=dict)   # strides index -> the int32[4] set
    array_strides: dict[int, tuple[int, ...]] = field(default_factory=dict)  # array index -> its MLX strides
    dtypes: dict[int, str] = field(default_factory=dict)                # index -> dtype of the bound array
    constants: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (scalar, int|float)
    dispatches: list[tuple[str, tuple, tuple]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)                   # what is wrong on the launcher's side
    pipeline: bool = False       # the encoder got the pipeline get_kernel returned, before any dispatch
    pipeline_name: str = ""      # get_kernel's hash_name: MLX caches the specialised pipeline under it
    image_bytes: int = -1        # size of the dispatch_data the library was built from (newLibraryWithData)


def run_launcher(probe: Path, spec, dtype: str, grid=GRID, group=GROUP, values=None) -> LauncherAbi:
    binary, plan = python_plan(spec, dtype, grid, group, values)
    lines = [f"{plan.entry} {plan.dtype}"]
    for values in (binary.roles, binary.like, binary.strided, binary.scalar_types, binary.specialize, plan.scalars,
                   plan.buffer_dtypes):
        lines.append(" ".join(map(str, [len(values), *values])))
    lines.append(" ".join(map(str, [*plan.grid, *plan.group])))
    p = subprocess.run([str(probe)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("done"), f"eval_gpu failed:\n{p.stdout}\n{p.stderr}"
    return parse_record(p.stdout, spec, plan)


def parse_record(text: str, spec, plan) -> LauncherAbi:
    sig = spec.signature
    inputs = [b.name for b in sig.buffers if b.role in ("input", "inplace")]
    outputs = [b.name for b in sig.buffers if b.role in ("output", "inplace")]
    role = {b.name: b.role for b in sig.buffers}
    by_bits = {bits: s for bits, s in zip(plan.scalars, sig.scalars)}
    strided = [i for i, b in enumerate(sig.buffers) if b.strided]
    first_strides = len(sig.buffers) + sum(not s.specialize for s in sig.scalars)
    abi = LauncherAbi()

    def bind(index: int, what: tuple[str, str], offset: int = 0) -> None:
        if index in abi.buffers:
            abi.problems.append(f"[[buffer({index})]] bound twice: {abi.buffers[index]} and {what}")
        if offset:
            abi.problems.append(f"[[buffer({index})]] {what[0]} bound at byte offset {offset}, not at its start")
        abi.buffers[index] = what

    for line in text.splitlines():
        word, *rest = line.split()
        if word == "input":
            index, pos, offset = map(int, rest[:3])
            bind(index, (inputs[pos], "read"), offset)
            abi.dtypes[index] = rest[3]
            abi.array_strides[index] = tuple(map(int, rest[5:]))
            if role[inputs[pos]] == "inplace":
                abi.problems.append(f"in-place {inputs[pos]} bound as an input: the encoder would not order its "
                                    f"readers after the write")
        elif word == "output":
            index, pos, shares, offset = map(int, rest[:4])
            name = outputs[pos]
            bind(index, (name, "write"), offset)
            abi.dtypes[index] = rest[4]
            abi.array_strides[index] = tuple(map(int, rest[6:]))
            want = inputs.index(name) if role[name] == "inplace" else -1
            if shares != want:
                abi.problems.append(f"output {name} at [[buffer({index})]] shares the buffer of input {shares}, "
                                    f"expected {want}")
        elif word == "bytes" and rest[1] == "16":  # a strided buffer's int32[4], named by its index
            index, k = int(rest[0]), int(rest[0]) - first_strides
            name = f"{sig.buffers[strided[k]].name}_strides" if 0 <= k < len(strided) else f"<strides at {index}>"
            bind(index, (name, "strides"))
            abi.strides[index] = tuple(map(int, rest[2:]))
        elif word == "bytes":
            index, length, *bits = map(int, rest)
            s = by_bits.get(bits[0]) if length == 4 else None
            bind(index, (s.name if s else f"<{length} bytes>", "bytes"))
            if length != 4:
                abi.problems.append(f"set_bytes at {index}: {length} bytes (scalars are 4, strides 16)")
        elif word == "constant":  # index, int|float|other, value bits, MTLDataType
            index, type_, bits = int(rest[0]), rest[1], int(rest[2])
            s = by_bits.get(bits)
            if index in abi.constants:
                abi.problems.append(f"function constant {index} set twice")
            abi.constants[index] = (s.name if s else f"<bits {bits:#x}>", type_)
        elif word == "dispatch_data":
            abi.image_bytes = int(rest[0])
        elif word == "message" and rest == ["0", "newLibraryWithData:error:"]:
            pass
        elif word == "pipeline":
            abi.pipeline = rest[0] == "1" and not abi.dispatches
        elif word in ("dispatch_threads", "dispatch_threadgroups"):
            v = tuple(map(int, rest))
            abi.dispatches.append((word, v[:3], v[3:]))
        elif word == "kernel":  # entry, pipeline name, library is the one loaded, #constants, #linked
            if rest[0] != plan.entry:
                abi.problems.append(f"pipeline of function {rest[0]!r}, the plan's entry is {plan.entry!r}")
            if rest[2] != "1":
                abi.problems.append("get_kernel got another library than the one the launcher loaded")
            abi.pipeline_name = rest[1]
        elif word == "message" and rest[0] == "1" or word == "buffer":
            abi.problems.append(f"a call on the compute encoder this check does not model: {line}")
    for k, b in enumerate(strided):
        index, name = first_strides + k, f"{sig.buffers[b].name}_strides"
        if abi.buffers.get(index) != (name, "strides"):
            abi.problems.append(f"{name} must be set (16 bytes) at [[buffer({index})]], after the scalars in buffer "
                                f"order; found {abi.buffers.get(index)}")
            continue
        # The array's element strides right-aligned into 4 (docs/kernel-abi.md, "Strided buffers").
        st = abi.array_strides.get(b, ())
        want = (0,) * (4 - len(st)) + st
        if abi.strides[index] != want:
            abi.problems.append(f"{name} at [[buffer({index})]] is {abi.strides[index]}, the array bound at "
                                f"[[buffer({b})]] has strides {st}: expected {want}")
    passed = [name for name, access in abi.buffers.values() if access == "bytes"] + \
        [name for name, _ in abi.constants.values()]
    if sorted(passed) != sorted(s.name for s in sig.scalars):
        abi.problems.append(f"scalars passed {sorted(passed)}, the signature has {sorted(s.name for s in sig.scalars)}")
    return abi


# ----------------------------------------------------------------------------- the comparisons

def check_against_source(abi: LauncherAbi, spec, dtype: str, desc: dict, source) -> None:
    """Raise AbiMismatch unless the launcher's bindings are what the .metal entry declares."""
    entry = spec.entries[dtype]
    where = f"{source}: {entry}"
    found = [e for e in desc["entries"] if e["name"] == entry]
    if not found:
        raise AbiMismatch(f"{where}: no such entry; the source has {[e['name'] for e in desc['entries']]}")
    params = {p["index"]: p for p in found[0]["params"] if p["kind"] == 0}
    scalars = {s.name: s for s in spec.signature.scalars}
    unbound = sorted(set(params) - set(abi.buffers))
    undeclared = sorted(set(abi.buffers) - set(params))
    if unbound or undeclared:
        raise AbiMismatch(f"{where}: the launcher binds buffers {sorted(abi.buffers)}, the kernel declares "
                          f"[[buffer(i)]] {sorted(params)} (unbound: {unbound}, not declared: {undeclared})")
    for index, (name, access) in sorted(abi.buffers.items()):
        p = params[index]
        if p["name"] != name:
            raise AbiMismatch(f"{where}: [[buffer({index})]] is {p['name']!r}, the launcher binds {name!r} there")
        if access == "strides":
            if not (p["ref"] and p["const"] and p["elem"] == "int4"):
                raise AbiMismatch(f"{where}: [[buffer({index})]] {name}: the launcher sets an int32[4] (16 bytes), "
                                  f"the kernel must take `constant int4&`, not {p['elem']}{' &' if p['ref'] else ' *'}")
            continue
        if access == "bytes":
            want = METAL_ELEM[scalars[name].type]
            if not (p["ref"] and p["const"] and p["elem"] == want):
                raise AbiMismatch(f"{where}: [[buffer({index})]] {name}: the launcher sets 4 bytes (set_bytes), "
                                  f"the kernel must take `constant {want}&`, not {p['elem']}{' &' if p['ref'] else ' *'}")
            continue
        want = METAL_ELEM[abi.dtypes[index]]
        if p["ref"] or p["elem"] != want:
            raise AbiMismatch(f"{where}: [[buffer({index})]] {name}: the launcher binds an array of {want}, the kernel "
                              f"takes {'a reference to ' if p['ref'] else 'a pointer to '}{p['elem']}")
        if p["const"] != (access == "read"):
            raise AbiMismatch(f"{where}: [[buffer({index})]] {name} is {'const' if p['const'] else 'writable'}, the "
                              f"launcher binds it as {'an input' if access == 'read' else 'an output'}")
    consts = {c["index"]: c for c in desc["function_constants"]}
    if set(consts) != set(abi.constants):
        raise AbiMismatch(f"{source}: the launcher sets function constants {sorted(abi.constants)}, the source "
                          f"declares [[function_constant(i)]] {sorted(consts)}")
    for index, (name, type_) in sorted(abi.constants.items()):
        c = consts[index]
        if c["type"] != type_:
            raise AbiMismatch(f"{source}: function_constant({index}) {c['name']} is {c['type']}, the launcher passes "
                              f"{name} as {type_} (MTLDataType); Metal refuses the pipeline")
        if c["name"].lower() != name.lower():
            raise AbiMismatch(f"{source}: function_constant({index}) is {c['name']}, the launcher sets scalar {name} "
                              f"there (name it {name.upper()})")


def doc_tables(text: str, kernel: str) -> tuple[dict[int, tuple[str, str, str]], dict[str, tuple[str, str]],
                                                dict[str, int]]:
    """docs/kernel-abi.md's `## <kernel>` section: buffer index -> (name, role, dtype),
    scalar -> (type, Metal slot: 'buffer N' or 'function_constant(k)') and, from its
    "Strides (Metal buffer): `q_strides` 14, ..." line, strides name -> Metal buffer."""
    m = re.search(rf"^## {re.escape(kernel)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    if m is None:
        raise AbiMismatch(f"{KERNEL_ABI}: no `## {kernel}` section with its buffer and scalar tables")
    buffers, scalars = {}, {}
    for row in re.finditer(r"^\|\s*(\d+)\s*\|\s*(\w+)\s*\|\s*(\w+)[^|]*\|\s*(\w+)[^|]*\|", m.group(1), re.M):
        buffers[int(row.group(1))] = (row.group(2), row.group(3), row.group(4))
    for row in re.finditer(r"^\|\s*(\w+)\s*\|\s*(int32|float32)\b[^|]*\|\s*(buffer \d+|function_constant\(\d+\))\s*\|",
                           m.group(1), re.M):
        scalars[row.group(1)] = (row.group(2), row.group(3))
    strides = {}
    line = re.search(r"^Strides \(Metal buffer\):(.*?)(?:\.\s|\.$|\n\n)", m.group(1), re.M | re.S)
    if line:
        strides = {name: int(i) for name, i in re.findall(r"`(\w+)`\s+(\d+)", line.group(1))}
    return buffers, scalars, strides


def check_against_docs(abi: LauncherAbi, spec, text: str) -> None:
    buffers, scalars, strides = doc_tables(text, spec.name)
    sig = spec.signature
    role = {b.name: b for b in sig.buffers}
    stype = {s.name: s.type for s in sig.scalars}
    # dtype column: the fixed dtype, P for the entry key's pool dtype (dtype_group: pool), T for its
    # activation dtype.
    symbol = {b.name: b.dtype or ("P" if b.dtype_group == "pool" else "T") for b in sig.buffers}
    want_b = {i: (name, role[name].role, symbol[name]) for i, (name, access) in abi.buffers.items()
              if access in ("read", "write")}
    want_strides = {name: i for i, (name, access) in abi.buffers.items() if access == "strides"}
    want_s = {name: (stype[name], f"buffer {i}") for i, (name, access) in abi.buffers.items() if access == "bytes"}
    want_s.update({name: (stype[name], f"function_constant({k})") for k, (name, _) in abi.constants.items()})
    if buffers != want_b:
        raise AbiMismatch(f"{KERNEL_ABI} ## {spec.name}: buffer table {buffers}, the launcher binds {want_b} "
                          f"(index: name, role, dtype)")
    if scalars != want_s:
        raise AbiMismatch(f"{KERNEL_ABI} ## {spec.name}: scalar table {scalars}, the launcher passes {want_s}")
    if strides != want_strides:
        raise AbiMismatch(f"{KERNEL_ABI} ## {spec.name}: \"Strides (Metal buffer)\" says {strides}, the launcher "
                          f"sets {want_strides}")


# ----------------------------------------------------------------------------- the tests

@pytest.mark.parametrize("kernel,dtype", ENTRIES, ids=[f"{k}-{d}" for k, d in ENTRIES])
def test_launcher_abi_matches_source_and_docs(probe, emu_cache, kernel, dtype):
    spec = MANIFEST.kernel(kernel)
    abi = run_launcher(probe, spec, dtype)
    assert not abi.problems, abi.problems
    assert abi.pipeline, "the encoder must get the pipeline of get_kernel before the dispatch"
    assert abi.image_bytes == len(IMAGE), \
        "the library must be built from the verified bytes (KernelBinary.image, docs/native.md)"
    n_bytes = sum(not s.specialize for s in spec.signature.scalars)
    n_strided = sum(b.strided for b in spec.signature.buffers)
    assert len(abi.buffers) == len(spec.signature.buffers) + n_bytes + n_strided, abi.buffers
    assert len(set(abi.strides.values())) == n_strided, \
        f"the probe's strided arrays must have distinct strides, so a swap shows: {abi.strides}"
    binary, plan = python_plan(spec, dtype)
    assert abi.dispatches == [("dispatch_threads", plan.grid, plan.group)], \
        "the launcher must dispatch the wrapper's grid of threads once, with its threadgroup (docs/kernel-abi.md)"
    library = compile_kernel(spec, emu_cache)
    check_against_source(abi, spec, dtype, library.describe(), library.source)
    check_against_docs(abi, spec, KERNEL_ABI.read_text())


@pytest.mark.parametrize("kernel", [k.name for k in METAL_KERNELS])
def test_pipeline_name_spells_every_constant(probe, kernel):
    """MLX caches a specialised pipeline under get_kernel's hash_name: two launches whose function
    constants differ in any bit (0.1 and its float32 neighbour) must get two names, or the second
    would run the first one's pipeline. Non-specialised scalars must not split the cache."""
    spec = MANIFEST.kernel(kernel)
    dtype = next(iter(spec.entries))
    base = run_launcher(probe, spec, dtype).pipeline_name
    assert base.startswith(spec.entries[dtype]) and run_launcher(probe, spec, dtype).pipeline_name == base
    for j, s in enumerate(spec.signature.scalars):
        v = sentinel(j, s.type)
        bumped = v + 1 if s.type == "int32" else struct.unpack("<f", struct.pack("<I", struct.unpack(
            "<I", struct.pack("<f", v))[0] + 1))[0]  # the next float32 up
        name = run_launcher(probe, spec, dtype, values={s.name: bumped}).pipeline_name
        assert (name != base) == s.specialize, (s.name, base, name)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_empty_grid_dispatches_nothing(probe, axis):
    spec = METAL_KERNELS[0]
    grid = tuple(0 if a == axis else g for a, g in enumerate(GRID))
    abi = run_launcher(probe, spec, next(iter(spec.entries)), grid=grid)
    assert abi.dispatches == [] and not abi.problems


@pytest.mark.parametrize("kernel,dtype", ENTRIES, ids=[f"{k}-{d}" for k, d in ENTRIES])
def test_emulator_binds_like_the_launcher(probe, emu_cache, kernel, dtype):
    """tests/metal_emu's EmulatedMetal stands in for the launcher in every emulated parity test: it must
    put the same arrays, scalar bytes and function constants at the same indices."""
    spec = MANIFEST.kernel(kernel)
    abi = run_launcher(probe, spec, dtype)
    emu = EmulatedMetal(compile_kernel(spec, emu_cache), spec)
    seen = {}
    emu.library = SimpleNamespace(run=lambda entry, host, constants, grid, group, **kw: seen.update(
        entry=entry, host=host, constants=constants, grid=grid, group=group) or host)
    binary, plan = python_plan(spec, dtype)
    binary = emu.KernelBinary(**binary.kwargs)
    emu_plan = emu.LaunchArgs(plan.entry, plan.scalars, plan.grid, plan.group, plan.dtype, plan.buffer_dtypes)
    arrays = []
    for i, b in enumerate(spec.signature.buffers):
        if b.role != "output":   # as the probe makes them: strided inputs are transposed views
            t, n = getattr(mx, plan.buffer_dtypes[i]), len(arrays)
            arrays.append(mx.full((2, n + 2, 3, 4), n + 1, dtype=t).transpose(0, 2, 1, 3) if b.strided
                          else mx.full((n + 1,), n + 1, dtype=t))
    emu.launch(binary, emu_plan, arrays)
    sizes = {b.name: a.size for b, a in zip(spec.signature.inputs, arrays)}
    likes = {b.name: b.like for b in spec.signature.buffers}
    by_bits = {bits: s.name for bits, s in zip(plan.scalars, spec.signature.scalars)}
    for index, (name, access) in abi.buffers.items():
        a = seen["host"].get(index)
        assert a is not None, f"the emulator binds nothing at [[buffer({index})]], the launcher binds {name}"
        if access == "bytes":
            assert a.nbytes == 4 and by_bits[int(a.view("uint32")[0])] == name, (index, name)
        elif access == "strides":
            assert a.dtype == "int32" and tuple(a.tolist()) == abi.strides[index], (index, name, a, abi.strides[index])
        else:
            assert a.size == sizes[likes[name] or name], f"[[buffer({index})]]: the emulator binds another array"
            assert str(a.dtype) == {"bfloat16": "uint16"}.get(abi.dtypes[index], abi.dtypes[index]), (index, a.dtype)
    assert set(seen["host"]) == set(abi.buffers)
    assert {k: (by_bits[c.bits], {"int32": "int", "float32": "float"}[c.type]) for k, c in
            seen["constants"].items()} == abi.constants
    assert (seen["grid"], seen["group"]) == (plan.grid, plan.group)


ROPE = MANIFEST.kernel("rope_pool_fused")  # the plants edit its source


def _planted(emu_cache, where: Path, *edits: tuple[str, str]):
    """The rope kernel's emulator library built from its source with `edits` applied, written at a
    fixed path (`where`, in the cache) so that its runner is cached too."""
    target = ROPE.targets["metal"]
    source = ROPE.root / target.sources[0]
    text = source.read_text()
    for old, new in edits:
        assert old in text, f"{source} no longer contains {old!r}; update the plant"
        text = text.replace(old, new)
    where.mkdir(parents=True, exist_ok=True)
    planted = where / source.name
    planted.write_text(text)
    return compile_source(planted, emu_cache, include_dirs=[ROPE.root / d for d in target.include_dirs],
                          std=target.std)


def test_planted_shifted_buffer_index_fails(probe, emu_cache, cache_dir):
    """The first set_bytes scalar moved from [[buffer(n_buffers)]] to n_buffers + 12, past the strides
    buffers (template and entries)."""
    n = len(ROPE.signature.buffers)
    lib = _planted(emu_cache, cache_dir / "shifted_buffer", (f"[[buffer({n})]]", f"[[buffer({n + 12})]]"))
    dtype = next(iter(ROPE.entries))
    with pytest.raises(AbiMismatch, match=rf"unbound: \[{n + 12}\], not declared: \[{n}\]"):
        check_against_source(run_launcher(probe, ROPE, dtype), ROPE, dtype, lib.describe(), lib.source)


def test_planted_swapped_function_constants_fail(probe, emu_cache, cache_dir):
    """Two int constants swapped: indices and types still line up, only the names tell."""
    lib = _planted(emu_cache, cache_dir / "swapped_constants", ("N_Q_HEADS [[function_constant(0)]]", "N_Q_HEADS [[function_constant(1)]]"),
                   ("N_KV_HEADS [[function_constant(1)]]", "N_KV_HEADS [[function_constant(0)]]"))
    dtype = next(iter(ROPE.entries))
    with pytest.raises(AbiMismatch, match=r"function_constant\(0\) is N_KV_HEADS"):
        check_against_source(run_launcher(probe, ROPE, dtype), ROPE, dtype, lib.describe(), lib.source)


@pytest.mark.parametrize("file,good,bad,error", [
    ("aot_launch_metal.cpp", "int slot = n_buffers;", "int slot = n_buffers + 1;",
     r"unbound: \[{n}\], not declared: \[{n2}\]"),
    ("aot_launch_metal.cpp", "MTL::DataType::DataTypeFloat : MTL::DataType::DataTypeInt", "MTL::DataType::DataTypeInt : "
     "MTL::DataType::DataTypeFloat", r"function_constant\(0\) N_Q_HEADS is int, the launcher passes n_q_heads as float"),
    # the strides come from launch_strides, which the CPU and CUDA launchers share
    ("aot_launch.cpp", "if (!bin.strided[b]) continue;", "continue;",
     r"unbound: \[{s}, {s1}, \d+, \d+, \d+\], not declared: \[\]"),
    ("aot_launch.cpp", "bin.output_of[b] >= 0 ? outputs[bin.output_of[b]] : inputs[bin.input_of[b]]", "inputs[0]",
     r"k_strides at \[\[buffer\({s1}\)\]\] is \(\d+, 4, \d+, 1\), the array bound at \[\[buffer\(1\)\]\] has strides"),
], ids=["scalar-slots-shifted", "constant-types-swapped", "strides-missing", "strides-of-another-buffer"])
def test_planted_launcher_change_fails(metal_headers, cache_dir, emu_cache, tmp_path, file, good, bad, error):  # noqa: F811
    """The launcher's mapping comes from its code, not from a model of it: a planted change in
    csrc/ changes what the probe records, and the check fails."""
    for f in toolchain.CSRC.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    source = (tmp_path / file).read_text()
    assert source.count(good) == 1, f"csrc/{file} no longer contains {good!r} once; update the plant"
    (tmp_path / file).write_text(source.replace(good, bad))
    planted = toolchain.build_probe(cache_dir, metal_headers, launcher_dir=tmp_path)
    dtype = next(iter(ROPE.entries))
    lib = compile_kernel(ROPE, emu_cache)
    n = len(ROPE.signature.buffers)
    n_bytes = sum(not s.specialize for s in ROPE.signature.scalars)
    n_strided = sum(b.strided for b in ROPE.signature.buffers)
    with pytest.raises(AbiMismatch, match=error.format(n=n, n2=n + n_bytes + n_strided, s=n + n_bytes,
                                                       s1=n + n_bytes + 1)):
        abi = run_launcher(planted, ROPE, dtype)
        check_against_source(abi, ROPE, dtype, lib.describe(), lib.source)
        if abi.problems:   # what the source cannot tell: e.g. the strides of another buffer
            raise AbiMismatch("; ".join(abi.problems))


def test_planted_doc_mismatch_fails(probe):
    spec = ROPE
    abi = run_launcher(probe, spec, next(iter(spec.entries)))
    text = KERNEL_ABI.read_text()
    check_against_docs(abi, spec, text)
    with pytest.raises(AbiMismatch, match="scalar table"):
        check_against_docs(abi, spec, re.sub(r"function_constant\(0\)", "function_constant(9)", text, count=1))
    with pytest.raises(AbiMismatch, match=r"\"Strides \(Metal buffer\)\" says .*'k_strides': 16"):
        check_against_docs(abi, spec, text.replace("`k_strides` 15", "`k_strides` 16", 1))
    with pytest.raises(AbiMismatch, match="no `## missing_kernel` section"):
        check_against_docs(abi, SimpleNamespace(name="missing_kernel", signature=spec.signature), text)
