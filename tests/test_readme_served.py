"""The README's "What is served" table, steel's column, held to the launch plans: the head dims
it lists are exactly the instantiations the planner picks, the dtypes it names plan and float64
does not, decode takes the rows it says, the backward's head-dim limit, and the M5 row's head
dims. (Each other row's behaviour is tested where docs/attention.md says; these are the cells a
planner change could make false without touching a kernel test.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from torch_steel import sim

sys.path.insert(0, str(Path(__file__).resolve().parent / "gemm"))
from gemm_helpers import M5, requires_planner  # noqa: E402

pytestmark = requires_planner

ROOT = Path(__file__).resolve().parents[1]
TAGS = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _table() -> dict[str, str]:
    """Row label -> steel's cell."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## What is served") :]
    section = section[: section.index("\n## ")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] and set(cells[0]) != {"-"}:
            rows[cells[0]] = cells[1]
    return rows


def _row(prefix: str) -> tuple[str, str]:
    (match,) = [(label, cell) for label, cell in _table().items() if label.startswith(prefix)]
    return match


def _listed_pairs() -> set[tuple[int, int]]:
    _, cell = _row("head dims")
    equal, rest = cell.split("(E = Ev)")
    pairs = {(int(e), int(e)) for e in re.findall(r"\d+", equal.replace("kernels for", ""))}
    pairs |= {(int(e), int(v)) for e, v in re.findall(r"(\d+)/(\d+)", rest)}
    return pairs


def _limit(cell: str, what: str) -> int:
    """N of "<what> <= N" in the cell."""
    return int(re.search(re.escape(what) + r"\s*<= (\d+)", cell).group(1))


def _t(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype)


def _forward(L, S, E, Ev, dtype=torch.float16, **options):
    q, k, v = _t(1, 2, L, E, dtype=dtype), _t(1, 2, S, E, dtype=dtype), _t(1, 2, S, Ev, dtype=dtype)
    return sim.plan("sdpa", [q, k, v, None, None], {"scale": 0.1, **options})


def _backward(E, Ev, dtype=torch.float16):
    q, k, v = (
        _t(1, 2, 24, E, dtype=dtype),
        _t(1, 2, 40, E, dtype=dtype),
        _t(1, 2, 40, Ev, dtype=dtype),
    )
    out = torch.empty(1, 2, 24, Ev, dtype=dtype)
    return sim.plan("sdpa_backward", [out, q, k, v, out, torch.empty(1, 2, 24), None, None, None],
                    {"scale": 0.1})  # fmt: skip


def _pair(kernel: str) -> tuple[int, int]:
    e, v = re.search(r"_e(\d+)_v(\d+)$", kernel).groups()
    return int(e), int(v)


def test_the_table_has_its_rows():
    assert len(_listed_pairs()) >= 14
    for prefix in ("head dims", "dtypes", "decode", "backward", "M5"):
        _row(prefix)


def test_the_listed_head_dims_are_exactly_the_instantiations():
    """Each listed pair plans its own kernel, every E, Ev up to the stated limit plans one of the
    listed pairs, and one past the limit is refused."""
    listed, (_, cell) = _listed_pairs(), _row("head dims")
    for E, Ev in listed:
        p = _forward(64, 64, E, Ev, decode=0)
        assert p.ok and _pair(p.dispatches[0].kernel) == (E, Ev), (E, Ev, p.reason)
    limit = _limit(cell, "E, Ev")
    picked = set()
    for E in range(1, limit + 1, 7):
        for Ev in (1, E, 128, limit):
            p = _forward(16, 16, E, Ev, decode=0)
            assert p.ok, p.reason
            picked.add(_pair(p.dispatches[0].kernel))
    assert picked <= listed
    assert not _forward(16, 16, limit + 1, 64, decode=0).ok


def test_the_listed_dtypes_plan_and_float64_does_not():
    _, cell = _row("dtypes")
    named = [NAMES[n] for n in re.findall(r"\b(float16|bfloat16|float32)\b", cell)]
    assert sorted(map(str, named)) == sorted(map(str, TAGS))
    for dtype in named:
        p = _forward(64, 64, 64, 64, dtype, decode=0)
        assert p.ok and f"_{TAGS[dtype]}_" in p.dispatches[0].kernel
    assert "float64: refused" in cell
    assert not _forward(64, 64, 64, 64, torch.float64).ok


def test_decode_takes_the_rows_it_says():
    label, _ = _row("decode")
    rows = _limit(label, "(")
    assert "decode" in _forward(rows, 512, 64, 64).dispatches[0].kernel
    assert "decode" not in _forward(rows + 1, 512, 64, 64).dispatches[0].kernel


def test_the_backward_head_dim_limit():
    _, cell = _row("backward")
    limit = _limit(cell, "head dims")
    assert _backward(limit, limit).ok
    over = [(E, Ev) for E, Ev in _listed_pairs() if max(E, Ev) > limit]
    assert over and all(not _backward(E, Ev).ok for E, Ev in over)


def test_the_m5_row_head_dims():
    _, cell = _row("M5")
    dims = [int(d) for d in re.findall(r"\d+", re.search(r"head dims ([\d, ]+)", cell).group(1))]
    others = sorted({E for E, Ev in _listed_pairs() if E == Ev and E <= 256} - set(dims))
    assert dims and others
    with sim.device(M5):
        for D in dims:
            for dtype in (torch.float16, torch.bfloat16):
                assert "_tensor_" in _forward(100, 100, D, D, dtype, decode=0).dispatches[0].kernel
                assert any("bwd_tensor" in d.kernel for d in _backward(D, D, dtype).dispatches)
            f32 = _forward(100, 100, D, D, torch.float32, decode=0).dispatches[0].kernel
            assert "_tensor_" not in f32
        for D in others:
            assert "_tensor_" not in _forward(100, 100, D, D, decode=0).dispatches[0].kernel
