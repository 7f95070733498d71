"""A safe arithmetic evaluator, exposed as a TRL tool (`tools=[calculator]`).

Model-written expressions are untrusted. They are parsed with `ast` in "eval" mode and walked by a small interpreter
that knows only numeric literals, unary minus/plus, + - * / // % and a bounded **; nothing is ever passed to `eval` or
`exec`. Every resource an expression could blow up is bounded before or during evaluation: the text length (checked
before parsing, so a megabyte string costs nothing), the nesting depth (checked by counting brackets before parsing,
since `ast.parse` itself recurses), the exponent, and the magnitude of every intermediate result. Bad input yields a
short "error: ..." text instead of an exception, so the model sees the failure in the tool response.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 20
MAX_EXPONENT = 8
MAX_POWER_BASE = 10_000
MAX_MAGNITUDE = 1e15

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


def _check(value: float) -> float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not finite")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result too large")
    return value


def _eval(node: ast.AST, depth: int) -> float:
    if depth > MAX_DEPTH:
        raise CalculatorError("expression nested too deeply")
    if isinstance(node, ast.Expression):
        return _eval(node.body, depth + 1)
    # bool is an int subclass; "True" is a name, not arithmetic.
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval(node.left, depth + 1)
        right = _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_POWER_BASE):
            raise CalculatorError(f"power too large (|exponent| <= {MAX_EXPONENT}, |base| <= {MAX_POWER_BASE})")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        try:
            result = _BINARY[type(node.op)](left, right)
        except (OverflowError, ArithmeticError) as exc:
            raise CalculatorError(str(exc)) from None
        if isinstance(result, complex):
            raise CalculatorError("complex result")
        return _check(result)
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def _format(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


def evaluate(expression: str) -> str:
    """Evaluate `expression` and return the result as text; raise `CalculatorError` on refused or bad input."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    # ast.parse recurses per bracket level; refuse deep nesting before the parser sees it.
    depth = max_depth = 0
    for char in expression:
        if char in "([{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif char in ")]}":
            depth -= 1
    if max_depth > MAX_DEPTH:
        raise CalculatorError("expression nested too deeply")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("invalid expression") from None
    return _format(_eval(tree, 0))


def calculator(expression: str) -> str:
    """
    Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 12*34.
    """
    try:
        return evaluate(expression)
    except CalculatorError as exc:
        return f"error: {exc}"
