"""Python side of the generic AOT launcher (csrc/). Placeholder until the extension lands:
every kernel runs its reference path."""

from __future__ import annotations


def load_launcher(spec, backend):
    return None, "native extension registry._ext is not built yet"
