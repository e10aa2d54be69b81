"""The stored slice state, in Python: its text, and the merges of the numeric states.

A slice of a Lua-merged agg is stored in its (metric, key) hash as `token:v1:...:v_width`, the
writer token then the state's numbers as exact decimal text. The writer sends the numbers to
`write_slices.lua` as `number_text` (integers in decimal, doubles in their shortest exact
form); a slice that had no state stores that text as it is, and a merged one the numbers as
`_merge.lua`'s `fmt` writes them (`format_number`: 17 significant digits). Either text reads
back (Lua's `tonumber`, Python's `float`) to the same double, so a reader never needs to know
which wrote it. Which numbers a state holds is per agg (`sluice.slices.aggs`), and so is its
merge.

The merges here are the query server's side of `read_slices.lua` (see `QueryEngine`): a lookup
over a bounded number of slices reads them with HMGET and merges them in the server, so Redis
only looks fields up (about 0.04 µs each) instead of running a script that parses and merges
every slice (about 0.7 µs each), and the merging is spread over the server's workers. They work
on whole columns with C-level iteration (join, split, map, reduce), never a Python loop per
slice, and give exactly what the script gives: the same doubles added in the same order, the
same minimum, maximum, first and last value. Only `var` is merged differently: the two-pass
combination of (count, mean, M2) over all slices at once, which may differ from the script's
pairwise updates in the last bits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from functools import reduce
from operator import add
from typing import Any

from fastnumbers import RAISE, try_float

_add_in_c: Callable[[object], tuple[int, float] | None] | None
try:  # count and sum states added in C (src/sluice/slices/_sums.c), where it was built
    from sluice.slices._sums import add_states as _add_in_c
except ImportError:  # pragma: no cover - a build without a C compiler: the same, in Python
    _add_in_c = None
# Columns of a state's numbers, the writer tokens left out: cols[j] holds v_(j+1) of every slice,
# as text.
Columns = list[list[str]]


EXACT_INT = 2**53  # every integer up to this one is a double


def format_number(x: float) -> str:
    """`x` as `fmt` in `_merge.lua` writes it into a stored state: integral values below 1e15
    as integers, anything else with 17 significant digits."""
    if abs(x) < 1e15 and x == int(x):  # abs first: int() of an infinity or a NaN raises
        return f"{int(x):d}"
    return f"{x:.17g}"


def number_text(column: Any) -> Any:
    """A column of numbers (Arrow integers or doubles) as the text the writer passes to
    `write_slices.lua`: integers in decimal, doubles in Arrow's shortest form that reads back
    to the same double (`1e+20`, `0.1`, `5` for 5.0), which Lua's `tonumber` and Python's
    `float` both read exactly. A slice that had no state stores this text as it is."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.cast(column, pa.string())


def encode_state(token: int, values: Sequence[float]) -> str:
    """A slice state as `write_slices.lua` stores it when the slice had none before: the writer
    token, then each number of the state as the writer sends it (`number_text`; an int as an
    integer, anything else as a double)."""
    import pyarrow as pa

    texts = [
        str(v) if isinstance(v, int) else number_text(pa.array([float(v)]))[0].as_py()
        for v in values
    ]
    return ":".join([str(token), *texts])


def state_columns(states: Sequence[bytes], width: int) -> Columns:
    """The numbers of the packed `states` as `width` columns. Raises ValueError on a state that
    is not a token and `width` numbers."""
    stride = width + 1
    parts = b":".join(states).decode("latin-1").split(":")
    if len(parts) != stride * len(states):
        raise ValueError(f"a slice state is not `token` and {width} numbers")
    return [parts[j::stride] for j in range(1, stride)]


if sys.version_info < (3, 12):

    def in_order(values: Iterable[float]) -> float:
        """The doubles added one by one in order, as the script adds them: `sum` from -0.0 (the
        one start that leaves every first value as it is), whose loop adds doubles in C with
        no call per value before Python 3.12."""
        return sum(values, -0.0)

