"""Wrapper and check hooks for the toy manifests of tests/test_registry.py and test_manifest.py."""


class ToyKernel:
    implementation = "reference"
    reason = "toy"

    def __init__(self, spec, ctx):
        self.spec, self.ctx = spec, ctx


def build(spec, ctx):
    return ToyKernel(spec, ctx)


def check_small_heads(spec, ctx):
    return (ctx.head_dim <= 64, f"head_dim={ctx.head_dim} > 64 (toy check)")


def check_without_reason(spec, ctx):
    return False
