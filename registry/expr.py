"""Requirement expressions of kernels.yaml (`requires`, `prefer`), evaluated without eval/exec.

An expression is parsed with `ast` and checked against a whitelist once, at manifest load time:
names from CONTEXT_NAMES, attribute access on `rope` (fields of RopeConfig only), comparisons
(including `in`, `not in`, `is None`, `is not None`), and/or/not, + - * / // %, and literals
(numbers, strings, booleans, None, tuples/lists of literals). Calls, subscripts, comprehensions,
lambdas, imports and any name or attribute outside the whitelist are rejected with the reason.

Size limits keep hostile text from exhausting time or memory: the text, its node count and depth,
every literal, and every value computed at selection time are bounded (LIMITS below); arithmetic
only ever combines numbers (no string or sequence repetition, concatenation or %-formatting).
"""

from __future__ import annotations

import ast
import operator
import string
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

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
    "attention_sinks": "True when the attention adds learned sink logits (a `sinks` parameter, e.g. gpt-oss)",
    "alibi": "True when the attention adds ALiBi position biases (an `alibi`/`alibi_slopes` attribute)",
    "kv_bits": "the KV cache's quantization: None (float rows), 4 or 8 bits (mlx-lm's QuantizedKVCache format)",
    "kv_group_size": "the quantized cache's group size (32, 64 or 128), or None for float rows",
    "kv_scales_dtype": "the quantized cache's scales/biases dtype name ('float16', 'bfloat16', 'float32'), or None",
}
ATTRIBUTES: dict[str, frozenset[str]] = {
    "rope": frozenset(f.name for f in fields(RopeConfig)) | {"has_periods"},
    "qk_norm": frozenset(f.name for f in fields(NormConfig)),
}

_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
           ast.Is: operator.is_, ast.IsNot: operator.is_not}


class ExprError(ValueError):
    pass


# Bounds on one expression (documented in docs/manifest.md, "Limits").
MAX_TEXT = 2000          # characters of the expression or of its reason template
MAX_NODES = 200          # AST nodes
MAX_DEPTH = 32           # AST nesting
MAX_INT = 2**63          # |integer| of a literal or of any computed value
MAX_STR = 256            # characters of a string literal
MAX_ITEMS = 64           # elements of a tuple/list literal


class _Bound(ArithmeticError):
    """A value computed at selection time left the bounds: the requirement does not hold."""


def _num(value: Any) -> bool:
    return isinstance(value, (int, float))   # bool is an int: True + 1 is fine


def _arith(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def apply(a: Any, b: Any) -> Any:
        if not (_num(a) and _num(b)):
            raise TypeError("arithmetic is only defined on numbers here")
        r = op(a, b)
        if isinstance(r, int) and abs(r) > MAX_INT:
            raise _Bound(f"|{op.__name__} result| exceeds 2**63")
        return r
    return apply


_BINOPS = {t: _arith(f) for t, f in (
    (ast.Add, operator.add), (ast.Sub, operator.sub), (ast.Mult, operator.mul),
    (ast.Div, operator.truediv), (ast.FloorDiv, operator.floordiv), (ast.Mod, operator.mod))}


@dataclass(frozen=True)
class Requirement:
    """One compiled requirement: the expression text, its checked AST and the reason template."""
    text: str
    tree: ast.Expression
    reason: str

    def holds(self, ctx: Mapping[str, Any]) -> bool:
        try:
            return bool(_eval(self.tree.body, ctx))
        except (TypeError, AttributeError, ArithmeticError):
            # e.g. `rope.rotary_dims` while rope is None, or a result beyond the bounds: the
            # requirement does not hold (ArithmeticError covers ZeroDivision, Overflow and _Bound).
            return False

    def explain(self, ctx: Mapping[str, Any]) -> str:
        values = {name: ctx.get(name) for name in _placeholders(self.reason)}
        return self.reason.format_map(values) if self.reason else f"requirement `{self.text}` is false"


def _placeholders(template: str) -> list[str]:
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:   # a lone '{' or '}'
        raise ExprError(f"reason {_short(template)} is not a valid template ({e}); write a literal "
                        f"brace as '{{{{' or '}}}}'") from None
    for _, field, spec, conv in parsed:
        if field is None:
            continue
        if field not in CONTEXT_NAMES or spec or conv:
            raise ExprError(f"reason placeholder {{{_short(field, 40)[1:-1]}}} must be a plain context name "
                            f"({', '.join(CONTEXT_NAMES)})")
        names.append(field)
    return names


def compile_requirement(text: str, reason: str = "") -> Requirement:
    """Parse and whitelist-check `text`; raise ExprError saying what is not allowed."""
    for what, value in (("expression", text), ("reason", reason)):
        if len(value) > MAX_TEXT:
            raise ExprError(f"the {what} is {len(value)} characters; the limit is {MAX_TEXT}")
        if "\0" in value:
            raise ExprError(f"the {what} contains a NUL byte")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ExprError(f"not a valid expression ({e.msg})") from None
    except (RecursionError, MemoryError, ValueError):   # nesting beyond the parser's own limits
        raise ExprError(f"the expression nests too deeply (limit: depth {MAX_DEPTH})") from None
    nodes = 0
    for _ in ast.walk(tree.body):   # iterative: bounded work before the recursive check
        nodes += 1
        if nodes > MAX_NODES:
            raise ExprError(f"the expression has more than {MAX_NODES} nodes; split it into several requirements")
    _check(tree.body, 0)
    _placeholders(reason)
    return Requirement(text=text, tree=tree, reason=reason)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit]) + "..."
    return text if len(text) <= limit + 8 else text[:limit] + "..."


def _sequence_literal(node: ast.AST) -> bool:
    return isinstance(node, (ast.Tuple, ast.List)) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str))


def _check(node: ast.AST, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ExprError(f"the expression nests deeper than {MAX_DEPTH} levels")
    depth += 1
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _check(v, depth)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        _check(node.operand, depth)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        if _sequence_literal(node.left) or _sequence_literal(node.right):
            raise ExprError("arithmetic on strings, tuples or lists (repetition, concatenation, "
                            "%-formatting) is not allowed")
        _check(node.left, depth)
        _check(node.right, depth)
    elif isinstance(node, ast.Compare):
        for op in node.ops:
            if type(op) not in _CMPOPS:
                raise ExprError(f"comparison {type(op).__name__} is not allowed")
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Is, ast.IsNot)) and not (
                    isinstance(right, ast.Constant) and right.value is None):
                raise ExprError("`is` / `is not` may only compare with None")
        _check(node.left, depth)
        for c in node.comparators:
            _check(c, depth)
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
        value = node.value
        if not isinstance(value, (int, float, str, bool, type(None))):
            raise ExprError(f"literal {_short(value)} is not allowed")
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise ExprError(f"integer literal {_short(value)} exceeds 2**63")
        if isinstance(value, str) and len(value) > MAX_STR:
            raise ExprError(f"string literal {_short(value)} is longer than {MAX_STR} characters")
    elif isinstance(node, (ast.Tuple, ast.List)):
        if len(node.elts) > MAX_ITEMS:
            raise ExprError(f"a tuple or list literal may hold at most {MAX_ITEMS} items")
        for e in node.elts:
            if not isinstance(e, ast.Constant):
                raise ExprError("tuples and lists may only hold literals")
            _check(e, depth)
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
        if isinstance(node.op, ast.Not):
            return not value
        if not _num(value):
            raise TypeError("unary minus is only defined on numbers")
        return -value
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
