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
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from .errors import BudgetSpentError, ExpressionError

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


# Limits: an expression computes a recipe value, never a large object (no "10**10**10", no "x" * 10**10), and a
# recipe's expressions together do bounded work, all checked before the work is done.
MAX_INT = 2**63
MAX_LENGTH = 10_000  # of a string or list result, and of a %-format's width or precision
MAX_EXPONENT = 64
MAX_SOURCE = 10_000  # characters of one expression
MAX_NESTING = 100  # operations inside operations
MAX_RECIPE_WORK = 5_000_000  # operations plus the items they build, over all of one recipe's expressions
_FORMAT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?")


@dataclass
class ExpressionBudget:
    """The work one recipe's expressions may do together (:data:`MAX_RECIPE_WORK`): an operation costs one,
    plus the items of the string or list it builds. One budget per recipe, not per expression."""

    left: int = MAX_RECIPE_WORK

    def spend(self, units: int, source: str) -> None:
        self.left -= units
        if self.left < 0:
            raise BudgetSpentError(f"{source}: the recipe's eval() values together take more than "
                              f"{MAX_RECIPE_WORK:,} operations", first=self.left + units >= 0)


def reported(exc: ExpressionError) -> bool:
    """Whether ``exc`` is worth a problem of its own: every error but a budget already reported as spent."""
    return not isinstance(exc, BudgetSpentError) or exc.first


def _shown(source: str) -> str:
    """``source`` as messages quote it: at most 60 characters."""
    return repr(source) if len(source) <= 60 else repr(source[:40] + " ... " + source[-15:])


def is_expression(value: Any) -> bool:
    return isinstance(value, str) and _EVAL.match(value) is not None


def evaluate(value: str, variables: Mapping[str, Any], budget: ExpressionBudget | None = None) -> Any:
    """Evaluate ``eval(<expr>)`` with ``variables``; raise :class:`ExpressionError` if it cannot.

    Args:
        value: the recipe's text, ``eval(...)``.
        variables: the recipe's resolved top-level variables.
        budget: the work left to the recipe's expressions (a fresh :class:`ExpressionBudget` when None).

    >>> evaluate("eval(a * 2 + 1)", {"a": 3})
    7
    """
    match = _EVAL.match(value)
    if match is None:
        raise ExpressionError(f"not an eval(...) expression: {_shown(value)}")
    source = match.group(1).strip()
    shown = _shown(source)
    if len(source) > MAX_SOURCE:
        raise ExpressionError(f"{shown}: the expression is {len(source):,} characters long; expected at most "
                              f"{MAX_SOURCE:,}")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"invalid expression {shown}: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise ExpressionError(f"{shown}: nested more than {MAX_NESTING} operations deep") from None
    _check_nesting(tree.body, shown)
    result = _eval_node(tree.body, variables, shown, budget or ExpressionBudget())
    if isinstance(result, float) and not math.isfinite(result):
        raise ExpressionError(f"{shown} is not a finite number")
    return result


