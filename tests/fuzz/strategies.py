"""Hypothesis strategies that draw calls of the steel kernel ops within each launch plan's
envelope, shared by every fuzz test (tests/fuzz/test_fuzz_*.py).

A drawn call is a frozen dataclass (GemmCall, SdpaCall, VarlenCall) whose repr is the whole
recipe: shapes, dtypes, options, the memory layout of every tensor argument and the seed of its
values. Its build() materializes the tensors, each one a view into its own guard buffer
(Guarded): a flat allocation filled with a sentinel (a NaN payload for floats, 0xA5 for bool),
the view's elements copied in. After the kernel ran, Guarded.check() compares the whole buffer
with its snapshot, so that a write anywhere in it (into an input, or between a strided view's
elements, where the simulator's out-of-bounds checker cannot see it: those bytes lie inside the
bound extent) fails, and a kernel that reads the gaps gets NaN into its result.

The pieces, bottom up:
  sizes(tiles, hi)        lengths 1..hi, weighted on multiples of the tiles and one either side
  Layout, layouts(...)    memory order (transposes, BLHD, permuted batch dims), element steps
                          (strided slices), padding (slices of a larger tensor), storage
                          offsets, stride-0 (expanded) dims
  Guarded                 a view into a sentinel-filled guard buffer, and its check
  gemm_calls()            steel::gemm within gemm_plan.cpp's envelope, by tile regime
  sdpa_calls()            steel::sdpa (the attention forward) within attention_plan.cpp's
  varlen_calls()          steel::sdpa_varlen (packed sequences) within varlen_plan.cpp's
  paged_calls()           sdpa_varlen against a paged KV cache (the decode kernels)
  quant_calls()           any of the three with a quantized key and value (torch_steel.kv)
  gemm_refusals(), sdpa_refusals(), varlen_refusals()
                          calls outside the envelope, as run_op arguments, that the plan must
                          refuse with a reason

Adding an op when its kernel lands (decode, paged KV): write a frozen
dataclass with a build() returning (arguments, guards) and a strategy drawing it from the pieces
above (VarlenCall / varlen_calls() is the smallest example), then a test file with two tests
over one check function (the fixed-seed subset and the @pytest.mark.fuzz run, see
test_fuzz_varlen.py): run the op on the "sim" backend in strict mode,
compare with its float64 oracle within the op's tolerance (tests/attn/attn_helpers.py), call
check() on every guard, and a refusal entry in the op's *_refusals() strategy. The decode
kernels are sdpa with L <= a few rows: sdpa_calls(max_L=8) draws them once their plan picks
them. The backwards reuse the forwards' calls whole: sdpa_calls() (steel::sdpa_backward,
test_fuzz_sdpa_backward.py) and varlen_calls() (test_fuzz_sdpa_varlen_backward.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace

import torch
from hypothesis import strategies as st

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")

# ----------------------------------------------------------------------------- sizes


def tile_edges(tiles, hi, multiples=4):
    """1, 2, and k * t - 1, k * t, k * t + 1 for each tile t and k = 1..multiples, up to hi."""
    edges = {1, 2}
    for t in tiles:
        for k in range(1, multiples + 1):
            edges.update(k * t + d for d in (-1, 0, 1))
    return sorted(e for e in edges if 1 <= e <= hi)


@functools.cache
def sizes(tiles, hi, lo=1):
    """A length in lo..hi: a tile edge (or one either side), a small one, or any. (Strategies
    are cached: building one inside every draw costs hypothesis more than the draw.)"""
    return st.one_of(
        st.sampled_from([e for e in tile_edges(tiles, hi) if e >= lo]),
        st.integers(lo, min(hi, max(lo, 40))),
        st.integers(lo, hi),
    )


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """How a tensor of some logical shape lies in its guard buffer.

    order:  memory order of the dims, outermost first (identity: contiguous);
    step:   per dim, the element step (2: every other element, a strided slice);
    pad:    per dim, stored elements past the view's (the view is a slice of a larger tensor);
    offset: storage offset in elements (odd ones break 16-byte alignment);
    expand: per dim, stored once and read with stride 0 (an expanded view).
    """

    order: tuple[int, ...]
    step: tuple[int, ...]
    pad: tuple[int, ...]
    offset: int
    expand: tuple[bool, ...]

    @staticmethod
    def contiguous(ndim):
        return Layout(tuple(range(ndim)), (1,) * ndim, (0,) * ndim, 0, (False,) * ndim)

    def transposed(self, d0, d1):
        """The same layout with dims d0 and d1 swapped in memory."""
        order = list(self.order)
        i, j = order.index(d0), order.index(d1)
        order[i], order[j] = order[j], order[i]
        return Layout(tuple(order), self.step, self.pad, self.offset, self.expand)


def layouts(ndim, *, orders=(), expandable=None, plain=0.4):
    """See _layouts; cached by its arguments."""
    orders = tuple(tuple(o) for o in orders)
    expandable = None if expandable is None else tuple(expandable)
    return _layouts_cached(ndim, orders, expandable, plain)


_PLAIN = st.floats(0, 1)
_PAD = st.sampled_from([0] * 6 + [1, 2, 3, 7])
_STEP = st.sampled_from([1] * 7 + [2, 3])
_OFFSET = st.sampled_from([0, 0, 0, 1, 3, 8, 16, 37])
_EXPAND = st.sampled_from([False] * 5 + [True])


@functools.cache
def _layouts_cached(ndim, orders, expandable, plain):
    return _layouts(ndim, orders=orders, expandable=expandable, plain=plain)


@st.composite
def _layouts(draw, ndim, *, orders=(), expandable=None, plain=0.4):
    """A Layout for an ndim tensor.

    orders: memory orders to favour besides the identity (a transpose, BLHD), a random
    permutation is also drawn now and then; expandable: dims that may be stride 0 (default all);
    plain: the probability of the contiguous layout.
    """
    if draw(_PLAIN) < plain:  # contiguous, now and then at a storage offset
        c = Layout.contiguous(ndim)
        return Layout(c.order, c.step, c.pad, draw(_OFFSET), c.expand)
    identity = tuple(range(ndim))
    order = draw(
        st.one_of(
            st.just(identity),
            st.sampled_from(list(orders) or [identity]),
            st.permutations(identity).map(tuple),
        )
    )
    pad = tuple(draw(_PAD) for _ in range(ndim))
    step = tuple(draw(_STEP) for _ in range(ndim))
    offset = draw(_OFFSET)
    dims = range(ndim) if expandable is None else expandable
    expand = tuple((d in dims) and draw(_EXPAND) for d in range(ndim))
    return Layout(order, step, pad, offset, expand)


# ----------------------------------------------------------------------------- guard buffers

# Sentinel element bits: NaN payloads for the floats (a kernel that reads a gap gets NaN).
_SENTINEL = {
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FA5),
    torch.float32: (torch.int32, 0x7FA5A5A5),
    torch.float64: (torch.int64, 0x7FF5A5A5A5A5A5A5),
    torch.int32: (torch.int32, -0x5A5A5A5B),
    torch.int64: (torch.int64, -0x5A5A5A5A5A5A5A5B),
    torch.bool: (torch.uint8, 0xA5),
    torch.int8: (torch.int8, -0x5B),  # quantized KV codes (kv.py): a code outside [-127, 127]
    torch.uint8: (torch.uint8, 0xA5),
}
_TAIL = 9  # sentinel elements after the view's last one


class Guarded:
    """A view with `layout` of the values `base` (shape 1 along expanded dims), expanded to
    `shape`, inside a guard buffer filled with a sentinel everywhere else."""

    def __init__(self, name, base, layout, shape):
        self.name = name
        nd = base.dim()
        stored = [base.shape[d] * layout.step[d] + layout.pad[d] for d in range(nd)]
        strides = [0] * nd
        span = 1
        for d in reversed(layout.order):
            strides[d] = span * layout.step[d]
            span *= stored[d]
        int_dtype, bits = _SENTINEL[base.dtype]
        self.buffer = torch.full((layout.offset + span + _TAIL,), bits, dtype=int_dtype)
        self.buffer = self.buffer.view(base.dtype)
        view = self.buffer.as_strided(tuple(base.shape), strides, layout.offset)
        view.copy_(base)
        self.tensor = view.expand(shape)
        self._snapshot = self.buffer.view(int_dtype).clone()
        self._int_dtype = int_dtype

    def check(self):
        """Every byte of the buffer is what it was: the input unchanged, the guard intact."""
        now = self.buffer.view(self._int_dtype)
        changed = (now != self._snapshot).nonzero().flatten()
        if len(changed):
            inside = torch.zeros_like(now, dtype=torch.bool)
            t = self.tensor
            idx = torch.as_strided(torch.arange(len(now)), t.shape, t.stride(), t.storage_offset())
            inside[idx.flatten()] = True
            where = "in the input's elements" if bool(inside[changed].any()) else "in guard bytes"
            raise AssertionError(
                f"{self.name}: {len(changed)} elements of its buffer written ({where}), first at "
                f"element {int(changed[0])}"
            )


def values(shape, dtype, gen, scale=1.0):
    """Random values exactly representable in dtype (float64 sees the kernel's exact inputs)."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def guarded(name, shape, dtype, layout, gen, scale=1.0, fill=None):
    """Guarded random values of `shape` (constant along the layout's expanded dims); fill, if
    given, maps the base values (float64 or bool) before they are stored."""
    base_shape = [1 if e else s for s, e in zip(shape, layout.expand)]
    if dtype == torch.bool:
        base = torch.rand(base_shape, generator=gen) < 0.5
    else:
        base = torch.randn(base_shape, generator=gen, dtype=torch.float64) * scale
    if fill is not None:
        base = fill(base)
    return Guarded(name, base.to(dtype), layout, tuple(shape))


# ----------------------------------------------------------------------------- gemm

# gemm_plan.cpp's tiles: BM x BN of 32x32, 64x64, 32x128, 128x32, BK = 16.
GEMM_TILES = (16, 32, 64, 128)
# Padded multiply-adds a drawn call may cost (~24M a second in the simulator): ~0.25 s.
GEMM_BUDGET = 6_000_000


@dataclass(frozen=True)
class GemmCall:
    """torch_steel.gemm(a, b, bias=, c=, alpha=, beta=, activation=) on [*a_batch, M, K] @
    [*b_batch, K, N]; c of c_shape (broadcast to the output) or None."""

    dtype: torch.dtype
    M: int
    N: int
    K: int
    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    a_layout: Layout
    b_layout: Layout
    bias_layout: Layout | None
    c_shape: tuple[int, ...] | None
    c_layout: Layout | None
    c_nan: bool  # c is all NaN (only with beta == 0: never read, as addmm)
    alpha: float
    beta: float
    activation: str
    seed: int
    regime: str = field(default="", compare=False)

    def out_shape(self):
        return (*torch.broadcast_shapes(self.a_batch, self.b_batch), self.M, self.N)

    def build(self):
        """({a, b, bias, c} tensors, [Guarded])."""
        gen = torch.Generator().manual_seed(self.seed)
        a = guarded("a", (*self.a_batch, self.M, self.K), self.dtype, self.a_layout, gen)
        b = guarded("b", (*self.b_batch, self.K, self.N), self.dtype, self.b_layout, gen)
        guards = [a, b]
        t = {"a": a.tensor, "b": b.tensor, "bias": None, "c": None}
        if self.bias_layout is not None:
            bias = guarded("bias", (self.N,), self.dtype, self.bias_layout, gen)
            guards.append(bias)
            t["bias"] = bias.tensor
        if self.c_shape is not None:
            nan = (lambda x: torch.full_like(x, math.nan)) if self.c_nan else None
            c = guarded("c", self.c_shape, self.dtype, self.c_layout, gen, fill=nan)
            guards.append(c)
            t["c"] = c.tensor
        return t, guards


def _ceil(a, b):
    return -(-a // b)


def _gemm_cost(batch, M, N, K):
    pad = lambda x, t: -(-x // t) * t  # noqa: E731
    return math.prod(batch) * pad(M, 32) * pad(N, 32) * pad(K, 16)


GEMM_REGIMES = ("edges", "edges", "edges", "batched", "splitk", "thin", "tall", "large", "gemv")


@st.composite
def _gemm_shape(draw, regimes=GEMM_REGIMES):
    """(regime, out batch, M, N, K): each regime aims at one branch of the tile table."""
    regime = draw(st.sampled_from(regimes))
    if regime == "edges":  # kSmall / kLarge edge tiles, no batch
        return (
            regime,
            (),
            draw(sizes(GEMM_TILES, 300)),
            draw(sizes(GEMM_TILES, 300)),
            draw(sizes(GEMM_TILES, 300)),
        )
    if regime == "batched":
        rank = draw(st.integers(1, 3))
        batch = tuple(draw(st.integers(1, 4)) for _ in range(rank))
        return (
            regime,
            batch,
            draw(sizes(GEMM_TILES, 100)),
            draw(sizes(GEMM_TILES, 100)),
            draw(sizes(GEMM_TILES, 100)),
        )
    if regime == "splitk":  # <= 16 32x32 blocks over the batch, K >= 512 and >= 8 max(M, N)
        batch = draw(st.sampled_from([(), (), (2,), (3,), (2, 2)]))
        M, N = draw(sizes((16, 32), 128)), draw(sizes((16, 32), 128))
        while math.prod(batch) * -(-M // 32) * -(-N // 32) > 16:
            M, N = max(1, M // 2), max(1, N // 2)
        # M counted with the batch: a shared b folds the batch into M (gemm_plan.cpp)
        rows = math.prod(batch) * M
        K = draw(st.integers(max(512, 8 * max(rows, N)), max(640, 8 * max(rows, N) + 700)))
        return regime, batch, M, N, K
    if regime == "thin":  # M <= 32, >= 64 column blocks of 128 over the batch
        B = draw(st.integers(16, 32))
        N = draw(st.integers(-(-64 // B) * 128 - 127, 600))
        return regime, (B,), draw(sizes((8, 16, 32), 32)), N, draw(sizes((16,), 40))
    if regime == "tall":  # N <= 32, >= 64 row blocks of 128 over the batch
        B = draw(st.integers(32, 64))
        lo = -(-64 // B) * 128 - 127
        M = draw(st.integers(lo, max(lo, 11000 // B)))
        return regime, (B,), M, draw(sizes((8, 16, 32), 32)), draw(sizes((16,), 24))
    if regime == "gemv":  # at most 8 rows (or columns): the GEMV kernels, never split-K
        rows, lines = draw(st.integers(1, 8)), draw(sizes(GEMM_TILES, 700))
        batch = draw(st.sampled_from([(), (), (), (2,), (3, 2)]))
        K = draw(sizes(GEMM_TILES, 1300))
        while math.prod(batch) * rows * lines * K > GEMM_BUDGET and K > 16:
            K = max(16, K // 2)
        if _ceil(lines, 32) <= 16 and K >= 512 and K >= 8 * lines:
            K = 511  # the plan might split K (gemm_plan.cpp: split-K wins over few lines)
        M, N = (rows, lines) if draw(st.booleans()) else (lines, rows)
        return regime, batch, M, N, K
    # large: >= 128 64x64 blocks over the batch, M and N > 32; about 8M padded multiply-adds
    # whatever the shape (the minimum of this tile), K <= 32
    B = draw(st.integers(8, 16))
    M = draw(sizes((64,), 260, lo=33))
    col_blocks = _ceil(_ceil(128, B), _ceil(M, 64))
    lo = max(33, (col_blocks - 1) * 64 + 1)
    N = draw(st.integers(lo, max(lo + 63, 260)))
    return regime, (B,), M, N, draw(sizes((16,), 32))


def _along_k(layout, order):
    """layout with memory order `order` and K (its innermost dim) unit-stride and stored, the
    rest (pads, steps of the outer dims, offset, batch expansion) as drawn."""
    k = order[-1]
    step = tuple(1 if d == k else s for d, s in enumerate(layout.step))
    expand = tuple(e and d < len(order) - 2 for d, e in enumerate(layout.expand))
    return Layout(order, step, layout.pad, layout.offset, expand)


def _operand_batch(draw, batch):
    """An operand's batch dims for an output batch: each dim full or 1, leading ones dropped."""
    keep = draw(st.integers(0, len(batch)))
    dims = batch[len(batch) - keep :]
    return tuple(s if draw(st.booleans()) or s == 1 else 1 for s in dims)


@st.composite
def gemm_calls(draw, dtypes=DTYPES, regimes=GEMM_REGIMES):
    """A steel::gemm call in the plan's envelope (served, not refused); regimes: which of
    GEMM_REGIMES to draw shapes from."""
    regime, batch, M, N, K = draw(_gemm_shape(regimes))
    dtype = draw(st.sampled_from(dtypes))
    if regime in ("thin", "tall", "large"):  # the tile needs batched a and b
        a_batch = b_batch = batch
    else:
        a_batch, b_batch = _operand_batch(draw, batch), _operand_batch(draw, batch)
        # the output batch is what a and b broadcast to (a dim both drop disappears)
    out_batch = torch.broadcast_shapes(a_batch, b_batch)
    while regime != "gemv" and _gemm_cost(out_batch, M, N, K) > GEMM_BUDGET and K > 16:
        K = max(16, K // 2)
    na, nb = len(a_batch) + 2, len(b_batch) + 2
    a_layout = draw(layouts(na, orders=[(*range(na - 2), na - 1, na - 2)]))
    b_layout = draw(layouts(nb, orders=[(*range(nb - 2), nb - 1, nb - 2)]))
    if regime == "gemv":  # the GEMV kernels' layout: a row-major, b column by column (x @ W^T)
        a_layout = _along_k(a_layout, (*range(na - 2), na - 2, na - 1))
        b_layout = _along_k(b_layout, (*range(nb - 2), nb - 1, nb - 2))
    bias_layout = draw(st.one_of(st.none(), layouts(1)))
    alpha = draw(st.sampled_from([1.0, 1.0, 0.5, -2.0, 0.0, 1.7]))
    beta = draw(st.sampled_from([0.0, 1.0, 1.0, 0.5, -1.5]))
    c_shape = c_layout = None
    c_nan = False
    if draw(st.booleans()):
        out = (*out_batch, M, N)
        c_shape = _operand_batch(draw, out)
        c_layout = draw(layouts(len(c_shape), orders=[tuple(reversed(range(len(c_shape))))]))
        c_nan = beta == 0.0 and draw(st.booleans())
    activation = draw(st.sampled_from(ACTIVATIONS))
    seed = draw(st.integers(0, 2**31 - 1))
    return GemmCall(dtype, M, N, K, a_batch, b_batch, a_layout, b_layout, bias_layout, c_shape,
                    c_layout, c_nan, alpha, beta, activation, seed, regime)  # fmt: skip


GEMM_REFUSALS = ("float64", "int32", "mixed_b", "mixed_c", "rank1", "k_mismatch", "bias_shape",
                 "c_shape", "batch_mismatch", "unmergeable_batch", "activation",
                 "max_threads")  # fmt: skip


@st.composite
def gemm_refusals(draw):
    """(what, run_op tensors [a, b, bias, c], options) that gemm_plan.cpp must refuse."""
    what = draw(st.sampled_from(GEMM_REFUSALS))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    M, N, K = (draw(sizes(GEMM_TILES, 80)) for _ in range(3))
    a, b = values((M, K), dtype, gen), values((K, N), dtype, gen)
    bias = c = None
    options = {"alpha": 1.0, "beta": 1.0, "activation": draw(st.sampled_from(ACTIVATIONS))}
    other = draw(st.sampled_from([d for d in DTYPES if d != dtype]))
    if what == "float64":
        a, b = a.double(), b.double()
    elif what == "int32":
        a, b = a.to(torch.int32), b.to(torch.int32)
    elif what == "mixed_b":
        b = b.to(other)
    elif what == "mixed_c":
        c = values((M, N), other, gen)
    elif what == "rank1":
        a = a[0]
    elif what == "k_mismatch":
        b = values((K + draw(st.integers(1, 5)), N), dtype, gen)
    elif what == "bias_shape":
        bias = values(draw(st.sampled_from([(N + 1,), (1, N), (M, N)])), dtype, gen)
    elif what == "c_shape":
        c = values((M + 1, N), dtype, gen)
    elif what == "batch_mismatch":
        a, b = values((2, M, K), dtype, gen), values((3, K, N), dtype, gen)
    elif what == "unmergeable_batch":  # 5 batch dims, none mergeable (a's are permuted)
        a = values((2, 2, 2, 2, 2, K, M), dtype, gen).permute(4, 3, 2, 1, 0, 6, 5)
        b = values((2, 2, 2, 2, 2, K, N), dtype, gen)
    elif what == "activation":
        options["activation"] = draw(st.sampled_from(["tanh", "GELU", "", "relu6"]))
    elif what == "max_threads":
        options["max_threads"] = draw(st.sampled_from([0, 32, 64, 127]))
    return what, [a, b, bias, c], options


# ----------------------------------------------------------------------------- sdpa

# attention.metal's (E, Ev) instantiations (kHeadDims, attention_plan.cpp, which picks the
# cheapest that holds): (D, D) for these D, and (192, 128), (576, 512) (multi-head latent
# attention's absorbed form, the forward only: the backward takes head dims up to 512).
ATTN_HEAD_DIMS = (32, 40, 64, 72, 80, 96, 128, 160, 192, 256, 512, 576)
ATTN_PAIRS = tuple((d, d) for d in ATTN_HEAD_DIMS) + ((192, 128), (576, 512))
MAX_HEAD_DIM = 576  # kMaxHeadDim
MAX_BACKWARD_HEAD_DIM = 512  # kMaxBackwardHeadDim
ATTN_BQ = 32  # query rows per threadgroup
ATTN_BK = (8, 16, 32)  # key tile: steel_attn_bk(head dims, dtype), params.h
# (L rounded up to BQ) x S x (DE + DV) a drawn call may cost (~33M a second): ~0.2 s.
ATTN_BUDGET = 6_000_000


def _instantiation(E, Ev):
    return min(((de, dv) for de, dv in ATTN_PAIRS if de >= E and dv >= Ev), key=sum)


@functools.cache
def head_dims(hi=MAX_HEAD_DIM):
    """E on an instantiated size, one either side, 8 either side, or anything in 1..hi."""
    dims = [d for d in ATTN_HEAD_DIMS if d <= hi]
    near = sorted({d + x for d in dims for x in (-8, -1, 0, 1, 8) if 1 <= d + x <= hi})
    return st.one_of(st.sampled_from(dims), st.sampled_from(near), st.integers(1, hi))


def _mla_pairs(hi):
    """The latent-attention pairs a draw picks now and then: the trained form (192, 128) and,
    for the forward, the absorbed ones (576, 512) and (576, 576)."""
    return st.sampled_from([p for p in [(192, 128), (576, 512), (576, 576)] if max(p) <= hi])


@dataclass(frozen=True)
class MaskSpec:
    """attn_mask: bool (True keeps) or additive of `dtype`, of a shape that broadcasts to
    [*batch, Hq, L, S], laid out by `layout` (transposed masks: S before L in memory).

    fill: "random" (bool: keep with probability `keep`; additive: N(0, 2^2)), "rows" (some rows
    hide every key: False, -inf, or finfo.min), "cols" (padded keys, Hugging Face style: False,
    -inf or finfo.min on trailing keys), "neg_inf" (additive: scattered -inf entries), "all"
    (every row hides every key).
    hide: "-inf", "min" (finfo(mask dtype).min), or "min:<dtype>" (finfo(dtype).min stored in the
    mask's dtype: a float32 mask built for a float16 or bfloat16 model, -inf where the mask's
    dtype cannot hold it).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout
    fill: str
    keep: float
    hide: str  # what hides a key in an additive mask (see above)


@dataclass(frozen=True)
class SdpaCall:
    """torch_steel.sdpa(q, k, v, attn_mask, is_causal=, scale=, enable_gqa=, sinks=, softcap=,
    window=, causal_align=, return_lse=True) with q [*batch, Hq, L, E], k [*kv_batch, Hkv, S, E],
    v [*kv_batch, Hkv, S, Ev] (kv_batch is batch or broadcasts to it)."""

    dtype: torch.dtype
    batch: tuple[int, ...]
    kv_batch: tuple[int, ...]
    Hq: int
    Hkv: int
    L: int
    S: int
    E: int
    Ev: int
    q_layout: Layout
    k_layout: Layout
    v_layout: Layout
    mask: MaskSpec | None
    is_causal: bool
    causal_align: str
    window: tuple[int, int] | None
    sinks: tuple[torch.dtype, Layout] | None
    softcap: float | None
    scale: float | None
    seed: int
    # q, k, v are one fused projection [*batch, L, 3, H, E] split and transposed (L == S,
    # Hq == Hkv, E == Ev): three BLHD views of one buffer, laid out by q_layout (rank + 1)
    packed: bool = False
    # v is k[..., :Ev], a view of k's first Ev features (multi-head latent attention's latent
    # cache: the plan's kv_alias reads V from K's tile); v_layout unused
    kv_alias: bool = False

    def kwargs(self):
        """The keyword arguments of torch_steel.sdpa besides the tensors."""
        return {"is_causal": self.is_causal, "scale": self.scale,
                "enable_gqa": self.Hq != self.Hkv, "softcap": self.softcap,
                "window": self.window, "causal_align": self.causal_align}  # fmt: skip

    def build(self):
        """({q, k, v, attn_mask, sinks}, [Guarded])."""
        gen = torch.Generator().manual_seed(self.seed)
        if self.packed:
            shape = (*self.batch, self.L, 3, self.Hq, self.E)
            qkv = guarded("qkv", shape, self.dtype, self.q_layout, gen)
            guards = [qkv]
            q, k, v = (x.transpose(-2, -3) for x in qkv.tensor.unbind(-3))
            t = {"q": q, "k": k, "v": v, "attn_mask": None, "sinks": None}
        else:
            q = guarded("q", (*self.batch, self.Hq, self.L, self.E), self.dtype, self.q_layout,
                        gen)  # fmt: skip
            k = guarded("k", (*self.kv_batch, self.Hkv, self.S, self.E), self.dtype,
                        self.k_layout, gen)  # fmt: skip
            guards = [q, k]
            t = {"q": q.tensor, "k": k.tensor, "v": k.tensor[..., : self.Ev], "attn_mask": None,
                 "sinks": None}  # fmt: skip
            if not self.kv_alias:
                v = guarded("v", (*self.kv_batch, self.Hkv, self.S, self.Ev), self.dtype,
                            self.v_layout, gen)  # fmt: skip
                guards.append(v)
                t["v"] = v.tensor
        if self.mask is not None:
            m = self.mask
            fill = _mask_fill(m, gen)
            g = guarded("attn_mask", m.shape, m.dtype, m.layout, gen, fill=fill)
            guards.append(g)
            t["attn_mask"] = g.tensor
        if self.sinks is not None:
            g = sink_values(self.sinks, self.Hq, gen)
            guards.append(g)
            t["sinks"] = g.tensor
        return t, guards


# Sinks: N(0, 2^2), or near +30 (the sink takes nearly all the weight, out is tiny, lse ~ 30),
# -30 (it takes none), or +-30 by head.
_SINK_FILL = {"+30": lambda x: 30 + x / 4, "-30": lambda x: x / 4 - 30,
              "pm30": lambda x: torch.where(x >= 0, 30.0, -30.0)}  # fmt: skip


def sink_values(sinks, Hq, gen):
    """The Guarded sinks [Hq] of a drawn (dtype, layout[, level]): level None (N(0, 2^2)),
    "+30", "-30" or "pm30"."""
    dtype, layout, *level = sinks
    fill = _SINK_FILL[level[0]] if level and level[0] else None
    return guarded("sinks", (Hq,), dtype, layout, gen, scale=2.0, fill=fill)


@functools.cache
def _sink_spec(dtype):
    """(dtype, layout, level) of sinks for calls of `dtype`, or None (three times in four)."""
    levels = st.sampled_from([None, None, None, "+30", "-30", "pm30"])
    spec = st.tuples(st.sampled_from([dtype, torch.float32]), layouts(1), levels)
    return st.one_of(st.none(), st.none(), st.none(), spec)


_HIDE = {"-inf": float("-inf"), "min:float16": torch.finfo(torch.float16).min,
         "min:bfloat16": torch.finfo(torch.bfloat16).min}  # fmt: skip


def _mask_fill(m, gen):
    """The fill function of guarded() for a MaskSpec (applied to the base values)."""
    boolean = m.dtype == torch.bool

    def fill(base):
        shape = base.shape
        if boolean:
            keep = torch.rand(shape, generator=gen) < m.keep
        else:
            vals = torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0
            hide = _HIDE[m.hide] if m.hide in _HIDE else torch.finfo(m.dtype).min
        if m.fill == "rows":
            rows = torch.rand(shape[-2], generator=gen) < 0.3
            sel = rows[:, None].expand(shape)
        elif m.fill == "cols":
            cut = int(torch.randint(0, shape[-1] + 1, (), generator=gen))
            sel = (torch.arange(shape[-1]) >= cut).expand(shape)
        elif m.fill == "neg_inf":
            sel = torch.rand(shape, generator=gen) < 0.2
        elif m.fill == "all":
            sel = torch.ones(shape, dtype=torch.bool)
        else:
            sel = torch.zeros(shape, dtype=torch.bool)
        if boolean:
            return keep & ~sel
        return vals.masked_fill(sel, hide)

    return fill


@st.composite
def _mask_specs(draw, dtype, batch, Hq, L, S):
    full = (*batch, Hq, L, S)
    kind = draw(st.sampled_from(["bool", "same", "float32"]))
    mdtype = {"bool": torch.bool, "same": dtype, "float32": torch.float32}[kind]
    rank = draw(st.integers(2, len(full)))
    shape = tuple(s if draw(st.booleans()) or s == 1 else 1 for s in full[len(full) - rank :])
    if draw(st.booleans()):  # the common ones: [L, S], [B, 1, L, S], [1, H, 1, S]...
        shape = (*shape[:-2], L, S) if draw(st.booleans()) else (*shape[:-1], S)
    nd = len(shape)
    transposed = (*range(nd - 2), nd - 1, nd - 2)
    layout = draw(layouts(nd, orders=[transposed]))
    fill = draw(st.sampled_from(["random", "random", "rows", "cols", "all"]
                                + ([] if kind == "bool" else ["neg_inf"])))  # fmt: skip
    keep = draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]))
    hide = draw(st.sampled_from(["-inf", "min", "min", "min:float16", "min:bfloat16"]))
    return MaskSpec(mdtype, shape, layout, fill, keep, hide)


@st.composite
def sdpa_calls(draw, dtypes=DTYPES, max_L=300, max_S=300, max_head_dim=MAX_HEAD_DIM):
    """A steel::sdpa forward call in the plan's envelope (served, not refused); max_head_dim:
    MAX_BACKWARD_HEAD_DIM for the backward's calls."""
    dtype = draw(st.sampled_from(dtypes))
    E = draw(head_dims(max_head_dim))
    Ev = draw(st.one_of(st.just(E), st.just(E), head_dims(max_head_dim),
                        st.just(128 if E > 160 else E)))  # fmt: skip
    mla = draw(st.integers(0, 9)) == 0
    if mla:
        E, Ev = draw(_mla_pairs(max_head_dim))
    # now and then no query rows (an empty result), or no keys (every row sees nothing)
    L = 0 if draw(st.integers(0, 15)) == 0 else draw(sizes((ATTN_BQ,), max_L))
    S = 0 if draw(st.integers(0, 15)) == 0 else draw(sizes(ATTN_BK, max_S))
    Hkv = draw(st.sampled_from([1, 1, 2, 3]))
    group = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    if mla and draw(st.booleans()):  # one latent KV head shared by 16 query heads
        Hkv, group = 1, 16
    batch = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.sampled_from([0, 1, 1, 2]))))
    de, dv = _instantiation(E, Ev)

    def cost():
        return math.prod(batch) * Hkv * group * -(-L // ATTN_BQ) * ATTN_BQ * S * (de + dv)

    while cost() > ATTN_BUDGET and math.prod(batch) > 1:
        batch = tuple(1 for _ in batch)
    while cost() > ATTN_BUDGET and Hkv * group > 1:
        Hkv, group = (1, group) if Hkv > 1 else (1, group // 2)
    while cost() > ATTN_BUDGET and S > 1:
        S = max(1, S // 2)
    while cost() > ATTN_BUDGET and L > 1:
        L = max(1, L // 2)
    kv_batch = batch
    if batch and draw(st.integers(0, 4)) == 0:  # k, v broadcast over the batch
        kv_batch = tuple(1 for _ in batch)
    nd = len(batch) + 3
    packed = draw(st.integers(0, 7)) == 0
    if packed:  # a fused QKV projection: one length, one head count, one head dim
        S = L = min(L, S)
        group, kv_batch = 1, batch
        E = Ev = min(E, Ev)
    Hq = Hkv * group
    blhd = (*range(nd - 3), nd - 2, nd - 3, nd - 1)  # [B, L, H, E] projections transposed
    q_layout = draw(layouts(nd + packed, orders=[blhd] if not packed else ()))
    k_layout = draw(layouts(nd, orders=[blhd]))
    v_layout = draw(st.one_of(st.just(k_layout), layouts(nd, orders=[blhd])))
    # V a view of K's first Ev features: the latent cache's case, and any other Ev <= E
    kv_alias = not packed and Ev <= E and draw(st.integers(0, 1 if mla else 7)) == 0
    mask = draw(st.one_of(st.none(), _mask_specs(dtype, batch, Hq, L, S)))
    is_causal = draw(st.booleans())
    causal_align = draw(st.sampled_from(["top_left", "bottom_right"]))
    side = st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 400))
    window = draw(st.one_of(st.none(), st.tuples(side, side)))
    sinks = draw(_sink_spec(dtype))
    softcap = draw(st.sampled_from([None, None, None, 0.0, 1.0, 1.0, 5.0, 30.0, 50.0]))
    scale = draw(st.sampled_from([None, None, None, 0.125, 1.0, 0.02, -0.3, 0.0, 2.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return SdpaCall(dtype, batch, kv_batch, Hq, Hkv, L, S, E, Ev, q_layout, k_layout, v_layout,
                    mask, is_causal, causal_align, window, sinks, softcap, scale, seed,
                    packed, kv_alias)  # fmt: skip


def _one_more_key(layout, dim):
    """`layout` for one more key along `dim`: a view of a cache (pad on the key dim) keeps its
    strides, one key less of the cache unused; without pad the strides grow (torch.cat)."""
    if layout.expand[dim] or layout.pad[dim] < layout.step[dim]:
        return layout
    pad = list(layout.pad)
    pad[dim] -= layout.step[dim]
    return replace(layout, pad=tuple(pad))


def decode_stream(call, steps):
    """`call` and the `steps` calls after it of a decode stream: one more key each, every key
    and value a cache view whose strides stay where its layout has pad on the key dim to give
    (else grown, as by torch.cat), the mask over the keys alike. So the plan cache rewrites one
    cached plan for each length (decode_plan.cpp: set_decode_length); values and mask are
    drawn afresh per call (the seed's values at the new shapes)."""
    calls = [call]
    for _ in range(steps):
        c = calls[-1]
        mask = c.mask
        if mask is not None and mask.shape[-1] == c.S and c.S != 1:
            m_dim = len(mask.shape) - 1
            mask = replace(mask, shape=(*mask.shape[:-1], c.S + 1),
                           layout=_one_more_key(mask.layout, m_dim))  # fmt: skip
        s_dim = len(c.kv_batch) + 1
        calls.append(replace(c, S=c.S + 1, k_layout=_one_more_key(c.k_layout, s_dim),
                             v_layout=_one_more_key(c.v_layout, s_dim), mask=mask))  # fmt: skip
    return calls


SDPA_REFUSALS = ("float64", "mixed_k", "rank", "rank2", "head_dim", "e_mismatch", "heads",
                 "dropout", "mask_dtype", "mask_shape", "sinks_shape", "sinks_dtype",
                 "unmergeable_batch", "batch_mismatch", "max_threads")  # fmt: skip


@st.composite
def sdpa_refusals(draw):
    """(what, run_op tensors [q, k, v, attn_mask, sinks], options) that attention_plan.cpp
    must refuse."""
    what = draw(st.sampled_from(SDPA_REFUSALS))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    L, S, E = draw(sizes((32,), 70)), draw(sizes((8, 16), 70)), draw(st.sampled_from([8, 64, 65]))
    q = values((B, H, L, E), dtype, gen)
    k, v = values((B, H, S, E), dtype, gen), values((B, H, S, E), dtype, gen)
    mask = sinks = None
    options = {"is_causal": draw(st.booleans()), "scale": 0.125}
    other = draw(st.sampled_from([d for d in DTYPES if d != dtype]))
    if what == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif what == "mixed_k":
        k = k.to(other)
    elif what == "rank":
        k, v = k[0], v[0]
    elif what == "rank2":
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    elif what == "head_dim":
        E = draw(st.integers(577, 640))  # above kMaxHeadDim (576, MLA), attention_plan.cpp
        q, k, v = (values((1, 1, 3, E), dtype, gen) for _ in range(3))
    elif what == "e_mismatch":
        k = values((B, H, S, E + 1), dtype, gen)
    elif what == "heads":
        q = values((B, 5, L, E), dtype, gen)
        k, v = values((B, 2, S, E), dtype, gen), values((B, 2, S, E), dtype, gen)
    elif what == "dropout":  # p < 1 is served (the prefill kernel when decode would not be)
        options["dropout_p"] = draw(st.sampled_from([1.0, 1.5]))
    elif what == "mask_dtype":
        if draw(st.booleans()) or dtype == torch.float32:
            mask = torch.zeros(L, S, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
        else:  # an additive mask of a third float dtype: neither q's nor float32
            third = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
            mask = torch.zeros(L, S, dtype=third)
    elif what == "mask_shape":
        mask = torch.ones(L + 1, S, dtype=torch.bool)
    elif what == "sinks_shape":
        sinks = values((H + 1,), dtype, gen)
    elif what == "sinks_dtype":
        third = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}
        sinks = values((H,), third.get(dtype, torch.float64), gen)
    elif what == "unmergeable_batch":  # 5 batch dims that do not merge (q's are permuted)
        q = values((2, 2, 2, 2, 2, H, L, E), dtype, gen).permute(4, 3, 2, 1, 0, 5, 6, 7)
        k = values((2, 2, 2, 2, 2, H, S, E), dtype, gen)
        v = values((2, 2, 2, 2, 2, H, S, E), dtype, gen)
    elif what == "batch_mismatch":
        k = values((B + 1, H, S, E), dtype, gen)
    elif what == "max_threads":
        options["max_threads"] = draw(st.sampled_from([0, 32, 64, 127]))
    return what, [q, k, v, mask, sinks], options


# ----------------------------------------------------------------------------- sdpa_varlen


@dataclass(frozen=True)
class VarlenCall:
    """torch_steel.sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p=, is_causal=, scale=, sinks=, softcap=, window=, causal_align=, seed=,
    return_lse=True) with q [sum(lq), Hq, E], k [sum(lk), Hkv, E], v [sum(lk), Hkv, Ev].

    extra_q / extra_k: how far max_seqlen_* exceed the longest sequence (a bound, as flash-attn
    allows); packed: q, k, v are the three slices of one fused [tokens, 3, H, E] projection
    (lq == lk, Hq == Hkv, E == Ev), laid out by q_layout (rank 4).

    page_size > 0: a paged KV cache instead (varlen_attn's convention): key and value are pools
    [pages, page_size, Hkv, E|Ev] laid out by k_layout / v_layout (rank 4), sequence b's lk[b]
    keys on its pages in a shuffled order (block_table), spare_pages more pages in the pool
    than the sequences use; the table's entries past a sequence's pages hold a page number
    outside the pool, which nothing may read. num_splits: the decode kernels' partitions
    (None: the plan's choice)."""

    dtype: torch.dtype
    lq: tuple[int, ...]
    lk: tuple[int, ...]
    Hq: int
    Hkv: int
    E: int
    Ev: int
    q_layout: Layout
    k_layout: Layout
    v_layout: Layout
    extra_q: int
    extra_k: int
    is_causal: bool
    causal_align: str
    window: tuple[int, int] | None
    sinks: tuple[torch.dtype, Layout] | None
    softcap: float | None
    scale: float | None
    dropout_p: float
    seed: int
    packed: bool = False
    page_size: int = 0
    spare_pages: int = 0
    num_splits: int | None = None
    shared_pages: int = 0  # sequences b > 0 start with up to this many of sequence 0's pages
    # storage offset of cu_seqlens_q / _k, and of the block table and seqused_k (guarded views)
    index_offset: int = 0
    kv_alias: bool = False  # v (or its pool) is k[..., :Ev], as SdpaCall's; v_layout unused

    def cu_seqlens(self):
        """cu_seqlens_q, cu_seqlens_k: views at storage offset index_offset of buffers whose
        other elements are -7 (a kernel reading past the view sees nonsense offsets)."""

        def offsets(lengths):
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            buffer = torch.full((self.index_offset + len(cu) + 3,), -7, dtype=torch.int32)
            view = buffer[self.index_offset : self.index_offset + len(cu)]
            return view.copy_(cu)

        return offsets(self.lq), offsets(self.lk)

    def max_seqlens(self):
        return max(self.lq) + self.extra_q, max(self.lk) + self.extra_k

    def kwargs(self):
        """The keyword arguments of torch_steel.sdpa_varlen besides tensors and lengths."""
        return {"dropout_p": self.dropout_p, "is_causal": self.is_causal, "scale": self.scale,
                "softcap": self.softcap, "window": self.window,
                "causal_align": self.causal_align, "seed": 1234,
                "num_splits": self.num_splits}  # fmt: skip

    def pages_of(self):
        """Pages per sequence (a sequence of no keys still has a table row)."""
        return [-(-n // self.page_size) for n in self.lk]

    def build(self):
        """({q, k, v, sinks, block_table, seqused_k}, [Guarded]); k and v are the pools when
        paged (block_table and seqused_k None otherwise)."""
        gen = torch.Generator().manual_seed(self.seed)
        Tq, Tk = sum(self.lq), sum(self.lk)
        if self.page_size:
            pages = self.pages_of()
            pool = sum(pages) + self.spare_pages
            gq = guarded("q", (Tq, self.Hq, self.E), self.dtype, self.q_layout, gen)
            slots = (pool, self.page_size, self.Hkv)
            gk = guarded("k_pool", (*slots, self.E), self.dtype, self.k_layout, gen)
            gv = None if self.kv_alias else guarded("v_pool", (*slots, self.Ev), self.dtype,
                                                    self.v_layout, gen)  # fmt: skip
            order = torch.randperm(pool, generator=gen).to(torch.int32)
            table = torch.full((len(self.lk), max(pages) + 1), pool + 7, dtype=torch.int32)
            start = 0
            for b, n in enumerate(pages):
                table[b, :n] = order[start : start + n]
                start += n
                shared = min(self.shared_pages, n, pages[0]) if b else 0
                table[b, :shared] = table[0, :shared]  # a shared prefix (prefix caching)
            used = torch.tensor(self.lk, dtype=torch.int32)
            c = Layout.contiguous(2)
            at = Layout(c.order, c.step, c.pad, self.index_offset, c.expand)
            gt = Guarded("block_table", table, at, tuple(table.shape))
            gu = Guarded("seqused_k", used, Layout((0,), (1,), (0,), self.index_offset, (False,)),
                         tuple(used.shape))  # fmt: skip
            t = {"q": gq.tensor, "k": gk.tensor, "v": gk.tensor[..., : self.Ev], "sinks": None,
                 "block_table": gt.tensor, "seqused_k": gu.tensor}  # fmt: skip
            guards = [gq, gk, gt, gu]
            if gv is not None:
                guards.append(gv)
                t["v"] = gv.tensor
            self._sinks(t, guards, gen)
            return t, guards
        if self.packed:
            qkv = guarded("qkv", (Tq, 3, self.Hq, self.E), self.dtype, self.q_layout, gen)
            guards = [qkv]
            q, k, v = qkv.tensor.unbind(1)
        else:
            gq = guarded("q", (Tq, self.Hq, self.E), self.dtype, self.q_layout, gen)
            gk = guarded("k", (Tk, self.Hkv, self.E), self.dtype, self.k_layout, gen)
            guards = [gq, gk]
            q, k, v = gq.tensor, gk.tensor, gk.tensor[..., : self.Ev]
            if not self.kv_alias:
                gv = guarded("v", (Tk, self.Hkv, self.Ev), self.dtype, self.v_layout, gen)
                guards.append(gv)
                v = gv.tensor
        t = {"q": q, "k": k, "v": v, "sinks": None, "block_table": None, "seqused_k": None}
        self._sinks(t, guards, gen)
        return t, guards

    def _sinks(self, t, guards, gen):
        if self.sinks is not None:
            g = sink_values(self.sinks, self.Hq, gen)
            guards.append(g)
            t["sinks"] = g.tensor


@st.composite
def varlen_calls(draw, dtypes=DTYPES, max_len=300, max_head_dim=MAX_HEAD_DIM):
    """A steel::sdpa_varlen forward call in varlen_plan.cpp's envelope: 1 to 5 sequences of
    lengths on and off the tile edges, empty ones included, lq and lk independent;
    max_head_dim: MAX_BACKWARD_HEAD_DIM for the backward's calls."""
    dtype = draw(st.sampled_from(dtypes))
    E = draw(head_dims(max_head_dim))
    Ev = draw(st.one_of(st.just(E), st.just(E), head_dims(max_head_dim)))
    mla = draw(st.integers(0, 9)) == 0
    if mla:
        E, Ev = draw(_mla_pairs(max_head_dim))
    n = draw(st.integers(1, 5))
    length = st.one_of(st.just(0), sizes((ATTN_BQ,) + ATTN_BK, max_len))
    lq = [draw(length) for _ in range(n)]
    lk = [draw(length) for _ in range(n)]
    if sum(lq) and draw(st.integers(0, 3)) == 0:
        lk = list(lq)  # self-attention over the packed batch
    if sum(lq) == 0:  # the plan needs a sequence to hold the query tokens: at least one
        lq[0] = draw(sizes((ATTN_BQ,), max_len))
    Hkv = draw(st.sampled_from([1, 1, 2, 3]))
    group = draw(st.sampled_from([1, 1, 2, 4, 8]))
    if mla and draw(st.booleans()):  # one latent KV head shared by 16 query heads
        Hkv, group = 1, 16
    de, dv = _instantiation(E, Ev)

    def cost():  # padded rows x keys x head dims over the sequences and heads
        tiles = sum(-(-a // ATTN_BQ) * ATTN_BQ * b for a, b in zip(lq, lk))
        return Hkv * group * tiles * (de + dv)

    while cost() > ATTN_BUDGET and Hkv * group > 1:
        Hkv, group = (1, group) if Hkv > 1 else (1, group // 2)
    while cost() > ATTN_BUDGET:
        lq, lk = [(a + 1) // 2 for a in lq], [b // 2 for b in lk]
    packed = draw(st.integers(0, 7)) == 0
    if packed:
        lk, group, E = list(lq), 1, min(E, Ev)
        Ev = E
    Hq = Hkv * group
    heads_outer = (1, 0, 2)  # [H, tokens, D] in memory
    q_layout = draw(layouts(4 if packed else 3, orders=[] if packed else [heads_outer]))
    k_layout = draw(layouts(3, orders=[heads_outer]))
    v_layout = draw(st.one_of(st.just(k_layout), layouts(3, orders=[heads_outer])))
    kv_alias = not packed and Ev <= E and draw(st.integers(0, 1 if mla else 7)) == 0
    extra = st.sampled_from([0, 0, 0, 1, 31, 100])
    is_causal = draw(st.booleans())
    causal_align = draw(st.sampled_from(["top_left", "bottom_right"]))
    side = st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, 400))
    window = draw(st.one_of(st.none(), st.tuples(side, side)))
    sinks = draw(_sink_spec(dtype))
    softcap = draw(st.sampled_from([None, None, None, 1.0, 1.0, 5.0, 30.0]))
    scale = draw(st.sampled_from([None, None, None, 0.125, 1.0, -0.3, 0.0, 2.0]))
    dropout_p = draw(st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.5]))
    seed = draw(st.integers(0, 2**31 - 1))
    return VarlenCall(dtype, tuple(lq), tuple(lk), Hq, Hkv, E, Ev, q_layout, k_layout, v_layout,
                      draw(extra), draw(extra), is_causal, causal_align, window, sinks, softcap,
                      scale, dropout_p, seed, packed, kv_alias=kv_alias,
                      index_offset=draw(_OFFSET))  # fmt: skip


@st.composite
def paged_calls(draw, dtypes=DTYPES, max_kv=2000):
    """sdpa_varlen against a paged KV cache (the decode kernels, varlen_plan.cpp's paged
    envelope): a varlen_calls() draw whose sequences get 0 to 8 query rows (now and then a
    chunk of prefill rows) and 0 to max_kv keys on pages of 1 to 64 slots, no dropout, any
    num_splits."""
    call = draw(varlen_calls(dtypes))
    n = len(call.lq)
    rows = st.one_of(st.integers(0, 8), st.integers(1, 2), sizes((ATTN_BQ,), 100))
    lq = [draw(rows) for _ in range(n)]
    if sum(lq) == 0:
        lq[0] = 1
    lk = [draw(st.one_of(st.just(0), sizes((16, 64, 256), max_kv))) for _ in range(n)]
    page_size = draw(st.sampled_from([16, 16, 64, 64, 1, 7, 32]))
    group = call.Hq // call.Hkv
    de, dv = _instantiation(call.E, call.Ev)

    def cost():  # the decode kernel pads a sequence's rows x group to blocks of 32
        blocks = sum(-(-a * group // ATTN_BQ) * ATTN_BQ * b for a, b in zip(lq, lk))
        return call.Hkv * blocks * (de + dv)

    while cost() > ATTN_BUDGET:
        lk = [b // 2 for b in lk]
    k_layout = draw(layouts(4))
    v_layout = draw(st.one_of(st.just(k_layout), layouts(4)))
    return replace(
        call, lq=tuple(lq), lk=tuple(lk), k_layout=k_layout, v_layout=v_layout, packed=False,
        dropout_p=0.0, page_size=page_size,
        spare_pages=max(draw(st.sampled_from([0, 1, 5])), int(sum(lk) == 0)),  # a pool not empty
        num_splits=draw(st.sampled_from([None, None, 1, 2, 3, 32])),
        shared_pages=draw(st.sampled_from([0, 0, 0, 1, 2, 1000])),
        index_offset=draw(_OFFSET),
        q_layout=call.q_layout if not call.packed else Layout.contiguous(3),
    )  # fmt: skip


def paged_stream(call, steps):
    """`call` (paged_calls()) and the `steps` calls after it of a paged decode stream: one more
    key in every sequence that has any (max_seqlen_k one more too), the pools and block table
    the same shape while no sequence starts a page, so that the plan cache hands out the first
    call's plan (varlen_plan.cpp paged_length_class); values drawn afresh per call."""
    calls = [call]
    for _ in range(steps):
        c = calls[-1]
        calls.append(replace(c, lk=tuple(n + 1 if n else 0 for n in c.lk)))
    return calls


VARLEN_REFUSALS = ("float64", "mixed_v", "rank", "heads", "head_dim", "cu_dtype", "cu_counts",
                   "no_max_seqlen", "no_rows", "dropout_one")  # fmt: skip


@st.composite
def varlen_refusals(draw):
    """(what, run_op tensors [q, k, v, cu_seqlens_q, cu_seqlens_k, sinks], options) that
    varlen_plan.cpp must refuse."""
    what = draw(st.sampled_from(VARLEN_REFUSALS))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lengths = [draw(sizes((32,), 70)) for _ in range(draw(st.integers(1, 3)))]
    T, H, E = sum(lengths), draw(st.integers(1, 3)), draw(st.sampled_from([8, 64, 65]))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    q, k, v = (values((T, H, E), dtype, gen) for _ in range(3))
    cu_q, cu_k = cu, cu.clone()
    options = {"scale": 0.125, "max_seqlen_q": max(lengths), "max_seqlen_k": max(lengths)}
    if what == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif what == "mixed_v":
        v = v.to(draw(st.sampled_from([d for d in DTYPES if d != dtype])))
    elif what == "rank":
        q = q.unsqueeze(0)
    elif what == "heads":
        q = values((T, 5, E), dtype, gen)
        k, v = values((T, 2, E), dtype, gen), values((T, 2, E), dtype, gen)
    elif what == "head_dim":
        E = draw(st.integers(577, 640))  # above kMaxHeadDim (576, MLA), attention_plan.cpp
        q, k, v = (values((T, 1, E), dtype, gen) for _ in range(3))
    elif what == "cu_dtype":
        cu_k = cu_k.to(torch.int64)
    elif what == "cu_counts":
        cu_k = torch.cat([cu_k, cu_k[-1:]])
    elif what == "no_max_seqlen":
        del options[draw(st.sampled_from(["max_seqlen_q", "max_seqlen_k"]))]
    elif what == "no_rows":
        options["max_seqlen_q"] = 0
    elif what == "dropout_one":
        options["dropout_p"] = 1.0
    return what, [q, k, v, cu_q, cu_k, None], options


# ----------------------------------------------------------------------------- quantized KV

QUANT_FORMATS = ("int8", "int8_g32", "int8_g64", "int8_g128", "q4_g32", "q4_g64")
QUANT_BITS_GROUP = {"int8": (8, 0), "int8_g32": (8, 32), "int8_g64": (8, 64),
                    "int8_g128": (8, 128), "q4_g32": (4, 32), "q4_g64": (4, 64)}  # fmt: skip


def quant_formats(E):
    """The formats a head dim E can take (kv.py: E a multiple of the group, even for 4-bit)."""
    return [f for f, (bits, g) in QUANT_BITS_GROUP.items()
            if (not g or E % g == 0) and (bits == 8 or E % 2 == 0)]  # fmt: skip


@dataclass(frozen=True)
class QuantCall:
    """`base` (an SdpaCall, or a VarlenCall, paged or not) with its key and value quantized:
    torch_steel.kv.quantize of base's K and V values in k_format / v_format with scales (and
    mins) of k_scale_dtype / v_scale_dtype. Each of the six tensors (k data, scales, mins, v
    data, scales, mins) is a guarded view laid out by `layouts` (storage offsets, strides,
    padding, transposed leading dims). rows: "random"; "zero" (some rows of a head all zeros:
    scale 0); "constant" (some rows one value: the 4-bit range is 0, x = min)."""

    base: SdpaCall | VarlenCall
    k_format: str
    v_format: str
    k_scale_dtype: torch.dtype
    v_scale_dtype: torch.dtype
    layouts: tuple[Layout, ...]
    rows: str
    seed: int

    def build(self):
        """({q, k, v (QuantizedKV), ...base's other tensors}, [Guarded]); k and v's float
        values are base's (base's guards of them dropped: they are not passed)."""
        from torch_steel.kv import QuantizedKV, quantize

        t, guards = self.base.build()
        guards = [g for g in guards if g.name not in ("k", "v", "k_pool", "v_pool")]
        gen = torch.Generator().manual_seed(self.seed)
        it = iter(self.layouts)
        for name, fmt, sd in (("k", self.k_format, self.k_scale_dtype),
                              ("v", self.v_format, self.v_scale_dtype)):  # fmt: skip
            x = t[name].double()
            if self.rows != "random":
                rows = torch.rand(x.shape[:-1], generator=gen) < 0.3
                fill = 0.0 if self.rows == "zero" else float(torch.randn((), generator=gen))
                x = x.masked_fill(rows.unsqueeze(-1), fill)
            parts = []
            for part, tensor in zip(("data", "scales", "mins"), quantize(x, fmt, sd).tensors()):
                layout = next(it)
                if tensor is None:
                    parts.append(None)
                    continue
                g = Guarded(f"{name}_{part}", tensor, layout, tuple(tensor.shape))
                guards.append(g)
                parts.append(g.tensor)
            t[name] = QuantizedKV(*parts, fmt)
        return t, guards


@st.composite
def quant_calls(draw, dtypes=DTYPES):
    """A steel::sdpa_quantized_forward or sdpa_varlen_quantized_forward call (paged or packed):
    a base call of sdpa_calls() (k and v of q's batch shape: the quantized op takes no
    broadcasting), varlen_calls() or paged_calls() without dropout (inference only), head dims
    half the time on a multiple of 64 so that every format is open, formats drawn from what
    each head dim takes."""
    kind = draw(st.sampled_from(["sdpa", "sdpa", "varlen", "paged", "paged"]))
    if kind == "sdpa":
        base = draw(sdpa_calls(dtypes))
        base = replace(base, kv_batch=base.batch, kv_alias=False)
    else:
        base = draw(varlen_calls(dtypes) if kind == "varlen" else paged_calls(dtypes))
        base = replace(base, dropout_p=0.0, kv_alias=False)
    nd = len(base.batch) + 3 if kind == "sdpa" else 4 if kind == "paged" else 3
    if base.packed:  # a fused projection's q layout has a rank more: q on its own instead
        base = replace(base, q_layout=Layout.contiguous(nd if kind == "sdpa" else 3))
    base = replace(base, packed=False)
    if draw(st.booleans()):  # head dims every format takes: 64, or a multiple of 64 below
        base = replace(base, E=max(64, base.E // 64 * 64), Ev=max(64, base.Ev // 64 * 64))
    k_format = draw(st.sampled_from(quant_formats(base.E)))
    v_format = draw(st.sampled_from(quant_formats(base.Ev)))
    scale_dtypes = st.sampled_from([torch.float16, torch.float32])
    k_sd, v_sd = draw(scale_dtypes), draw(scale_dtypes)
    tensor_layouts = tuple(draw(layouts(nd, expandable=(), plain=0.5)) for _ in range(6))
    rows = draw(st.sampled_from(["random", "random", "zero", "constant"]))
    return QuantCall(base, k_format, v_format, k_sd, v_sd, tensor_layouts, rows,
                     draw(st.integers(0, 2**31 - 1)))  # fmt: skip
