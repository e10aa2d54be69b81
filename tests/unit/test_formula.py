"""sluice.formula: safe arithmetic over metric values (never `eval`)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.formula import BinOp, Name, Neg, Num, check_derived, evaluate, names, parse

FAST = settings(max_examples=120, deadline=None, database=None)


def ev(text: str, **values: float | None) -> float | None:
    return evaluate(parse(text), values)


# -- parsing ---------------------------------------------------------------------------------


def test_parse_tree_shape() -> None:
    assert parse("a + b * c") == BinOp("+", Name("a"), BinOp("*", Name("b"), Name("c")))
    assert parse("(a + b) * c") == BinOp("*", BinOp("+", Name("a"), Name("b")), Name("c"))
    assert parse("a - b - c") == BinOp("-", BinOp("-", Name("a"), Name("b")), Name("c"))
    assert parse("-a") == Neg(Name("a"))
    assert parse("- -2") == Neg(Neg(Num(2.0)))
    assert parse("  x  ") == Name("x")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1 + 2 * 3", 7.0),
        ("(1 + 2) * 3", 9.0),
        ("10 - 4 - 3", 3.0),
        ("64 / 4 / 2", 8.0),
        ("2 * 3 + 4 * 5", 26.0),
        ("10 - 2 * 3", 4.0),
        ("-3 + 5", 2.0),
        ("-(3 + 5)", -8.0),
        ("--4", 4.0),
        ("2 * -3", -6.0),
        ("2 - -3", 5.0),
        ("((((7))))", 7.0),
        ("1.5 * 2", 3.0),
        (".5 + 1.", 1.5),
        ("1e3 + 2E-1", 1000.2),
        ("2.5e+1", 25.0),
        ("7 / 2", 3.5),
    ],
)
def test_evaluate_numbers(text: str, value: float) -> None:
    assert ev(text) == pytest.approx(value)


def test_evaluate_names() -> None:
    assert ev("sum / count", sum=10, count=4) == 2.5
    assert ev("a * b + c", a=2, b=3, c=1) == 7.0
    assert ev("-a", a=5) == -5.0
    assert ev("a / b", a=1, b=8) == 0.125
    assert isinstance(ev("a", a=3), float)


@pytest.mark.parametrize("text", ["a / 0", "a / b", "a / (b - b)", "1 / 0 + 5", "a / -0"])
def test_division_by_zero_is_none(text: str) -> None:
    assert ev(text, a=1.0, b=0) is None


@pytest.mark.parametrize("text", ["a", "a + 1", "1 - a", "2 * a", "a / 2", "2 / a", "-a", "(a)"])
def test_none_propagates(text: str) -> None:
    assert ev(text, a=None) is None


def test_zero_numerator_is_fine() -> None:
    assert ev("a / b", a=0, b=5) == 0.0


def test_unknown_name_at_evaluate_is_key_error() -> None:
    with pytest.raises(KeyError):
        ev("a + b", a=1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "formula is empty"),
        ("   ", "formula is empty"),
        ("a +", "formula ends too early"),
        ("a *", "formula ends too early"),
        ("(a", "formula ends too early|missing '\\)'"),
        ("(a b", "missing '\\)'"),
        ("a $ b", "unexpected character '\\$' at position 2"),
        ("a ** b", "unexpected '\\*'"),
        ("a b", "unexpected 'b' after the end of the formula"),
        ("a)", "unexpected '\\)' after the end of the formula"),
        ("+a", "unexpected '\\+'"),
        ("()", "unexpected '\\)'"),
        ("a % b", "unexpected character '%'"),
        ("__import__('os')", 'unexpected character "\'"'),
        ("a.b", "unexpected"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_names_in_first_use_order_without_repeats() -> None:
    assert names(parse("b / a + b * c - -a")) == ["b", "a", "c"]
    assert names(parse("1 + 2")) == []
    assert names(parse("x_1 * 2")) == ["x_1"]


# -- check_derived ---------------------------------------------------------------------------

METRICS: dict[str, Any] = {
    "amount_sum": SimpleNamespace(key=["merchant"]),
    "merchant_txn": SimpleNamespace(key=["merchant"]),
    "txn_count": SimpleNamespace(key=["card"]),
    "pair": SimpleNamespace(key=["card", "merchant"]),
}


def test_check_derived_returns_names() -> None:
    assert check_derived("amount_sum / merchant_txn", METRICS) == ["amount_sum", "merchant_txn"]
    assert check_derived("txn_count * 2", METRICS) == ["txn_count"]


def test_check_derived_unknown_metric() -> None:
    with pytest.raises(ValueError, match=r"unknown metric 'nope' in formula \(known metrics: "):
        check_derived("amount_sum / nope", METRICS)
    with pytest.raises(ValueError, match=r"known metrics: none"):
        check_derived("a", {})


def test_check_derived_keys_must_match() -> None:
    with pytest.raises(ValueError, match=r"must share one key"):
        check_derived("amount_sum / txn_count", METRICS)
    with pytest.raises(ValueError, match=r"must share one key"):
        check_derived("pair + txn_count", METRICS)


def test_check_derived_needs_a_metric() -> None:
    with pytest.raises(ValueError, match=r"formula names no metric"):
        check_derived("1 / 2", METRICS)


def test_check_derived_propagates_parse_errors() -> None:
    with pytest.raises(ValueError, match=r"formula ends too early"):
        check_derived("amount_sum -", METRICS)


# -- property: the formula agrees with Python arithmetic -------------------------------------

Tree = Any  # float | ("neg", Tree) | (op, Tree, Tree)

numbers = st.one_of(
    st.integers(min_value=0, max_value=1000).map(float),
    st.sampled_from([0.0, 0.5, 1.25, 2.0, 10.0, 0.1]),
)


def _trees(children: st.SearchStrategy[Tree]) -> st.SearchStrategy[Tree]:
    return st.one_of(
        st.tuples(st.sampled_from(["+", "-", "*", "/"]), children, children),
        st.tuples(st.just("neg"), children),
    )


trees = st.recursive(numbers, _trees, max_leaves=12)


def render(t: Tree, parens: bool) -> str:
    """Text for a tree. Without `parens`, only the parentheses precedence requires."""
    if isinstance(t, float):
        return repr(t)
    if t[0] == "neg":
        inner = render(t[1], parens)
        return f"-({inner})" if parens or not isinstance(t[1], float) else f"-{inner}"
    op, left, right = t
    lt, rt = render(left, parens), render(right, parens)
    if parens:
        return f"({lt} {op} {rt})"
    if _prec(left) < _prec(t):
        lt = f"({lt})"
    # Left-associative: an equal-precedence right operand needs parentheses.
    if _prec(right) <= _prec(t):
        rt = f"({rt})"
    return f"{lt} {op} {rt}"


def _prec(t: Tree) -> int:
    if isinstance(t, float) or t[0] == "neg":
        return 3
    return 1 if t[0] in "+-" else 2


def reference(t: Tree) -> float | None:
    """Python arithmetic on the tree; division by zero (anywhere) gives None."""
    if isinstance(t, float):
        return t
    if t[0] == "neg":
        v = reference(t[1])
        return None if v is None else -v
    op, left, right = t
    a, b = reference(left), reference(right)
    if a is None or b is None:
        return None
    if op == "/":
        return None if b == 0 else a / b
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def same(x: float | None, y: float | None) -> bool:
    if x is None or y is None:
        return x is y
    return (math.isnan(x) and math.isnan(y)) or x == y


@FAST
@given(trees)
def test_evaluate_matches_python_arithmetic(tree: Tree) -> None:
    expected = reference(tree)
    for parens in (True, False):
        text = render(tree, parens)
        got = evaluate(parse(text), {})
        assert same(got, expected), (text, got, expected)
        # Python's own parser agrees on precedence and associativity.
        try:
            py = eval(text)  # test oracle on generated numeric text only
        except ZeroDivisionError:
            py = None
        assert same(got, py), (text, got, py)


@FAST
@given(trees, st.dictionaries(st.sampled_from(["a", "b", "c"]), numbers, min_size=3))
def test_names_substitute_like_numbers(tree: Tree, values: dict[str, float]) -> None:
    """Replacing leaves by names bound to the same values gives the same result."""
    leaf_names = iter(["a", "b", "c"] * 20)
    bound: dict[str, float] = {}

    def swap(t: Tree) -> Tree:
        if isinstance(t, float):
            name = next(leaf_names)
            if name not in bound:
                bound[name] = values[name]
            return ("name", name)
        if t[0] == "neg":
            return ("neg", swap(t[1]))
        return (t[0], swap(t[1]), swap(t[2]))

    def text_of(t: Tree) -> str:
        if t[0] == "name":
            return str(t[1])
        if t[0] == "neg":
            return f"-({text_of(t[1])})"
        return f"({text_of(t[1])} {t[0]} {text_of(t[2])})"

    def as_numbers(t: Tree) -> Tree:
        if t[0] == "name":
            return bound[t[1]]
        if t[0] == "neg":
            return ("neg", as_numbers(t[1]))
        return (t[0], as_numbers(t[1]), as_numbers(t[2]))

    named = swap(tree)
    if named[0] == "name":
        named = ("neg", ("neg", named))
    node = parse(text_of(named))
    assert set(names(node)) == set(bound)
    assert same(evaluate(node, values), reference(as_numbers(named)))
    # Any null input makes the whole result null.
    first = names(node)[0]
    assert evaluate(node, {**values, first: None}) is None
