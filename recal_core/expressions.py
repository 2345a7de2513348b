"""SparseML's ``eval(...)`` values: arithmetic over a recipe's top-level variables.

SparseML recipes write ``end_epoch: eval(num_epochs - 5)``. SparseML ran Python's
``eval``; recal evaluates only numbers, lists, variable names, ``+ - * / // % **``,
unary signs, parentheses and ``min``/``max``/``round``/``int``/``float`` — nothing
that can reach the interpreter.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any, Callable, Mapping

_EVAL = re.compile(r"^\s*eval\((.*)\)\s*$", re.DOTALL)

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "min": min, "max": max, "round": round, "int": int, "float": float, "abs": abs,
}


# Limits: an expression computes a recipe value, never a large object (no "10**10**10", no "x" * 10**10).
MAX_INT = 2**63
MAX_LENGTH = 10_000  # of a string or list result
MAX_EXPONENT = 64


class ExpressionError(ValueError):
    """An ``eval(...)`` value that cannot be computed; the message says why."""


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and _EVAL.match(value) is not None


def evaluate(value: str, variables: Mapping[str, Any]) -> Any:
    """Evaluate ``eval(<expr>)`` with ``variables``; raise :class:`ExpressionError` if it cannot.

    >>> evaluate("eval(a * 2 + 1)", {"a": 3})
    7
    """
    match = _EVAL.match(value)
    if match is None:
        raise ExpressionError(f"not an eval(...) expression: {value!r}")
    source = match.group(1).strip()
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"invalid expression {source!r}: {exc.msg}") from None
    result = _eval_node(tree.body, variables, source)
    if isinstance(result, float) and not math.isfinite(result):
        raise ExpressionError(f"{source!r} is not a finite number")
    return result


def _eval_node(node: ast.AST, variables: Mapping[str, Any], source: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) \
            and not isinstance(node.value, bool):
        return _bounded(node.value, source)
    if isinstance(node, ast.Name):
        if node.id not in variables:
            known = ", ".join(sorted(variables)) or "none"
            raise ExpressionError(f"{source!r} uses the undefined variable {node.id!r}"
                                  f" (top-level variables: {known})")
        return variables[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return _bounded([_eval_node(e, variables, source) for e in node.elts], source)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval_node(node.left, variables, source)
        right = _eval_node(node.right, variables, source)
        _check_operands(node.op, left, right, source)
        try:
            result = _BINARY[type(node.op)](left, right)
        except (TypeError, ZeroDivisionError, OverflowError, ValueError) as exc:
            raise ExpressionError(f"{source!r} cannot be computed: {exc}") from None
        return _bounded(result, source)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        operand = _eval_node(node.operand, variables, source)
        try:
            result = _UNARY[type(node.op)](operand)
        except TypeError as exc:
            raise ExpressionError(f"{source!r} cannot be computed: {exc}") from None
        return _bounded(result, source)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        args = [_eval_node(a, variables, source) for a in node.args]
        if node.func.id == "round" and len(args) > 1 and isinstance(args[1], int) and abs(args[1]) > 32:
            raise ExpressionError(f"{source!r}: round() to more than 32 digits")
        try:
            result = _FUNCTIONS[node.func.id](*args)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ExpressionError(f"{source!r} cannot be computed: {exc}") from None
        return _bounded(result, source)
    raise ExpressionError(
        f"{source!r} uses {type(node).__name__}, which recipes do not allow"
        " (numbers, variables, lists, + - * / // % **, min/max/round/int/float/abs only)")


def _check_operands(op: ast.operator, left: Any, right: Any, source: str) -> None:
    """Refuse, before computing, what would make a huge result: big exponents, long repetitions."""
    if isinstance(op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
        raise ExpressionError(f"{source!r}: exponent {right:g} is beyond the limit of {MAX_EXPONENT}")
    if isinstance(op, ast.Mult):
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list)) and isinstance(times, int) and len(seq) * max(times, 0) > MAX_LENGTH:
                raise ExpressionError(f"{source!r}: the result would hold more than {MAX_LENGTH:,} items")


def _bounded(value: Any, source: str) -> Any:
    """``value`` if it is a recipe-sized value: an int below 2**63, a finite float, a short string or list."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and abs(value) >= MAX_INT:
        raise ExpressionError(f"{source!r}: an intermediate value has {len(str(abs(value)))} digits, beyond "
                              f"recal's limit of 2**63")
    if isinstance(value, float) and not math.isfinite(value):
        raise ExpressionError(f"{source!r}: an intermediate value is not a finite number")
    if isinstance(value, (str, list)) and len(value) > MAX_LENGTH:
        raise ExpressionError(f"{source!r}: an intermediate value holds more than {MAX_LENGTH:,} items")
    return value


def _names_used(value: str) -> set[str]:
    match = _EVAL.match(value)
    try:
        tree = ast.parse(match.group(1).strip() if match else "", mode="eval")
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def resolve_variables(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Evaluate top-level variables that are themselves ``eval(...)``, in dependency order.

    Returns the resolved values and, for each variable that failed, the reason.
    """
    resolved: dict[str, Any] = {k: v for k, v in raw.items() if not is_expression(v)}
    pending = {k: v for k, v in raw.items() if is_expression(v)}
    failures: dict[str, str] = {}
    while pending:
        ready = [k for k, v in pending.items() if not (_names_used(v) & (pending.keys() - {k}))]
        if not ready:
            for name, expr in pending.items():
                failures[name] = f"{expr!r} depends on itself through other variables"
            break
        for name in ready:
            try:
                resolved[name] = evaluate(pending.pop(name), resolved)
            except ExpressionError as exc:
                failures[name] = str(exc)
    return resolved, failures
