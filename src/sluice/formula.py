"""Derived metrics: arithmetic over metrics of the same key, parsed safely (never `eval`).

Grammar (precedence climbing):
    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/') unary)*
    unary  := '-' unary | atom
    atom   := NUMBER | NAME | '(' expr ')'
Division by zero, or any operand that is null, gives null.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|([A-Za-z_][A-Za-z0-9_]*)|(.))")


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Name:
    name: str


@dataclass(frozen=True)
class Neg:
    operand: Node


@dataclass(frozen=True)
class BinOp:
    op: str
    left: Node
    right: Node


Node = Num | Name | Neg | BinOp


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:  # pragma: no cover - the pattern always matches one char
            break
        whole = m.group(0).strip()
        if m.group(1) is not None:
            out.append(("num", whole))
        elif m.group(2) is not None:
            out.append(("name", m.group(2)))
        elif m.group(3) in "+-*/()":
            out.append(("op", m.group(3)))
        else:
            raise ValueError(f"unexpected character {m.group(3)!r} at position {m.start(3)}")
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise ValueError("formula ends too early")
        self.i += 1
        return tok

    def expr(self) -> Node:
        node = self.term()
        while (t := self.peek()) is not None and t[1] in "+-" and t[0] == "op":
            self.i += 1
            node = BinOp(t[1], node, self.term())
        return node

    def term(self) -> Node:
        node = self.unary()
        while (t := self.peek()) is not None and t[1] in "*/" and t[0] == "op":
            self.i += 1
            node = BinOp(t[1], node, self.unary())
        return node

    def unary(self) -> Node:
        t = self.peek()
        if t == ("op", "-"):
            self.i += 1
            return Neg(self.unary())
        return self.atom()

    def atom(self) -> Node:
        kind, text = self.take()
        if kind == "num":
            return Num(float(text))
        if kind == "name":
            return Name(text)
        if text == "(":
            node = self.expr()
            if self.take() != ("op", ")"):
                raise ValueError("missing ')'")
            return node
        raise ValueError(f"unexpected {text!r}")


def parse(text: str) -> Node:
    """Parse a formula. Raises ValueError with the reason."""
    if not text or not text.strip():
        raise ValueError("formula is empty")
    p = _Parser(text)
    node = p.expr()
    if p.peek() is not None:
        raise ValueError(f"unexpected {p.peek()[1]!r} after the end of the formula")  # type: ignore[index]
    return node


def names(node: Node) -> list[str]:
    """Metric names a formula reads, in first-use order."""
    out: list[str] = []

    def walk(n: Node) -> None:
        if isinstance(n, Name):
            if n.name not in out:
                out.append(n.name)
        elif isinstance(n, Neg):
            walk(n.operand)
        elif isinstance(n, BinOp):
            walk(n.left)
            walk(n.right)

    walk(node)
    return out


_OPS: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def evaluate(node: Node, values: Mapping[str, float | int | None]) -> float | None:
    """Evaluate with metric values. Null in, or division by zero, gives None."""
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Name):
        v = values[node.name]
        return None if v is None else float(v)
    if isinstance(node, Neg):
        v = evaluate(node.operand, values)
        return None if v is None else -v
    a = evaluate(node.left, values)
    b = evaluate(node.right, values)
    if a is None or b is None:
        return None
    if node.op == "/":
        return None if b == 0 else a / b
    return _OPS[node.op](a, b)


def check_derived(expr: str, metrics: Mapping[str, Any]) -> list[str]:
    """Validate a derived formula against the metric definitions; returns the names it reads.

    Every name must be a metric that answers one number (not a quantile), and all must share
    the same key fields.
    """
    node = parse(expr)
    used = names(node)
    if not used:
        raise ValueError("formula names no metric")
    for n in used:
        if n not in metrics:
            known = ", ".join(sorted(metrics)) or "none"
            raise ValueError(f"unknown metric {n!r} in formula (known metrics: {known})")
    for n in used:
        if getattr(metrics[n], "agg", None) == "quantile":
            raise ValueError(
                f"metric {n!r} is a quantile, which answers one value per quantile asked for;"
                " a formula needs metrics that answer one number"
            )
    keys = {tuple(metrics[n].key) for n in used}
    if len(keys) > 1:
        raise ValueError(
            f"metrics in a formula must share one key; got {sorted(list(k) for k in keys)}"
        )
    return used
