"""The symbolic-shape grammar and the JSON depth scan (``saved/checks/bounded_text.py``)."""

from __future__ import annotations

from quantree.backends.cpu.saved.checks.bounded_text import (
    guard_bounded,
    json_depth,
    shape_expression_ok,
)


def test_the_grammar_accepts_what_torch_prints_and_nothing_that_evaluates() -> None:
    printed = ["s0", "8*s0 + 1", "Max(1, s77)", "(s0//2)", "Mod(s0, 2)", "Eq(u2, u1)",
               "s0**2", "Add(Mul(Integer(8), Symbol('s0')), Integer(1))", "1/s0", "s0 >= 2",
               "Piecewise((s0, Eq(s0, 1)), (1, True))", "-s0 + 3", "int_oo"]  # fmt: skip
    evaluating = ["s0 + 0*9**9**9", "9**9", "PowByNatural(9, 9)", "LShift(1, 99999999)",
                  "__import__('os')", "s0.__class__", "(" * 40 + "s0" + ")" * 40,
                  "1" * 30, "s0 ** 100", "Float('1' * 9999)"]  # fmt: skip
    assert all(shape_expression_ok(t) for t in printed)
    assert not any(shape_expression_ok(t) for t in evaluating)
    assert guard_bounded("L['x'].size()[0] == 6")
    assert not guard_bounded("L['x'].size()[0] ** 9**9 == 6")
    assert not guard_bounded("9**9**9 == 1")
    assert json_depth(b'{"a": "[[[[", "b": [[1], {"c": []}]}') == 4
