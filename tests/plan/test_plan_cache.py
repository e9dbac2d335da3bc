"""The plan cache (mps_src/plan/plan_cache.h), through the simulator's module: a repeated call is
a hit, a cached plan is always the plan a fresh planner call makes for that call (never one of
another key), the cache is bounded; and threads share it safely (plan_cache_stress.cpp, under
ThreadSanitizer)."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gemm"))
from gemm_helpers import requires_planner  # noqa: E402

pytestmark = requires_planner

ROOT = Path(__file__).resolve().parents[2]
F16, F32, I32, BOOL = 0, 2, 3, 5  # steel::DType codes
GEMM = {"alpha": 1.0, "beta": 0.0}
ATTN = {"dropout_p": 0.0, "is_causal": 0.0, "scale": 0.125, "window_left": -1.0}


def desc(dtype, sizes, strides=None, offset=0):
    if strides is None:
        strides, step = [], 1
        for size in reversed(sizes):
            strides.insert(0, step)
            step *= max(size, 1)
    return (dtype, list(sizes), list(strides), offset)


def gemm(m, n, k, dtype=F16, b_strides=None, offset=0, **options):
    tensors = [desc(dtype, [m, k], offset=offset), desc(dtype, [k, n], b_strides), None, None]
    return ("gemm", tensors, {**GEMM, **options}, {"activation": "none"})


def sdpa(length, keys, dim=64, **options):
    q = desc(F16, [1, 4, length, dim])
    kv = desc(F16, [1, 4, keys, dim])
    return ("sdpa", [q, kv, kv, None, None], {**ATTN, **options}, {})


# Calls that differ in one thing a plan depends on, and two that differ only in what it does not.
CALLS = [
    gemm(64, 64, 64),
    gemm(64, 64, 64, dtype=F32),
    gemm(64, 64, 65),
    gemm(64, 64, 64, b_strides=[1, 64]),  # b transposed
    gemm(64, 64, 64, offset=3),  # rows no longer 16-byte aligned
    gemm(64, 64, 64, offset=16),  # the same alignment as offset 0: the same plan
    gemm(64, 64, 64, offset=2**31 - 64 * 64 + 16),  # the same alignment, past 32-bit indexing
    gemm(64, 64, 64, alpha=2.0),
    gemm(64, 64, 64, beta=-0.0),  # -0.0 == 0.0, but the params hold its bits
    ("gemm", [desc(F16, [64, 64]), desc(F16, [64, 64]), desc(F16, [64]), None], GEMM, {}),
    ("gemm", gemm(64, 64, 64)[1], GEMM, {"activation": "relu"}),
    sdpa(128, 128),
    sdpa(128, 129),
    sdpa(1, 4096),
    sdpa(128, 128, is_causal=1.0),
    sdpa(128, 128, scale=0.5),
    sdpa(128, 128, dim=80),
    (
        "sdpa_varlen",
        [desc(F16, [9, 4, 64])] * 3 + [desc(I32, [3])] * 2 + [None],
        {**ATTN, "max_seqlen_q": 5.0, "max_seqlen_k": 5.0},
        {},
    ),
    ("no_such_op", [desc(F16, [4])], {}, {}),
]


@pytest.fixture
def ext():
    from torch_steel.sim import build

    module = build.extension()
    yield module
    module.plan_cache_reset()  # the default capacity, empty


def described(ext, call, cached=True):
    op, tensors, numbers, strings = call
    return ext.make_plan(op, tensors, numbers, strings, cached).describe()


def test_the_calls_need_their_own_plans(ext):
    """The test below can fail: these calls differ where a key that dropped any of their
    differences would hand one call another's plan."""
    fresh = [repr(described(ext, c, cached=False)) for c in CALLS]
    assert len(set(fresh)) == len(CALLS) - 1
    assert fresh[CALLS.index(gemm(64, 64, 64, offset=16))] == fresh[0]
    assert not described(ext, gemm(64, 64, 64, offset=2**31 - 64 * 64 + 16), cached=False)["ok"]
    assert described(ext, CALLS[-2], cached=False)["ok"]  # the varlen call plans


