"""registry._ext's Metal build type-checks on Linux against MLX 0.32.4's real macOS headers.

Every source csrc/CMakeLists.txt compiles with the Metal backend (the bindings included) goes through
`clang++ -fsyntax-only` at MLX's C++ standard with -fblocks, against the mlx-metal==0.32.4 wheel's
`mlx/include` (MLX's Metal backend headers and Apple's metal-cpp), nanobind's and Python's headers;
only Apple's system headers are stand-ins (tests/apple_stubs/). The wheel is downloaded once into
pytest's cache (.pytest_cache/d/mlx-metal-wheel/), and each result is kept there under the sha256 of
what the compile reads (.pytest_cache/d/metal_launcher_check/), so an unchanged launcher is not
re-checked. The tests skip only when the package registry cannot be reached; without clang++ they
fail, saying how to install it. What this proves and what only a Mac can: docs/metal.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.metal_launcher import toolchain


def _cache(request, tmp_path_factory, name: str) -> Path:
    try:
        return Path(request.config.cache.mkdir(name))
    except AttributeError:  # -p no:cacheprovider
        return tmp_path_factory.mktemp(name)


@pytest.fixture(scope="session")
def metal_headers(request, tmp_path_factory) -> Path:
    """mlx/include of the mlx-metal wheel (cached between runs)."""
    cache = _cache(request, tmp_path_factory, "mlx-metal-wheel")
    try:
        include = toolchain.fetch_headers(cache)
    except toolchain.RegistryUnreachable as e:
        pytest.skip(str(e))
    try:
        toolchain.clang()
    except FileNotFoundError as e:
        pytest.fail(str(e), pytrace=False)
    return include


def _errors(results) -> str:
    return "\n".join(f"{src}:\n{r.stderr[-6000:]}" for src, r in results.items() if r.returncode != 0)


@pytest.fixture(scope="session")
def check_cache(request, tmp_path_factory) -> Path:
    """Results of syntax checks, keyed by everything they read (toolchain.syntax_check)."""
    return _cache(request, tmp_path_factory, "metal_launcher_check")


def test_metal_build_type_checks(metal_headers, check_cache):
    build = toolchain.metal_build(metal_headers)
    names = sorted(s.name for s in build.sources)
    assert "aot_launch_metal.cpp" in names and "bindings.cpp" in names, names
    results = toolchain.syntax_check(build.sources, build.flags(metal_headers), check_cache)
    assert not _errors(results), f"the Metal build does not type-check against MLX 0.32.4:\n{_errors(results)}"


# A wrong argument type in a call to MLX's Metal API: (call, planted call, what clang's error names).
PLANTS = {
    "get_kernel": ("d.get_kernel(args_.entry, lib, hash.str(), constants)",  # an int for the MTLFCList
                   "d.get_kernel(args_.entry, lib, hash.str(), fc_index)", "get_kernel"),
    "dispatch_threads": ("enc.dispatch_threads(MTL::Size(args_.grid[0], args_.grid[1], args_.grid[2]),",
                         "enc.dispatch_threads(args_.grid,", "MTL::Size"),  # std::array for an MTL::Size
}


@pytest.mark.parametrize("call", sorted(PLANTS))
def test_planted_api_misuse_fails_to_compile(metal_headers, check_cache, call):
    """The check is not vacuous: the launcher with one wrongly typed MLX call is rejected, naming it.
    The planted copy lies at a fixed path in the cache, so its (content-keyed) result is reused."""
    good, bad, named = PLANTS[call]
    source = (toolchain.CSRC / "aot_launch_metal.cpp").read_text()
    assert source.count(good) == 1, (f"csrc/aot_launch_metal.cpp no longer contains {good!r} once; update PLANTS "
                                     f"in {__file__} to plant the misuse in the current call")
    where = check_cache / f"plant-{call}"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    for f in toolchain.CSRC.iterdir():
        if f.suffix == ".h":
            shutil.copy2(f, where / f.name)
    planted = where / "aot_launch_metal.cpp"
    planted.write_text(source.replace(good, bad))
    line = source[:source.index(good)].count("\n") + 1
    flags = [f for f in toolchain.metal_build(metal_headers).flags(metal_headers) if f != f"-I{toolchain.CSRC}"]
    r = toolchain.syntax_check([planted], [*flags, f"-I{where}"], check_cache)[planted]
    assert r.returncode != 0, f"clang accepted the planted misuse {bad!r}"
    # The first error is the plant's (the unplanted file type-checks: test_metal_build_type_checks).
    first = next((ln for ln in r.stderr.splitlines() if "error:" in ln), "")
    assert first.startswith(f"{planted}:{line}:") and named in first, r.stderr[-3000:]


def test_unreachable_registry_is_the_skip_reason(tmp_path):
    """The one reason to skip is recognised as such: an index nothing listens on."""
    with pytest.raises(toolchain.RegistryUnreachable, match="registry cannot be reached"):
        toolchain.pip_download(tmp_path, ("--isolated", "--index-url", "http://127.0.0.1:9/simple/",
                                          "--retries", "0", "--timeout", "5"))


def test_stubs_are_only_apple_system_headers():
    """tests/apple_stubs/ stands in for Apple's system headers, never for MLX's or metal-cpp's."""
    tops = {p.relative_to(toolchain.STUBS).parts[0] for p in toolchain.STUBS.rglob("*.h")}
    assert tops <= {"objc", "dispatch", "CoreFoundation", "IOSurface", "mach", "simd", "CoreGraphics",
                    "TargetConditionals.h"}, tops
    for f in toolchain.STUBS.rglob("*.h"):
        text = f.read_text()
        assert text.startswith("// Stand-in for Apple's"), f"{f}: say what it stands for"


def test_clang_missing_fails_with_the_install_command(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="apt-get update && apt-get install -y clang"):
        toolchain.clang()

