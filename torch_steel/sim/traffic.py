"""The cache model's arguments and the sampled runs of big dispatches (README: The simulator,
Traffic through the caches; the model itself is mps_src/sim/cache.cpp).

    cache={"l2_bytes": ..., "slc_bytes": ..., "resident_threadgroups": N, "line_bytes": 128}
    sample=K  or  sample={"waves": K, "warm": 1, "resident_threadgroups": N}

A sampled dispatch runs complete waves of `resident_threadgroups` threadgroups (linear ids in
dispatch order) only: the first wave and the last (counted once each), and, of the waves between,
split into K strata of consecutive waves, the middle wave of each stratum, counted as many times
as its stratum has waves. Each measured wave is preceded by `warm` waves that run to fill the
caches but are not counted. Every counter of the dispatch is that weighted sum (rounded to an
integer; `threadgroups` and `lanes` come out exact). A dispatch with too few waves for sampling to
save anything runs whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_CACHE_KEYS = {"line_bytes", "l2_bytes", "slc_bytes", "resident_threadgroups"}
_SAMPLE_KEYS = {"waves", "warm", "resident_threadgroups"}


def _positive_int(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what}: expected an integer >= {minimum}, got {value!r}")
    return value


def resident_for(value: Any, index: int, dispatch: Any) -> int:
    """resident_threadgroups of one dispatch: an int, a sequence (one per dispatch of the plan),
    or a callable taking the plan's Dispatch (torch_steel.sim.Dispatch)."""
    if callable(value):
        value = value(dispatch)
    elif isinstance(value, Sequence):
        if index >= len(value):
            raise ValueError(
                f"resident_threadgroups: {len(value)} values for a plan with more dispatches"
            )
        value = value[index]
    return _positive_int(value, "resident_threadgroups")


def cache_arg(cache: Mapping[str, Any] | None, resident: int) -> tuple | None:
    """The (line_bytes, l2_bytes, slc_bytes, resident) tuple the extension takes, or None."""
    if cache is None:
        return None
    unknown = set(cache) - _CACHE_KEYS
    if unknown:
        raise ValueError(f"cache: unknown keys {sorted(unknown)} (known: {sorted(_CACHE_KEYS)})")
    for key in ("l2_bytes", "slc_bytes", "resident_threadgroups"):
        if key not in cache:
            raise ValueError(f"cache: {key!r} is required")
    line = _positive_int(cache.get("line_bytes", 128), "cache line_bytes", 16)
    if line & (line - 1):
        raise ValueError(f"cache line_bytes: expected a power of two, got {line}")
    l2 = _positive_int(cache["l2_bytes"], "cache l2_bytes", 0)
    slc = _positive_int(cache["slc_bytes"], "cache slc_bytes", 0)
    return (line, l2, slc, resident)


def cache_resident(cache: Mapping[str, Any] | None) -> Any:
    return None if cache is None else cache.get("resident_threadgroups")


class Sampling:
    """A validated `sample=` argument."""

    def __init__(self, sample: int | Mapping[str, Any], cache: Mapping[str, Any] | None):
        if isinstance(sample, Mapping):
            unknown = set(sample) - _SAMPLE_KEYS
            if unknown:
                raise ValueError(
                    f"sample: unknown keys {sorted(unknown)} (known: {sorted(_SAMPLE_KEYS)})"
                )
            strata = sample.get("waves")
            warm = sample.get("warm", 1)
            resident = sample.get("resident_threadgroups")
        else:
            strata, warm, resident = sample, 1, None
        self.strata = _positive_int(strata, "sample waves")
        self.warm = _positive_int(warm, "sample warm", 0)
        cache_value = cache_resident(cache)
        if resident is not None and cache_value is not None:
            raise ValueError("sample: resident_threadgroups comes from cache= when it is given")
        self.resident: Any = cache_value if cache_value is not None else resident
        if self.resident is None:
            raise ValueError(
                "sample: the wave size is unknown; give cache={..., 'resident_threadgroups': N} "
                "or sample={'waves': K, 'resident_threadgroups': N}"
            )

    def plan(self, threadgroups: int, resident: int) -> tuple[list[list[int]], list[float]]:
        """The groups (one wave each, ascending) to run and each one's weight (0: warm-up);
        ([], []) when the dispatch should run whole."""
        waves = -(-threadgroups // resident)
        cost = 2 + self.strata + (self.strata + 1) * self.warm
        if waves <= cost:
            return [], []
        weight: dict[int, float] = {0: 1.0, waves - 1: 1.0}
        middle = waves - 2
        for j in range(self.strata):
            lo = 1 + j * middle // self.strata
            hi = 1 + (j + 1) * middle // self.strata
            if hi > lo:
                weight[lo + (hi - lo) // 2] = float(hi - lo)
        for w in list(weight):
            for back in range(1, min(self.warm, w) + 1):
                weight.setdefault(w - back, 0.0)
        groups, weights = [], []
        for w in sorted(weight):
            groups.append(list(range(w * resident, min((w + 1) * resident, threadgroups))))
            weights.append(weight[w])
        return groups, weights


def _weighted(values: Sequence[Any], weights: Sequence[float]) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        keys = {k for v in values for k in v}
        return {k: _weighted([v.get(k, 0) for v in values], weights) for k in keys}
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    return round(sum(w * v for v, w in zip(values, weights, strict=True)))


def combine(groups: list[dict], weights: Sequence[float], threadgroups: int, resident: int) -> dict:
    """A dispatch's counters from its groups (weights from Sampling.plan; none: it ran whole),
    with "sampled" saying how they were obtained."""
    waves = -(-threadgroups // resident)
    if not weights:
        (out,) = groups
        out = dict(out)
    else:
        out = _weighted(groups, weights)
        out["kernel"] = groups[0]["kernel"]
    out["sampled"] = {
        "extrapolated": bool(weights),
        "waves": waves,
        "resident_threadgroups": resident,
        "waves_run": len(groups) if weights else waves,
        "threadgroups_run": sum(g["threadgroups"] for g in groups),
    }
    return out
