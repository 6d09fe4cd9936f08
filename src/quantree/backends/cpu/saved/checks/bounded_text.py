"""bounded_text: the text of a saved program parsed within bounds decided before parsing.

``json.loads`` recurses once per nesting level (a document nested 100 000 deep is a
``RecursionError``, and torch's own reader of the same member recurses deeper), and torch
hands every symbolic shape to ``sympy.sympify`` (an ``eval``: ``s0 + 0*9**9**9`` computes a
number of 370 million digits) and ``exec``s the input guards. So a JSON member's size and
depth are measured on its bytes first (strings removed, then the brackets counted, in C),
a symbolic shape must be a sentence of the small grammar below (symbols, bounded integer
literals, ``+ - * / // %``, comparisons, the shape functions sympy prints, and a power only
of an expression holding a symbol, by a small literal), and a guard's Python syntax tree is
held to the same bounds. The grammar is quantree's, not the file's: text outside it is
refused before anything evaluates it.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 128
"""Deepest nesting of a JSON member: torch's program schema nests a few dozen levels."""
MAX_EXPRESSION_CHARS = 4096
"""Longest symbolic shape or input guard (torch prints them as short arithmetic)."""
MAX_EXPRESSION_DEPTH = 32
"""Deepest nesting of calls and parentheses in one expression."""
MAX_LITERAL = 1 << 63
"""Largest integer literal in an expression (a size is an int64)."""
MAX_EXPONENT = 8
"""Largest power in an expression; its base must hold a symbol (no constant towers)."""

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")


def json_depth(data: bytes) -> int:
    """The deepest bracket nesting of the JSON text ``data`` (strings skipped), in linear
    time and without recursion."""
    brackets = np.frombuffer(_STRING.sub(b"", data).translate(None, _BRACKETS), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(data)`` once its depth is known to be at most ``max_depth``; a
    ``ValueError`` (one line) otherwise."""
    depth = json_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep, more than the {max_depth} allowed")
    try:
        return json.loads(data)
    except RecursionError:  # cannot happen below the depth bound: kept as a one-line error
        raise ValueError("JSON nested too deep") from None


SHAPE_FUNCTIONS = frozenset(
    {
        "Max", "Min", "Mod", "PythonMod", "FloorDiv", "CleanDiv", "CeilDiv", "IntTrueDiv",
        "FloatTrueDiv", "ModularIndexing", "floor", "ceiling", "CeilToInt", "FloorToInt",
        "TruncToInt", "TruncToFloat", "RoundToInt", "ToFloat", "Identity", "Abs", "Eq", "Ne",
        "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "LessThan",
        "StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "Piecewise", "ExprCondPair",
        "Where", "IsNonOverlappingAndDenseIndicator", "Integer", "Symbol", "Add", "Mul",
        "RShift", "Rational",
    }
)  # fmt: skip
"""Functions a symbolic shape may call: sympy's and torch's shape functions, none that can
make a large number from small literals (``Pow``, ``PowByNatural``, ``LShift`` are refused;
``**`` has its own rule)."""
_NAMES = frozenset({"oo", "zoo", "nan", "int_oo", "True", "False", "true", "false"})
_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:e[+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<str>'[A-Za-z_]\w*')"
    r"|(?P<op>\*\*|//|<=|>=|==|!=|[-+*/%<>&|~(),=]))"
)
_SYMBOL = re.compile(r"[a-z]+\d+")


class _Refused(Exception):
    pass


class _Parser:
    """Recursive descent over the grammar, depth-bounded; returns whether a subexpression
    holds a symbol (a power's base must)."""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                if text[pos:].strip():
                    raise _Refused
                break
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.at = 0
        self.depth = 0

    def peek(self) -> str:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else ""

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.at >= len(self.tokens) or (expected and self.tokens[self.at][1] != expected):
            raise _Refused
        self.at += 1
        return self.tokens[self.at - 1]

    def expression(self) -> bool:
        self.depth += 1
        if self.depth > MAX_EXPRESSION_DEPTH:
            raise _Refused
        symbolic = self.term()
        while self.peek() in ("+", "-", "*", "/", "//", "%", "<", "<=", ">", ">=", "==",
                              "!=", "&", "|"):  # fmt: skip
            self.take()
            symbolic = self.term() or symbolic
        self.depth -= 1
        return symbolic

    def term(self) -> bool:
        while self.peek() in ("-", "+", "~"):
            self.take()
        symbolic = self.atom()
        if self.peek() == "**":
            self.take()
            if self.peek() == "-":  # s0**(-1) prints as 1/s0, but a negative power is small
                self.take()
            kind, value = self.take()
            if not symbolic or kind != "num" or not value.isdigit() or int(value) > MAX_EXPONENT:
                raise _Refused
        return symbolic

    def atom(self) -> bool:
        kind, value = self.take()
        if kind == "num":
            if len(value) > 24 or (value.isdigit() and int(value) > MAX_LITERAL):
                raise _Refused
            return False
        if value == "(":
            symbolic = self.expression()
            while self.peek() == ",":  # a tuple: Piecewise's (value, condition) pairs
                self.take()
                symbolic = self.expression() or symbolic
            self.take(")")
            return symbolic
        if kind != "name":
            raise _Refused
        if self.peek() != "(":
            if not (_SYMBOL.fullmatch(value) or value in _NAMES):
                raise _Refused
            return value not in _NAMES
        if value not in SHAPE_FUNCTIONS:
            raise _Refused
        self.take("(")
        symbolic = value == "Symbol"
        while self.peek() != ")":
            if self.tokens[self.at][0] == "str":  # Symbol('s0'): sympy's srepr form
                if value != "Symbol" or not _SYMBOL.fullmatch(self.take()[1].strip("'")):
                    raise _Refused
            elif self.at + 1 < len(self.tokens) and self.tokens[self.at + 1][1] == "=":
                self.take()  # Symbol('s0', integer=True)
                self.take("=")
                if self.take()[1] not in ("True", "False"):
                    raise _Refused
            else:
                symbolic = self.expression() or symbolic
            if self.peek() != ")":
                self.take(",")
        self.take(")")
        return symbolic


def shape_expression_ok(text: object) -> bool:
    """``text`` is a sentence of the symbolic-shape grammar within its bounds."""
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION_CHARS:
        return False
    try:
        parser = _Parser(text)
        if not parser.tokens:
            return False
        parser.expression()
        return parser.at == len(parser.tokens)
    except _Refused:
        return False


def _symbolic(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Subscript | ast.Call | ast.Name) for n in ast.walk(node))


def guard_bounded(text: str) -> bool:
    """An input guard's text and tree are within the bounds: short, shallow, integer
    literals of at most int64, and powers only of an expression reading a size, by a small
    literal (checked with the grammar's bounds; ``archive`` checks the names)."""
    brackets = text.replace("(", "[").replace(")", "]").encode()
    if len(text) > MAX_EXPRESSION_CHARS or json_depth(brackets) > MAX_EXPRESSION_DEPTH:
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in ast.walk(tree):
        number = isinstance(node, ast.Constant) and isinstance(node.value, int | float | complex)
        if number and abs(node.value) > MAX_LITERAL:  # type: ignore[attr-defined]
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow | ast.LShift):
            power = node.right.value if isinstance(node.right, ast.Constant) else None
            small = isinstance(power, int) and 0 <= power <= MAX_EXPONENT
            if not (small and _symbolic(node.left)):
                return False
    return True
