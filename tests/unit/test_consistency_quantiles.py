"""Quantiles online against the archive's (`offline.consistency._quantiles_agree`): a slice of
more than KLL's k values is compacted with random choices on each side (online, each batch's
sketch merged into the stored one; offline, one sketch of all of them), so the two agree within
the sketches' rank error, not to the bit; with no compaction they must be equal."""

from __future__ import annotations

import numpy as np
from datasketches import kll_doubles_sketch

from sluice.config import MetricConfig
from sluice.offline.consistency import _quantiles_agree
from sluice.slices.aggs import AGGS

M = MetricConfig.model_validate({"name": "amount_q", "key": ["merchant"], "agg": "quantile",
                                 "value": "amount", "q": [0.5, 0.99]})  # fmt: skip
AGG = AGGS["quantile"]


def sketch(values: np.ndarray) -> bytes:
    s = kll_doubles_sketch(200)
    for v in values:
        s.update(float(v))
    return bytes(s.serialize())


def stored(blob: bytes | None) -> bytes:
    """A slice's state as the store holds it: a writer token, then the blob."""
    assert blob is not None
    return b"0:" + blob


def test_compacted_sketches_agree_within_their_rank_error_and_a_wrong_value_does_not() -> None:
    values = np.random.default_rng(5).lognormal(3, 1, 20_000)
    online_blob = AGG.union([sketch(b) for b in np.array_split(values, 25)])  # batch by batch
    online = AGG.finalize(AGG.merge([stored(online_blob)]), M, False)
    offline = AGG.merge([stored(sketch(values))])
    assert offline[1][-1] > len(offline[0])  # compacted: items of weight above 1
    assert _quantiles_agree(online, offline, M)
    assert not _quantiles_agree({**online, "0.5": float(np.quantile(values, 0.8))}, offline, M)
    assert not _quantiles_agree({**online, "0.99": None}, offline, M)


def test_without_compaction_only_equal_values_agree() -> None:
    values = np.random.default_rng(6).normal(0, 1, 150)
    offline = AGG.merge([stored(sketch(values))])
    exact = AGG.finalize(offline, M, False)
    near = {k: v + 1e-6 for k, v in exact.items()}
    assert not _quantiles_agree(near, offline, M)  # `_same` alone judges these