def test_cached_plans_are_the_fresh_plans_of_their_call(ext):
    ext.plan_cache_reset(1000)
    rng = random.Random(0)
    order = [c for _ in range(4) for c in CALLS]
    rng.shuffle(order)
    for call in order:
        assert described(ext, call) == described(ext, call, cached=False), call[0]
    stats = ext.plan_cache_stats()
    keys = len(CALLS) - 1  # offsets 0 and 16 share a key
    assert (stats["misses"], stats["hits"], stats["size"]) == (keys, len(order) - keys, keys)


def test_a_repeated_call_is_a_hit(ext):
    ext.plan_cache_reset(10)
    first = described(ext, CALLS[0])
    assert ext.plan_cache_stats()["misses"] == 1
    assert described(ext, CALLS[0]) == first
    assert ext.plan_cache_stats() == {"hits": 1, "misses": 1, "size": 1, "capacity": 10}


def test_the_cache_is_bounded_and_keeps_the_recently_used(ext):
    ext.plan_cache_reset(3)
    for m in (1, 2, 3, 4, 5):
        described(ext, gemm(m, 8, 8))
    assert ext.plan_cache_stats()["size"] == 3
    described(ext, gemm(5, 8, 8))  # most recent: kept
    assert ext.plan_cache_stats()["hits"] == 1
    described(ext, gemm(1, 8, 8))  # least recent: evicted
    stats = ext.plan_cache_stats()
    assert (stats["hits"], stats["misses"], stats["size"]) == (1, 6, 3)


def test_capacity_zero_plans_every_call(ext):
    ext.plan_cache_reset(0)
    assert described(ext, CALLS[0]) == described(ext, CALLS[0], cached=False)
    described(ext, CALLS[0])
    assert ext.plan_cache_stats() == {"hits": 0, "misses": 2, "size": 0, "capacity": 0}


