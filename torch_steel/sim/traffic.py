"""The cache model's arguments and the sampled runs of big dispatches (README: The simulator,
Traffic through the caches, Sampled runs; the model itself is mps_src/sim/cache.cpp).

    cache={"l2_bytes": ..., "slc_bytes": ..., "resident_threadgroups": N, "line_bytes": 128}
    sample=T  or  sample={"threadgroups": T, "waves": K, "warm": 1}

A sampled dispatch runs twice, on a few of its threadgroups each time:

- Threadgroups, for every counter but the cache's: the first and the last threadgroup (linear
  ids, dispatch order), and, of the threadgroups between, in x-major order (every threadgroup of
  grid x = 0, then of x = 1, ...), split into T strata of consecutive ones, one threadgroup per
  stratum, counted as many times as its stratum has threadgroups. x-major, because steel's grids
  put what sets a threadgroup's work in x (a causal attention's query or key block, a decode
  split's partition, of which the last may be short) and heads and batch entries, alike in work,
  in y and z: the strata then sample each x in proportion. The first stratum's pick is its
  middle one; the others' follow the golden-ratio sequence from there, so that the strata do not
  all take the same position of a pattern that repeats with their length (a GEMM's swizzled
  bands). Every counter is that weighted sum, rounded (threadgroups and lanes exact).
- Waves, with cache=, for DRAM: complete waves of resident_threadgroups, in dispatch order
  (first, last, one of each of K strata of consecutive waves), each after `warm` waves that run
  uncounted to fill the caches (which are emptied before a wave that does not follow the last
  one run). The cache's counters (DRAM bytes, line hits and misses) are the measured waves'
  weighted sum. (Scaling the threadgroup estimate of device bytes by the waves' DRAM to device
  ratio was tried and is worse: in causal attention DRAM bytes do not follow device bytes.)

A dispatch with too few threadgroups for sampling to save anything (both runs together, with
cache=) runs whole, and its counters are exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_CACHE_KEYS = {"line_bytes", "l2_bytes", "slc_bytes", "resident_threadgroups"}


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


# resident_threadgroups: accepted (the first form of sample= took the wave size there) and
# unused: the waves are those of cache=, and without it only threadgroups are sampled.
_SAMPLE_KEYS_ALL = {"threadgroups", "waves", "warm", "resident_threadgroups"}


def _strata(first: int, last: int, count: int) -> list[tuple[int, float]]:
    """(unit, weight) for units first..last: both ends with weight 1, one unit of each of
    `count` strata of the units between, weighted by its stratum's length."""
    picks = {first: 1.0, last: 1.0}
    middle = last - first - 1
    for j in range(count):
        lo = first + 1 + j * middle // count
        hi = first + 1 + (j + 1) * middle // count
        if hi > lo:
            picks[lo + int(((0.5 + j * 0.6180339887498949) % 1.0) * (hi - lo))] = float(hi - lo)
    return sorted(picks.items())


