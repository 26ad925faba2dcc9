"""Ahead-of-time builds of the kernels declared in kernels.yaml (`python -m build_tools`, docs/build.md).

Where each concern lives:
  cli.py         the click group `build_tools.cli:cli` (thin; other helpers add subcommands)
  compiler.py    compile_kernels(): planning, freshness, locks, temp dirs, index updates; list/clean
  commands.py    build units and the exact compiler commands per target
  toolchains.py  finding xcrun/metal, nvcc, the C++ compiler; identities hashed into keys; fixes
  symbols.py     entry-symbol checks on cubin/PTX/.so/metallib
  locking.py     fcntl file locks with a timeout
  selftest.py    `selftest`: compile for this device, the kernels' parity cases (registry/parity.py), the
                 drop-in cache against mlx-lm's own; the report
  registry/artifacts.py (shared with the runtime) digests, keys, the index, lookup()

The public names below load lazily so `import build_tools.cli` stays cheap (no registry, no MLX).
"""

from __future__ import annotations

_EXPORTS = {
    "compile_kernels": "compiler", "CompileReport": "compiler", "UnitResult": "compiler",
    "BuildError": "compiler", "MissingToolchainError": "compiler", "LockTimeoutError": "locking",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'build_tools' has no attribute {name!r}")
