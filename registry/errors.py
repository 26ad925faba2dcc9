"""Every exception the package raises on purpose. Each message names the file, field or argument
at fault, what was expected, and where there is one, the command that fixes it."""

from __future__ import annotations


class MlxAotError(Exception):
    """Base class of every mlx-aot-kernels error."""


class ManifestError(MlxAotError, ValueError):
    """kernels.yaml (or another manifest) is malformed. Holds every problem found, not just the first."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class EnvError(MlxAotError, ValueError):
    """An environment variable holds a value outside its documented set."""


class KernelArgumentError(MlxAotError, ValueError):
    """A kernel was called with arguments of the wrong shape, dtype, layout or range."""


class ArtifactError(MlxAotError, RuntimeError):
    """An AOT artifact is missing, stale or corrupt and the caller asked for it explicitly."""


class NativeUnavailableError(MlxAotError, RuntimeError):
    """The native extension (registry._ext) is not built or not importable."""