class Sampling:
    """A validated `sample=` argument."""

    def __init__(self, sample: int | Mapping[str, Any], cache: Mapping[str, Any] | None):
        if isinstance(sample, Mapping):
            unknown = set(sample) - _SAMPLE_KEYS_ALL
            if unknown:
                raise ValueError(
                    f"sample: unknown keys {sorted(unknown)} (known: {sorted(_SAMPLE_KEYS_ALL)})"
                )
        else:
            sample = {"threadgroups": sample}
        self.threadgroups = _positive_int(sample.get("threadgroups", 64), "sample threadgroups")
        self.waves = _positive_int(sample.get("waves", 2), "sample waves")
        self.warm = _positive_int(sample.get("warm", 1), "sample warm", 0)
        self.cache = cache is not None

    def threadgroup_plan(self, grid: Sequence[int]) -> tuple[list[list[int]], list[float]]:
        """Groups (one threadgroup each, by ascending linear id) and weights; ([], []): run
        whole. The strata are over the grid's threadgroups in x-major order (see above)."""
        threadgroups = grid[0] * grid[1] * grid[2]
        if threadgroups <= self.threadgroups + 2:
            return [], []
        rest = threadgroups // grid[0]  # the threadgroups of one x

        def linear(position: int) -> int:
            return position // rest + grid[0] * (position % rest)

        picks = sorted((linear(i), w) for i, w in _strata(0, threadgroups - 1, self.threadgroups))
        return [[i] for i, _ in picks], [w for _, w in picks]

    def wave_plan(self, threadgroups: int, resident: int) -> tuple[list[list[int]], list[float]]:
        """Groups (one wave each, ascending) and weights (0: warm-up); ([], []): run whole."""
        waves = -(-threadgroups // resident)
        if waves <= 2 + self.waves + (self.waves + 1) * self.warm:
            return [], []
        weight = dict(_strata(0, waves - 1, self.waves))
        for w in list(weight):
            for back in range(1, min(self.warm, w) + 1):
                weight.setdefault(w - back, 0.0)
        groups, weights = [], []
        for w in sorted(weight):
            groups.append(list(range(w * resident, min((w + 1) * resident, threadgroups))))
            weights.append(weight[w])
        return groups, weights


# Counters that describe one threadgroup, not sums over threadgroups: the largest of the groups'.
_NOT_SUMS = {"threadgroup_memory_bytes"}


def _weighted(values: Sequence[Any], weights: Sequence[float]) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        keys = {k for v in values for k in v}
        return {
            k: max(v.get(k, 0) for v in values)
            if k in _NOT_SUMS
            else _weighted([v.get(k, 0) for v in values], weights)
            for k in keys
        }
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    return round(sum(w * v for v, w in zip(values, weights, strict=True)))


_CACHE_COUNTERS = ("dram_read", "dram_written", "l2_hits", "l2_misses", "slc_hits", "slc_misses")


def combine(
    by_threadgroup: list[dict],
    tg_weights: Sequence[float],
    by_wave: list[dict] | None,
    wave_weights: Sequence[float],
    threadgroups: int,
    resident: int | None,
) -> dict:
    """A dispatch's counters from its sampled runs (the plans' weights; none: it ran whole),
    with "sampled" saying how they were obtained."""
    if by_wave is not None and not wave_weights:
        (out,) = by_wave  # the cache run ran whole: exact
        out = dict(out)
        extrapolated = False
    else:
        if tg_weights:
            out = _weighted(by_threadgroup, tg_weights)
            out["kernel"] = by_threadgroup[0]["kernel"]
        else:
            (out,) = by_threadgroup
            out = dict(out)
        extrapolated = bool(tg_weights)
        if by_wave is not None:
            extrapolated = True
            w = _weighted(by_wave, wave_weights)
            for key in _CACHE_COUNTERS:
                out[key] = w[key]
    ran = sum(g["threadgroups"] for g in by_threadgroup + (by_wave or []))
    info: dict[str, Any] = {"extrapolated": extrapolated, "threadgroups_run": ran}
    if by_wave is not None:
        waves = -(-threadgroups // resident)
        info.update(
            waves=waves,
            resident_threadgroups=resident,
            waves_run=len(by_wave) if wave_weights else waves,
        )
    out["sampled"] = info
    return out


def runs(
    sampling: Sampling, grid: Sequence[int], resident: int | None
) -> tuple[list[list[int]], list[float], list[list[int]] | None, list[float]]:
    """The two runs of a sampled dispatch of `grid` threadgroups (x, y, z): threadgroup groups
    and weights (without the cache model), wave groups and weights (with it; None without
    cache=). A group list [] runs the dispatch whole; [[]] runs nothing (the cache run is
    exact)."""
    if not sampling.cache:
        tg, tw = sampling.threadgroup_plan(grid)
        return tg, tw, None, []
    threadgroups = grid[0] * grid[1] * grid[2]
    wg, ww = sampling.wave_plan(threadgroups, resident)
    tg, tw = sampling.threadgroup_plan(grid)
    if not ww or sum(map(len, tg)) + sum(map(len, wg)) >= threadgroups:
        return [[]], [], [], []
    return tg, tw, wg, ww
