"""Test cases for code rewards, split so the untrusted side never sees what it is graded against.

A test like ``assert add(1, 2) == 3`` has two halves: the *call* ``add(1, 2)``, which only the
program can evaluate, and the *expected* value ``3``, which decides the score. `parse_tests`
splits every test in the trusted parent; the sandboxed child receives only the calls (or, for
stdin/stdout tests, only the inputs), evaluates them and reports each value; `Check.passes`
compares in the parent. So nothing the score depends on (expected outputs, a nonce, a count of
passed tests) exists in the process that runs the untrusted code: it cannot be read through a
frame, `gc.get_objects()` or memory, and a forged report can only claim values, which the
parent then checks.

Accepted test forms (anything else is refused with a message saying which forms exist):

- ``assert <expr> == <literal>`` (or ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in``,
  ``is``, ``is not``; the literal may be on either side)
- ``assert <expr>`` and ``assert not <expr>`` (the value's truth is checked in the parent)
- ``assert math.isclose(<expr>, <literal>, rel_tol=..., abs_tol=...)`` (``isclose`` too) and
  ``assert abs(<expr> - <literal>) < <literal>``
- ``{"call": "<expr>", "expected": <value>}``, optionally with ``"rel_tol"`` / ``"abs_tol"``
- ``{"stdin": "...", "stdout": "..."}``: the whole program run on that input; its output must
  match line by line (trailing whitespace and trailing blank lines ignored)

Values cross the boundary as Python literal text (``repr`` of plain data) and are read back
with `decode_value`, never unpickled: a returned object with a doctored ``__eq__`` cannot pass.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CallCheck", "IOCheck", "decode_value", "parse_tests"]

_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b, ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
}
_MIRROR = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE, ast.Eq: ast.Eq, ast.NotEq: ast.NotEq}
_FORMS = ("supported tests: 'assert <call> == <literal>' (or another comparison with a literal), "
          "'assert <call>', 'assert not <call>', 'assert math.isclose(<call>, <literal>)', "
          "'assert abs(<call> - <literal>) < <literal>', {'call': ..., 'expected': ...}, "
          "{'stdin': ..., 'stdout': ...}")


@dataclass(frozen=True)
class CallCheck:
    """Evaluate `call` in the program's namespace (child); compare its value (parent).

    Attributes:
        call: the expression the child evaluates, e.g. ``"add(1, 2)"``.
        op: how the value is judged: a comparison name (``"Eq"``, ``"Lt"``, ...), ``"truthy"``,
            ``"falsy"`` or ``"close"``.
        expected: the literal the value is compared with (never sent to the child).
        reverse: the literal was on the left (``3 == add(1, 2)``; matters for ``in``).
        rel_tol: relative tolerance for ``"close"``.
        abs_tol: absolute tolerance for ``"close"``.
        source: the test as written, for messages.
    """

    call: str
    op: str
    expected: Any = None
    reverse: bool = False
    rel_tol: float = 1e-9
    abs_tol: float = 0.0
    source: str = ""

    def passes(self, value: Any) -> bool:
        """Whether the reported (already decoded, plain) value satisfies the test."""
        try:
            if self.op == "truthy":
                return bool(value)
            if self.op == "falsy":
                return not bool(value)
            if self.op == "close":
                return (isinstance(value, (int, float)) and not isinstance(value, bool)
                        and math.isclose(value, self.expected, rel_tol=self.rel_tol, abs_tol=self.abs_tol))
            compare = _COMPARE[getattr(ast, self.op)]
            return bool(compare(self.expected, value) if self.reverse else compare(value, self.expected))
        except (TypeError, ValueError, OverflowError):  # e.g. "a" < 1: the test fails
            return False


@dataclass(frozen=True)
class IOCheck:
    """Run the whole program on `stdin` (child); compare its output with `stdout` (parent).

    Attributes:
        stdin: the input text.
        stdout: the expected output (never sent to the child).
    """

    stdin: str
    stdout: str

    def passes(self, output: Any) -> bool:
        """Line-by-line equality, ignoring trailing whitespace and trailing blank lines."""
        return isinstance(output, str) and _lines(output) == _lines(self.stdout)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _parse_assert(text: str) -> CallCheck:
    try:
        tree = ast.parse(text.strip())
    except SyntaxError as error:
        raise ValueError(f"test {text!r} is not valid Python ({error.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"test {text!r} must be a single assert statement; {_FORMS}")
    test = tree.body[0].test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _COMPARE:
        left_ok, left = _literal(test.left)
        right_ok, right = _literal(test.comparators[0])
        op = type(test.ops[0])
        if right_ok and not left_ok:
            expr = _abs_difference(test.left)
            if expr is not None and op in (ast.Lt, ast.LtE) and isinstance(right, (int, float)):
                call, target = expr
                return CallCheck(call, "close", target, rel_tol=0.0, abs_tol=float(right), source=text)
            return CallCheck(ast.unparse(test.left), op.__name__, right, source=text)
        if left_ok and not right_ok:
            if op in _MIRROR:
                return CallCheck(ast.unparse(test.comparators[0]), _MIRROR[op].__name__, left, source=text)
            return CallCheck(ast.unparse(test.comparators[0]), op.__name__, left, reverse=True, source=text)
        raise ValueError(f"test {text!r} compares two expressions; one side must be a literal. {_FORMS}")
    close = _isclose(test)
    if close is not None:
        return CallCheck(*close, source=text)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return CallCheck(ast.unparse(test.operand), "falsy", source=text)
    return CallCheck(ast.unparse(test), "truthy", source=text)


def _abs_difference(node: ast.AST) -> tuple[str, float] | None:
    """`abs(<expr> - <literal>)` -> (expr, literal), else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "abs"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.BinOp)
            and isinstance(node.args[0].op, ast.Sub)):
        return None
    inner = node.args[0]
    for expr, lit in ((inner.left, inner.right), (inner.right, inner.left)):
        ok, value = _literal(lit)
        if ok and isinstance(value, (int, float)) and not _literal(expr)[0]:
            return ast.unparse(expr), float(value)
    return None


