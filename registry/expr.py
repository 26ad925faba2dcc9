"""Requirement expressions of kernels.yaml (`requires`, `prefer`), evaluated without eval/exec.

An expression is parsed with `ast` and checked against a whitelist once, at manifest load time:
names from CONTEXT_NAMES, attribute access on `rope` (fields of RopeConfig only), comparisons
(including `in`, `not in`, `is None`, `is not None`), and/or/not, + - * / // %, and literals
(numbers, strings, booleans, None, tuples/lists of literals). Calls, subscripts, comprehensions,
lambdas, imports and any name or attribute outside the whitelist are rejected with the reason.
"""

from __future__ import annotations

import ast
import operator
import string
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .norm import NormConfig
from .rope import RopeConfig

# The documented selection context (docs/manifest.md): name -> what it holds.
CONTEXT_NAMES: dict[str, str] = {
    "attention": "layout of the attention module: 'mha' (per-head K/V, incl. GQA/MQA), 'mla', or 'unknown'",
    "rope": "the normalised RoPE config (RopeConfig) or None when the module's RoPE is unsupported",
    "rope_error": "why `rope` is None ('' when it is not)",
    "n_heads": "number of query heads",
    "n_kv_heads": "number of key/value heads",
    "head_dim": "per-head feature size",
    "dtype": "compute dtype name ('float16', 'bfloat16', 'float32') or None when unknown",
    "backend": "'cpu', 'cuda' or 'metal': where the kernel will run",
    "applies_rope": "True when the layer rotates q/k through its rope module, False when it applies no RoPE "
                    "(traced: NoPE layers, including ones that own an unused rope module), None when unknown",
    "qk_norm": "the per-head q/k RMSNorm (NormConfig: eps, weight_offset, source) that feeds the RoPE, or None",
    "qk_norm_error": "why `qk_norm` is None",
}
ATTRIBUTES: dict[str, frozenset[str]] = {
    "rope": frozenset(f.name for f in fields(RopeConfig)) | {"has_periods"},
    "qk_norm": frozenset(f.name for f in fields(NormConfig)),
}

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
           ast.Is: operator.is_, ast.IsNot: operator.is_not}


class ExprError(ValueError):
    pass


@dataclass(frozen=True)
class Requirement:
    """One compiled requirement: the expression text, its checked AST and the reason template."""
    text: str
    tree: ast.Expression
    reason: str

    def holds(self, ctx: Mapping[str, Any]) -> bool:
        try:
            return bool(_eval(self.tree.body, ctx))
        except (TypeError, AttributeError, ZeroDivisionError):
            # e.g. `rope.rotary_dims` while rope is None: the requirement does not hold.
            return False

    def explain(self, ctx: Mapping[str, Any]) -> str:
        values = {name: ctx.get(name) for name in _placeholders(self.reason)}
        return self.reason.format_map(values) if self.reason else f"requirement `{self.text}` is false"


def _placeholders(template: str) -> list[str]:
    names = []
    for _, field, spec, conv in string.Formatter().parse(template):
        if field is None:
            continue
        if field not in CONTEXT_NAMES or spec or conv:
            raise ExprError(f"reason placeholder {{{field}}} must be a plain context name "
                            f"({', '.join(CONTEXT_NAMES)})")
        names.append(field)
    return names


def compile_requirement(text: str, reason: str = "") -> Requirement:
    """Parse and whitelist-check `text`; raise ExprError saying what is not allowed."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ExprError(f"not a valid expression ({e.msg})") from None
    _check(tree.body)
    _placeholders(reason)
    return Requirement(text=text, tree=tree, reason=reason)


def _check(node: ast.AST) -> None:
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _check(v)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        _check(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _check(node.left)
        _check(node.right)
    elif isinstance(node, ast.Compare):
        for op in node.ops:
            if type(op) not in _CMPOPS:
                raise ExprError(f"comparison {type(op).__name__} is not allowed")
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Is, ast.IsNot)) and not (
                    isinstance(right, ast.Constant) and right.value is None):
                raise ExprError("`is` / `is not` may only compare with None")
        _check(node.left)
        for c in node.comparators:
            _check(c)
    elif isinstance(node, ast.Name):
        if node.id not in CONTEXT_NAMES:
            raise ExprError(f"unknown name {node.id!r}; known names: {', '.join(CONTEXT_NAMES)}")
    elif isinstance(node, ast.Attribute):
        if not isinstance(node.value, ast.Name) or node.value.id not in ATTRIBUTES:
            raise ExprError(f"attribute access is only allowed on {', '.join(ATTRIBUTES)}")
        if node.attr not in ATTRIBUTES[node.value.id]:
            raise ExprError(f"unknown attribute {node.value.id}.{node.attr}; known: "
                            f"{', '.join(sorted(ATTRIBUTES[node.value.id]))}")
    elif isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str, bool, type(None))):
            raise ExprError(f"literal {node.value!r} is not allowed")
    elif isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            if not isinstance(e, ast.Constant):
                raise ExprError("tuples and lists may only hold literals")
            _check(e)
    elif isinstance(node, ast.Call):
        raise ExprError("function calls are not allowed")
    else:
        raise ExprError(f"{type(node).__name__} is not allowed in a requirement")


def _eval(node: ast.AST, ctx: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            return all(_eval(v, ctx) for v in node.values)
        return any(_eval(v, ctx) for v in node.values)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand, ctx)
        return (not value) if isinstance(node.op, ast.Not) else -value
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, ctx), _eval(node.right, ctx))
    if isinstance(node, ast.Compare):
        left = _eval(node.left, ctx)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, ctx)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Name):
        return ctx[node.id]
    if isinstance(node, ast.Attribute):
        base = _eval(node.value, ctx)
        if base is None:
            raise AttributeError(node.attr)
        return getattr(base, node.attr)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_eval(e, ctx) for e in node.elts)
    raise ExprError(f"{type(node).__name__} is not allowed")  # unreachable after _check
