"""What each metric's slices were folded as, kept in the store (`DEFINITIONS_KEY`).

A slice holds a state of one aggregation over one key, one slice length, one value and one
filter. Under the same name, a metric whose config changes any of these would have its stored
slices read as the new definition: a 1 m slice taken for a 10 s one, maxima merged as minima,
events of another filter counted. So whatever writes slices (`sluice run`, `sluice backfill`)
records each metric's definition the first time, and refuses a config that changes it while
slices of the old one are still stored; the query server refuses to serve it. Retention is not
part of it: a longer or shorter retention reads the same slices. Once every slice of the old
definition has expired, the name is free for a new one.

A `value` or `filter` is compared as Spark reads it (`expression_form`): spacing and the case
of names, keywords and functions are not part of it, so `amount>100` and `AMOUNT > 100` are
one definition; what is quoted is compared as written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import orjson

from sluice.config import Config, MetricConfig
from sluice.errors import ConfigError
from sluice.redis.keys import DEFINITIONS_KEY, KEY_SEP, SLICE_PREFIX
from sluice.units import format_duration_ms

FIELDS = ("key", "agg", "slices", "value", "filter", "from")
EXPRESSIONS = ("value", "filter")

# A Spark SQL expression's tokens: quoted text and identifiers whole, then names, numbers,
# the operators of more than one character, and any other character on its own.
_TOKEN = re.compile(
    r"""'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*"|`(?:[^`]|``)*`"""
    r"|[A-Za-z_][A-Za-z0-9_]*|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?[A-Za-z]*"
    r"|<=>|<=|>=|<>|!=|==|\|\||\S"
)


def expression_form(text: str | None) -> str | None:
    """`text` as Spark reads it: its tokens one space apart, unquoted words in lower case (Spark
    resolves names, keywords and functions without regard to case)."""
    if text is None:
        return None
    tokens = _TOKEN.findall(text)
    return " ".join(t if t[0] in "'\"`" else t.lower() for t in tokens)


def _same(field: str, was: Any, want: Any) -> bool:
    if field in EXPRESSIONS:
        return bool(expression_form(was) == expression_form(want))
    return bool(was == want)


def definition(m: MetricConfig) -> dict[str, Any]:
    """The parts of `m` its stored slices depend on."""
    return {"key": list(m.key), "agg": m.agg, "slices": m.slice_lengths(), "value": m.value,
            "filter": m.filter, "from": m.from_}  # fmt: skip


def check_definitions(client: Any, cfg: Config, names: Sequence[str] | None = None,
                      register: bool = True) -> None:  # fmt: skip
    """Raise ConfigError (its path: the metric's changed field) when a metric of `cfg` (those
    in `names`, default all) is defined otherwise than the slices the store holds of it; with
    `register`, record the definitions not recorded yet, or whose old slices are all gone."""
    metrics = [m for m in cfg.metrics if names is None or m.name in names]
    if not metrics:
        return
    stored = client.hmget(DEFINITIONS_KEY, [m.name for m in metrics])
    new: dict[str, bytes] = {}
    for m, raw in zip(metrics, stored, strict=True):
        want = definition(m)
        if raw is not None:
            was = orjson.loads(raw)
            changed = [f for f in FIELDS if not _same(f, was.get(f), want[f])]
            if changed and _slices_left(client, m.name):
                raise _redefined(cfg, m, changed, was, want)
            if not changed:
                continue
        new[m.name] = orjson.dumps(want)
    if register and new:
        client.hset(DEFINITIONS_KEY, mapping=new)


def _slices_left(client: Any, name: str) -> bool:
    """Whether any slice hash of metric `name` is stored (a scan of the keyspace, over every
    master of a Redis Cluster; it stops at the first)."""
    match = f"{SLICE_PREFIX}{{{name}{KEY_SEP}*"
    return next(iter(client.scan_iter(match=match, count=10_000)), None) is not None


def _redefined(cfg: Config, m: MetricConfig, changed: list[str], was: dict[str, Any],
               want: dict[str, Any]) -> ConfigError:  # fmt: skip
    field = changed[0]
    in_config = {"slices": "resolutions" if m.resolutions else "slice"}.get(field, field)
    return ConfigError(
        f"metric {m.name!r} has slices stored with {in_config} {_text(field, was.get(field))},"
        f" and this config says {_text(field, want[field])}: they would be read as the new"
        " definition. Give the new definition a name of its own (the old slices expire with"
        f" the retention, {format_duration_ms(m.retention)}; `sluice backfill` fills the new"
        f" name's history), or set {in_config} back",
        f"metrics[{cfg.metrics.index(m)}].{in_config}",
    )


def _text(field: str, v: Any) -> str:
    if v is None:
        return "none"
    if field == "slices":
        return ", ".join(format_duration_ms(x) for x in v)
    return ", ".join(v) if isinstance(v, list) else repr(v)
