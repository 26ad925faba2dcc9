"""Ahead-of-time builds of the kernels declared in kernels.yaml (`python -m build_tools`)."""

from .compiler import (BuildError, CompileReport, LockTimeoutError, MissingToolchainError, UnitResult,
                       compile_kernels)

__all__ = ["BuildError", "CompileReport", "LockTimeoutError", "MissingToolchainError", "UnitResult",
           "compile_kernels"]