def _isclose(test: ast.AST) -> tuple | None:
    """`[math.]isclose(<expr>, <literal>, rel_tol=.., abs_tol=..)` -> CallCheck fields."""
    if not isinstance(test, ast.Call) or len(test.args) != 2:
        return None
    func = test.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "isclose":
        return None
    tolerances = {"rel_tol": 1e-9, "abs_tol": 0.0}
    for keyword in test.keywords:
        ok, value = _literal(keyword.value)
        if keyword.arg not in tolerances or not ok:
            return None
        tolerances[keyword.arg] = float(value)
    for expr, lit in ((test.args[0], test.args[1]), (test.args[1], test.args[0])):
        ok, value = _literal(lit)
        if ok and isinstance(value, (int, float)) and not _literal(expr)[0]:
            return ast.unparse(expr), "close", float(value), False, tolerances["rel_tol"], tolerances["abs_tol"]
    return None


def parse_tests(tests: str | Sequence[Any] | None) -> list[CallCheck | IOCheck]:
    """Splits tests into what the sandbox evaluates and what the parent compares.

    Args:
        tests: one test, or a sequence of tests, in the forms of the module docstring.

    Returns:
        One `CallCheck` or `IOCheck` per test, in order.

    Raises:
        ValueError: a test in none of the accepted forms (the message lists them).
    """
    if tests is None:
        return []
    items = [tests] if isinstance(tests, (str, Mapping)) else list(tests)
    checks: list[CallCheck | IOCheck] = []
    for item in items:
        if isinstance(item, str):
            checks.append(_parse_assert(item))
        elif isinstance(item, Mapping) and set(item) == {"stdin", "stdout"}:
            if not (isinstance(item["stdin"], str) and isinstance(item["stdout"], str)):
                raise ValueError(f"test {dict(item)!r}: stdin and stdout must be strings")
            checks.append(IOCheck(item["stdin"], item["stdout"]))
        elif isinstance(item, Mapping) and {"call", "expected"} <= set(item) <= {"call", "expected", "rel_tol", "abs_tol"}:
            call = str(item["call"])
            try:
                ast.parse(call, mode="eval")
            except SyntaxError:
                raise ValueError(f"test {dict(item)!r}: call {call!r} is not a Python expression") from None
            if "rel_tol" in item or "abs_tol" in item:
                checks.append(CallCheck(call, "close", float(item["expected"]), rel_tol=float(item.get("rel_tol", 1e-9)),
                                        abs_tol=float(item.get("abs_tol", 0.0)), source=repr(dict(item))))
            else:
                checks.append(CallCheck(call, "Eq", item["expected"], source=repr(dict(item))))
        else:
            raise ValueError(f"test {item!r} is in no accepted form; {_FORMS}")
    return checks


class _SpecialFloats(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in ("inf", "nan"):
            return ast.Constant(float(node.id))
        raise ValueError(f"name {node.id!r} in a reported value")


def decode_value(text: str) -> tuple[bool, Any]:
    """Reads a value the child reported (the ``repr`` of plain data) without executing it.

    Args:
        text: the reported text.

    Returns:
        ``(True, value)`` for a Python literal (``inf`` and ``nan`` allowed), else
        ``(False, None)``.
    """
    if not isinstance(text, str):
        return False, None
    try:
        tree = ast.parse(text, mode="eval")
        return True, ast.literal_eval(_SpecialFloats().visit(tree).body)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