else:  # 3.12's `sum` compensates the rounding of each addition: another total

    def in_order(values: Iterable[float]) -> float:
        """The doubles added one by one in order, as the script adds them."""
        return reduce(add, values)


def _floats(col: Sequence[Any]) -> list[float]:
    """The numbers of `col` as doubles, each the one `float` reads from its text (fastnumbers'
    parser rounds correctly, as `float` and Lua's `tonumber` do, and reads a column in one C
    call, at about half `map(float)`'s cost). Raises ValueError on a text that is not a
    number."""
    return try_float(col, on_fail=RAISE, map=list)


def merge_add(cols: Columns) -> list[float]:
    """count, sum: the total, added in slice order as the script adds it (`_added`)."""
    col = cols[0]
    return _added(col, not any("-" in x or "." in x for x in col))


def merge_add_states(replies: Iterable[bytes | None]) -> list[float]:
    """The merge of one-number states (count, sum) straight from HMGET's replies (None = no
    slice), as `Agg.merge` gives it: [states, total], or [0] with none. The query server's
    most common merge.

    A list of plain states is added in C where the extension is built (`_sums.c`: the same
    doubles, added in the same order). Otherwise, and for anything the C code does not read
    plainly, the states are added as `state_columns` then `merge_add` would, with one split of
    the bytes (`int` and the parser of `_floats` read bytes as they read text) and one look
    for a minus sign and a decimal point over the whole text."""
    if _add_in_c is not None and (added := _add_in_c(replies)) is not None:
        return [float(added[0]), added[1]] if added[0] else [0]
    states = list(filter(None, replies))
    if not states:
        return [0]
    text = b":".join(states)
    parts = text.split(b":")
    if len(parts) != 2 * len(states):
        raise ValueError("a slice state is not `token` and 1 numbers")
    return [float(len(states)), *_added(parts[1::2], b"-" not in text and b"." not in text)]


def _added(col: Sequence[str | bytes], maybe_ints: bool) -> list[float]:
    """The numbers of `col` added in order. With no minus sign or decimal point among them
    (`maybe_ints`: no negative number, no negative exponent, no fraction written out) and every
    one an integer (every count, the sums of an integer field), they are added as ints, about
    twice as fast: when none is negative and the total is at most 2**53, every partial sum is
    exact as a double too, so the total is the script's. Anything else is added as doubles, as
    the script adds them (a column with a decimal point skips the try as ints, whose failure
    costs as much as the sum)."""
    if maybe_ints:
        try:
            total = sum(map(int, col))
        except ValueError:  # a double's text ("2.5", "1e+15"): added as doubles
            total = EXACT_INT + 1
        if total <= EXACT_INT:
            return [float(total)]
    return [in_order(_floats(col))]


def merge_min(cols: Columns) -> list[float]:
    return [min(_floats(cols[0]))]


def merge_max(cols: Columns) -> list[float]:
    return [max(_floats(cols[0]))]


def merge_avg(cols: Columns) -> list[float]:
    """(count, sum): both added."""
    return [in_order(_floats(cols[0])), in_order(_floats(cols[1]))]


def merge_var(cols: Columns) -> list[float]:
    """(count, mean, M2) of all slices at once (the two-pass form of Chan et al.'s update)."""
    import numpy as np  # here, not at the top: the config and its agg names must stay light

    counts, means, m2s = (np.fromiter(_floats(c), np.float64, len(c)) for c in cols)
    total = counts.sum()
    mean = float((counts * means).sum() / total)
    m2 = float(m2s.sum() + (counts * (means - mean) ** 2).sum())
    return [float(total), mean, m2]


def merge_last(cols: Columns) -> list[float]:
    """(event time, value): the greater time wins; a tie goes to the greater value."""
    return list(max(zip(_floats(cols[0]), _floats(cols[1]), strict=True)))


def merge_first(cols: Columns) -> list[float]:
    """(event time, value): the smaller time wins; a tie goes to the smaller value."""
    return list(min(zip(_floats(cols[0]), _floats(cols[1]), strict=True)))
