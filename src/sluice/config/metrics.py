"""`metrics:` and `derived:`: what is folded, how, at which slice lengths and for how long."""

from __future__ import annotations

import itertools

from pydantic import Field, field_validator, model_validator

from sluice.config.base import NAME_RE, DurationMs, _FieldError, _Model
from sluice.slices.aggs import AGG_NAMES, AGGS


class MetricConfig(_Model):
    name: str
    key: list[str] = Field(min_length=1)
    agg: str
    value: str | None = None
    filter: str | None = None
    q: float | list[float] | None = Field(
        None, description="quantile(s) for agg quantile, each strictly between 0 and 1"
    )
    slice: DurationMs = 60_000
    retention: DurationMs = 7 * 86_400_000
    resolutions: list[DurationMs] | None = Field(
        None,
        description="slice lengths kept side by side, finest first, e.g. [1s, 1m, 1h]: queries"
        " read the coarsest slices that fit inside the window and the finest at its edges",
    )
    from_: str | None = Field(
        None,
        alias="from",
        description="the stream this metric folds: a stage's output stream; null = the source",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"metric name {v!r} must match {NAME_RE.pattern}")
        return v

    @field_validator("agg")
    @classmethod
    def _agg(cls, v: str) -> str:
        if v not in AGGS:
            raise ValueError(f"unknown agg {v!r}; expected one of {', '.join(AGG_NAMES)}")
        return v

    @model_validator(mode="after")
    def _shape(self) -> MetricConfig:
        if AGGS[self.agg].needs_value and not self.value:
            raise _FieldError(
                "value", f"agg {self.agg!r} needs `value` (a field or a Spark SQL expression)"
            )
        if self.agg == "quantile":
            qs = self.quantiles()
            if not qs:
                raise _FieldError("q", "agg 'quantile' needs `q`, e.g. q: [0.5, 0.99]")
            for q in qs:
                if not 0.0 < q < 1.0:
                    raise _FieldError("q", f"quantile {q} must be strictly between 0 and 1")
        elif self.q is not None:
            raise _FieldError("q", f"`q` is only for agg 'quantile', not {self.agg!r}")
        if self.resolutions is not None:
            res = self.resolutions
            if not res:
                raise _FieldError("resolutions", "`resolutions` must list at least one duration")
            if "slice" in self.model_fields_set and self.slice != res[0]:
                raise _FieldError(
                    "slice", f"slice ({self.slice}ms) must be the finest resolution ({res[0]}ms)"
                )
            for finer, coarser in itertools.pairwise(res):
                if coarser <= finer or coarser % finer:
                    raise _FieldError(
                        "resolutions",
                        f"each resolution must be a multiple of the one before; {coarser}ms is"
                        f" not a multiple of {finer}ms",
                    )
            object.__setattr__(self, "slice", res[0])
        if self.slice < 1000:
            raise _FieldError("slice", f"slice {self.slice}ms is shorter than the 1s minimum")
        if self.retention < self.slice:
            raise _FieldError(
                "retention", f"retention {self.retention}ms is shorter than the slice"
            )
        for r in self.resolutions or []:
            if self.retention % r:
                raise _FieldError(
                    "retention",
                    f"resolution {r}ms does not divide retention ({self.retention}ms)",
                )
        if self.retention % self.slice != 0:
            raise _FieldError(
                "retention",
                f"slice ({self.slice}ms) does not divide retention ({self.retention}ms);"
                " choose a retention that is a whole number of slices",
            )
        if len(set(self.key)) != len(self.key):
            raise _FieldError("key", f"key fields {self.key} repeat a field")
        return self

    def slice_lengths(self) -> list[int]:
        """Every slice length this metric keeps, finest first."""
        return list(self.resolutions) if self.resolutions else [self.slice]

    def quantiles(self) -> list[float]:
        if self.q is None:
            return []
        return [float(self.q)] if isinstance(self.q, int | float) else [float(x) for x in self.q]


class DerivedConfig(_Model):
    name: str
    expr: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"derived metric name {v!r} must match {NAME_RE.pattern}")
        return v