def test_threads_share_the_cache_safely(tmp_path):
    compiler = shutil.which("clang++-19")
    if compiler is None:
        pytest.skip("clang++-19 is needed for the ThreadSanitizer build")
    exe = tmp_path / "plan_cache_stress"
    sources = [ROOT / "tests" / "plan" / "plan_cache_stress.cpp"]
    sources += sorted((ROOT / "mps_src" / "plan").glob("*.cpp"))
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-I", str(ROOT / "mps_src")]
        + [str(s) for s in sources]
        + ["-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ThreadSanitizer" not in run.stderr
    assert run.stdout.startswith("ok "), run.stdout


MASKS = {  # kind -> the mask of decode(), for `keys` keys and `rows` query rows
    "none": lambda keys, rows: None,
    "rows": lambda keys, rows: desc(F16, [rows, keys]),  # made anew per token: row-major
    "batch": lambda keys, rows: desc(BOOL, [2, 1, 1, keys]),  # a padding mask, over heads
    "view": lambda keys, rows: desc(F32, [2, 1, rows, keys], [rows * 2048, 0, 2048, 1]),
    "keys broadcast": lambda keys, rows: desc(F16, [2, 8, rows, 1]),
}


def decode(keys, capacity=4096, rows=1, mask="none", dim=64, v_capacity="capacity", **options):
    """A decode step: `rows` query rows against the first `keys` keys of a KV cache of
    `capacity` keys (a view, whose strides stay; capacity None: a contiguous key and value, as
    torch.cat grows them), with a mask of MASKS. v_capacity: the value's, where it differs."""

    def rows_of(capacity):
        if capacity is None:
            return desc(F16, [2, 4, keys, dim])
        return desc(F16, [2, 4, keys, dim], [4 * capacity * dim, capacity * dim, dim, 1])

    q = desc(F16, [2, 8, rows, dim])
    k = rows_of(capacity)
    v = k if v_capacity == "capacity" else rows_of(v_capacity)
    return ("sdpa", [q, k, v, MASKS[mask](keys, rows), None], {**ATTN, **options}, {})


STREAMS = {  # name -> (options of decode(), whether its plans are shared across lengths)
    "plain": ({}, True),
    "bottom-right causal": ({"is_causal": 1.0, "bottom_right": 1.0}, True),  # shift = S - L
    "window": ({"window_left": 300.0, "rows": 3}, True),  # bounds the rows once S passes 300
    "one pass": ({"num_splits": 1.0}, True),
    "contiguous": ({"capacity": None}, True),  # grown by torch.cat: the strides hold S too
    # ... rows of 68 halves, not 16-byte aligned: unvectorized loads for every S
    "contiguous, head dim 68": ({"capacity": None, "dim": 68}, True),
    # one grown by torch.cat, the other a cache view: each one's strides rescale on their own
    "key grown, value a view": ({"capacity": None, "v_capacity": 4096}, True),
    "key a view, value grown": ({"v_capacity": None}, True),
    # a mask's last dim holds S, its strides too when it is made anew per token
    "mask over rows and keys": ({"mask": "rows", "rows": 3}, True),
    "padding mask, a cache grown by torch.cat": ({"mask": "batch", "capacity": None}, True),
    "mask view, bottom-right causal": (
        {"mask": "view", "is_causal": 1.0, "bottom_right": 1.0, "rows": 2},
        True,
    ),
    "mask broadcast over keys": ({"mask": "keys broadcast"}, True),
}


def test_a_decode_stream_hits_with_the_plan_of_its_length(ext):
    """Decode streams of one more key per call, interleaved: every cached plan is the fresh
    plan of its call (S and shift rewritten when the cached one was made for another length,
    never a plan of another length, split count or stream), and a stream over views of a KV
    cache plans only when what the plan derives from S changes."""
    ext.plan_cache_reset(4096)
    lengths = range(1, 1400)
    misses = {}
    for s in lengths:
        for name, (options, _) in STREAMS.items():
            call = decode(s, **options)
            before = ext.plan_cache_stats()["misses"]
            assert described(ext, call) == described(ext, call, cached=False), (name, s)
            misses[name] = misses.get(name, 0) + ext.plan_cache_stats()["misses"] - before
    for name, (_, shared) in STREAMS.items():
        if shared:  # a new plan where the split or the key tile alignment changes
            assert misses[name] < len(lengths) / 8, (name, misses[name])
        else:
            assert misses[name] == len(lengths), name
    # Where nothing the plan derives from S changes, every call hits.
    ext.plan_cache_reset(4096)
    for s in range(1100, 1110):
        described(ext, decode(s))
    assert ext.plan_cache_stats()["misses"] == 1


def paged_decode(max_keys, dtype=F16, Hkv=4, dim=64, pages=40, seqs=3, **options):
    """A paged KV cache's decode step (sdpa_varlen with block_table): `seqs` sequences of one
    query row (8 query heads) against pools of 16-key pages, `pages` of them a sequence,
    max_seqlen_k = `max_keys`."""
    q = desc(dtype, [seqs, 8, dim])
    pool = desc(dtype, [seqs * pages, 16, Hkv, dim])
    cu_q = desc(I32, [seqs + 1])
    table, used = desc(I32, [seqs, pages]), desc(I32, [seqs])
    numbers = {**ATTN, "max_seqlen_q": 1.0, "max_seqlen_k": float(max_keys), **options}
    return ("sdpa_varlen", [q, pool, pool, cu_q, None, None, table, used], numbers, {})


@pytest.mark.parametrize(
    "options",
    [{}, {"is_causal": 1.0, "bottom_right": 1.0}, {"window_left": 300.0},
     # GQA 4 over up to 1,600 keys: the split's cost depends on the call being paged (no
     # direct reads), which the length class must plan as the planner does (it did not: at
     # 855 and 1485 keys here the cached plan covered fewer keys than the fresh one)
     {"Hkv": 2, "pages": 60, "dim": 128, "seqs": 2},
     {"Hkv": 2, "pages": 100, "dtype": F32, "seqs": 2}],
    ids=str,
)  # fmt: skip
def test_a_paged_decode_stream_shares_one_plan(ext, options):
    """A paged KV cache's stream raises max_seqlen_k by one per token: every cached plan is the
    fresh plan of its call, planned again only where what the plan derives from max_seqlen_k
    (the split, the window diagonals) changes."""
    ext.plan_cache_reset(4096)
    # past the keys a sequence's pages hold (640 at 40 pages)
    lengths = range(0, 16 * options.get("pages", 40) + 60)
    for n in lengths:
        call = paged_decode(n, **options)
        assert described(ext, call) == described(ext, call, cached=False), n
    assert ext.plan_cache_stats()["misses"] < len(lengths) / 8