def _check_nesting(root: ast.AST, source: str) -> None:
    """Refuse, without recursing, an expression nested deeper than :data:`MAX_NESTING`."""
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ExpressionError(f"{source}: nested more than {MAX_NESTING} operations deep")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval_node(node: ast.AST, variables: Mapping[str, Any], source: str, budget: ExpressionBudget) -> Any:
    budget.spend(1, source)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)) \
            and not isinstance(node.value, bool):
        return _bounded(node.value, source, budget)
    if isinstance(node, ast.Name):
        if node.id not in variables:
            known = ", ".join(sorted(variables)) or "none"
            raise ExpressionError(f"{source} uses the undefined variable {node.id!r}"
                                  f" (top-level variables: {known})")
        return variables[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return _bounded([_eval_node(e, variables, source, budget) for e in node.elts], source, budget)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval_node(node.left, variables, source, budget)
        right = _eval_node(node.right, variables, source, budget)
        _check_operands(node.op, left, right, source)
        try:
            result = _BINARY[type(node.op)](left, right)
        except (TypeError, ZeroDivisionError, OverflowError, ValueError) as exc:
            raise ExpressionError(f"{source} cannot be computed: {exc}") from None
        return _bounded(result, source, budget)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        operand = _eval_node(node.operand, variables, source, budget)
        try:
            result = _UNARY[type(node.op)](operand)
        except TypeError as exc:
            raise ExpressionError(f"{source} cannot be computed: {exc}") from None
        return _bounded(result, source, budget)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        args = [_eval_node(a, variables, source, budget) for a in node.args]
        if node.func.id == "round" and len(args) > 1 and isinstance(args[1], int) and abs(args[1]) > 32:
            raise ExpressionError(f"{source}: round() to more than 32 digits")
        try:
            result = _FUNCTIONS[node.func.id](*args)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ExpressionError(f"{source} cannot be computed: {exc}") from None
        return _bounded(result, source, budget)
    raise ExpressionError(
        f"{source} uses {type(node).__name__}, which recipes do not allow"
        " (numbers, variables, lists, + - * / // % **, min/max/round/int/float/abs only)")


def _check_operands(op: ast.operator, left: Any, right: Any, source: str) -> None:
    """Refuse, before computing, what would make a huge result: big exponents, long repetitions."""
    if isinstance(op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
        raise ExpressionError(f"{source}: exponent {right:g} is beyond the limit of {MAX_EXPONENT}")
    if isinstance(op, ast.Mult):
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, list)) and isinstance(times, int) and len(seq) * max(times, 0) > MAX_LENGTH:
                raise ExpressionError(f"{source}: the result would hold more than {MAX_LENGTH:,} items")
    if isinstance(op, ast.Mod) and isinstance(left, str):
        for match in _FORMAT_FIELD.finditer(left.replace("%%", "")):
            for size in match.groups():
                if size == "*":
                    raise ExpressionError(f"{source}: a '*' width or precision in %-formatting")
                if size and int(size) > MAX_LENGTH:
                    raise ExpressionError(f"{source}: a %-format width or precision of {int(size):,}; expected at "
                                          f"most {MAX_LENGTH:,}")


def _bounded(value: Any, source: str, budget: ExpressionBudget) -> Any:
    """``value`` if it is a recipe-sized value: an int below 2**63, a finite float, a short string or list."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and abs(value) >= MAX_INT:
        raise ExpressionError(f"{source}: an intermediate value has {len(str(abs(value)))} digits, beyond "
                              f"recal's limit of 2**63")
    if isinstance(value, float) and not math.isfinite(value):
        raise ExpressionError(f"{source}: an intermediate value is not a finite number")
    if isinstance(value, (str, list)):
        if len(value) > MAX_LENGTH:
            raise ExpressionError(f"{source}: an intermediate value holds more than {MAX_LENGTH:,} items")
        budget.spend(len(value), source)
    return value


def _names_used(value: str) -> set[str]:
    match = _EVAL.match(value)
    source = match.group(1).strip() if match else ""
    if len(source) > MAX_SOURCE:
        return set()  # refused when evaluated
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def resolve_variables(raw: Mapping[str, Any], budget: ExpressionBudget | None = None
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """Evaluate top-level variables that are themselves ``eval(...)``, in dependency order, in linear time.

    Returns the resolved values and, for each variable that failed, the reason.

    Args:
        raw: the recipe's top-level variables as written.
        budget: the work left to the recipe's expressions (a fresh :class:`ExpressionBudget` when None).
    """
    budget = budget or ExpressionBudget()
    resolved: dict[str, Any] = {k: v for k, v in raw.items() if not is_expression(v)}
    pending = {k: v for k, v in raw.items() if is_expression(v)}
    needs = {k: _names_used(v) & (pending.keys() - {k}) for k, v in pending.items()}
    readers: dict[str, list[str]] = {}
    for name, used in needs.items():
        for dep in used:
            readers.setdefault(dep, []).append(name)
    waiting = {name: len(used) for name, used in needs.items()}
    ready = deque(name for name, count in waiting.items() if not count)
    failures: dict[str, str] = {}
    while ready:
        name = ready.popleft()
        try:
            resolved[name] = evaluate(pending.pop(name), resolved, budget)
        except ExpressionError as exc:
            if reported(exc):
                failures[name] = str(exc)
        for reader in readers.get(name, ()):
            waiting[reader] -= 1
            if not waiting[reader]:
                ready.append(reader)
    for name, expr in pending.items():
        if budget.left >= 0:
            failures[name] = f"{_shown(expr)} depends on itself through other variables"
    return resolved, failures
