"""Requirement expressions: a whitelist, never eval."""

from __future__ import annotations

import pytest

from registry.expr import ExprError, compile_requirement
from registry.rope import RopeConfig

CTX = dict(attention="mha", rope=RopeConfig(64), rope_error="", n_heads=32, n_kv_heads=8, head_dim=128,
           dtype="bfloat16", backend="cuda")


@pytest.mark.parametrize("text, expected", [
    ("head_dim % 2 == 0", True),
    ("head_dim <= 256 and n_heads % n_kv_heads == 0", True),
    ("not (backend == 'cpu')", True),
    ("dtype in ('float16', 'bfloat16')", True),
    ("dtype not in ['float32']", True),
    ("rope is not None and rope.rotary_dims < head_dim", True),
    ("rope.traditional", False),
    ("rope.has_periods or rope.base > 1000", True),
    ("1 < n_kv_heads < 8", False),
    ("-head_dim < 0", True),
    ("n_heads // n_kv_heads == 4", True),
])
def test_evaluates(text, expected):
    assert compile_requirement(text).holds(CTX) is expected


def test_attribute_of_none_is_false_not_crash():
    req = compile_requirement("rope.rotary_dims == 64")
    assert req.holds(dict(CTX, rope=None)) is False


@pytest.mark.parametrize("text, message", [
    ("__import__('os').system('true')", "function calls are not allowed"),
    ("open('/etc/passwd')", "function calls are not allowed"),
    ("rope.__class__", "unknown attribute rope.__class__"),
    ("rope._replace", "unknown attribute"),
    ("backend.upper", "attribute access is only allowed on rope"),
    ("(lambda: 1)", "Lambda is not allowed"),
    ("[x for x in (1,)]", "ListComp is not allowed"),
    ("CTX", "unknown name 'CTX'"),
    ("__builtins__", "unknown name '__builtins__'"),
    ("dtype[0] == 'b'", "Subscript is not allowed"),
    ("head_dim is 128", "`is` / `is not` may only compare with None"),
    ("head_dim ** 2", "BinOp"),
    ("x := 1", "not a valid expression"),
    ("import os", "not a valid expression"),
    ("dtype in (n_heads, 1)", "tuples and lists may only hold literals"),
    ("f'{head_dim}'", "JoinedStr is not allowed"),
])
def test_rejects_unsafe_or_unknown(text, message):
    with pytest.raises(ExprError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        compile_requirement(text)


def test_reason_formats_context_values():
    req = compile_requirement("head_dim <= 64", "head_dim={head_dim} on {backend}")
    assert not req.holds(CTX)
    assert req.explain(CTX) == "head_dim=128 on cuda"
    assert compile_requirement("head_dim <= 64").explain(CTX) == "requirement `head_dim <= 64` is false"
