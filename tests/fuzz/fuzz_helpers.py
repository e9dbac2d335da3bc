"""What every fuzz test shares: the two hypothesis settings (the fixed-seed subset of the default
run, and `-m fuzz`), running an op on the simulator in strict mode, and the refusal check."""

from __future__ import annotations

import functools
import heapq
import inspect
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch
from attn_helpers import score_error
from gemm_helpers import requires_planner, requires_simulator  # noqa: F401 (tests/fuzz/conftest.py: the path)
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import UnsatisfiedAssumption

import torch_steel
from torch_steel import sim
from torch_steel.errors import PlanRefused
from torch_steel.reference import visible

ROOT = Path(__file__).resolve().parents[2]
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def fixed(examples):
    """The default run: the same `examples` calls every time (derandomized, no database), no
    deadline (a simulator run takes 0.05 to 0.5 s)."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=_QUIET, print_blob=True)  # fmt: skip


def fuzz(kernels=None):
    """`-m fuzz`: TORCH_STEEL_FUZZ_EXAMPLES (default 2000) random calls per test, failures kept in
    the example database (.hypothesis/ at the repository root, or TORCH_STEEL_FUZZ_DB) and
    replayed first on the next run.

    With TORCH_STEEL_FUZZ_LOG set (bench/fuzz_campaign.py sets it), every example the test body
    runs appends a line to that file: the test, the kernels it exercised (`kernels(*args)`, a
    list of names; default the test's name), its seconds, its outcome (ok, fail, or rejected by
    assume) and, when it is a failure or among the test's 5 slowest so far, its arguments'
    repr (the whole recipe). So the campaign's counts are what ran, not what was asked for."""
    db = os.environ.get("TORCH_STEEL_FUZZ_DB", str(ROOT / ".hypothesis" / "examples"))
    chosen = settings(max_examples=int(os.environ.get("TORCH_STEEL_FUZZ_EXAMPLES", "2000")),
                      database=DirectoryBasedExampleDatabase(db), deadline=None,
                      suppress_health_check=_QUIET, print_blob=True)  # fmt: skip

    def apply(test):
        test = chosen(test)
        log = os.environ.get("TORCH_STEEL_FUZZ_LOG")
        if log:  # hypothesis runs test.hypothesis.inner_test per example (a documented hook)
            test.hypothesis.inner_test = _logged(test.hypothesis.inner_test, log, kernels)
        return test

    return apply


def _logged(body, log, kernels):
    name = f"{Path(inspect.getsourcefile(body)).name}::{body.__name__}"
    signature = inspect.signature(body)
    slowest = []  # the 5 longest seconds so far

    @functools.wraps(body)
    def run(*args, **kwargs):
        drawn = signature.bind(*args, **kwargs).arguments
        start = time.perf_counter()
        outcome = "fail"
        try:
            body(*args, **kwargs)
            outcome = "ok"
        except UnsatisfiedAssumption:
            outcome = "rejected"
            raise
        finally:
            seconds = time.perf_counter() - start
            line = {"test": name, "outcome": outcome, "seconds": round(seconds, 4)}
            if outcome != "rejected":
                line["kernels"] = list(kernels(**drawn)) if kernels else [body.__name__]
            slow = outcome == "ok" and (len(slowest) < 5 or seconds > slowest[0])
            if outcome == "fail" or slow:
                line["call"] = ", ".join(f"{k}={v!r}" for k, v in drawn.items())
                if slow:
                    heapq.heappush(slowest, seconds)
                    if len(slowest) > 5:
                        heapq.heappop(slowest)
            with open(log, "a") as f:
                f.write(json.dumps(line) + "\n")

    return run


fuzz_mark = pytest.mark.fuzz


class strict_sim:
    """Context: the "sim" backend with TORCH_STEEL_STRICT=1, so a refused plan raises
    PlanRefused instead of falling back to reference math (which would pass vacuously)."""

    def __enter__(self):
        self._previous = os.environ.get("TORCH_STEEL_STRICT")
        os.environ["TORCH_STEEL_STRICT"] = "1"
        self._backend = torch_steel.backend("sim")
        self._backend.__enter__()

    def __exit__(self, *exc):
        self._backend.__exit__(*exc)
        if self._previous is None:
            del os.environ["TORCH_STEEL_STRICT"]
        else:
            os.environ["TORCH_STEEL_STRICT"] = self._previous


def loss_weights(out_shape, lse_rows, dtype):
    """(grad_out, grad_lse) of the backward tests' loss <out, grad_out> + <lse, grad_lse>:
    float64 tensors holding values exactly representable in what the kernel receives (grad_out
    in the call's dtype, grad_lse in lse's float32), so that the float64 oracle differentiates
    the same loss as the kernel. Found by the eighth fuzz campaign (issue 31): a float64
    grad_out against the kernel's float16 one differs by 2^-12 of each row's |dO|, and a dv
    that sums 128 rows of dO to 0.17 (one visible key, P = 1) moved by 6.6e-4, twice the
    bound for a value of that size, with the kernel exact to its output rounding."""
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(out_shape, generator=gen, dtype=torch.float64).to(dtype).double()
    w = torch.linspace(-1, 1, lse_rows, dtype=torch.float64).float().double()
    return g, w


def assert_refused(op, tensors, options):
    """The plan refuses with a reason, and run_op raises PlanRefused carrying it (not a
    SimulatorError, not any other exception, not a crash)."""
    p = sim.plan(op, tensors, options)
    assert not p.ok, f"{op}: the plan accepted a call outside its envelope"
    assert p.reason.strip(), f"{op}: refused without a reason"
    with pytest.raises(PlanRefused) as info:
        sim.run_op(op, tensors, options)
    assert str(info.value).strip(), f"{op}: PlanRefused without a message"


EPS32 = 2.0**-24


def row_score_error(call, t, ref_scores):
    """Per query row, a bound on the fp32 error of the scores that matter.

    - the dot products: attn_helpers.score_error (4 sqrt(E) ulps of scale * max sum |q_d k_d|);
    - softcap: tanh in fp32 within a few ulps, times the cap: 8 * eps32 * softcap;
    - an additive mask is added in fp32 to scores of that size: one rounding of |s + m|, and
      the row max subtracted from it another, 2 * eps32 * (|s| + |m|) over the keys within 80
      nats of the row's max (the others weigh less than e^-80). A row of finfo.min
      (Hugging Face's padding) is then held only to not being NaN where the reference is not:
      in bfloat16 / float32 the mask swamps the scores altogether (see
      tests/attn/test_attention.py::test_finfo_min_padding_rows, which checks that row).
    ref_scores: the float64 scores after scale, softcap and mask, -inf where hidden.
    """
    err = score_error(t["q"], t["k"], call.scale)
    if call.softcap:
        err += 8 * EPS32 * call.softcap
    err = torch.full(ref_scores.shape[:-1], err, dtype=torch.float64)
    m = t["attn_mask"]
    if m is not None and m.dtype != torch.bool and ref_scores.shape[-1]:
        row_max = ref_scores.amax(-1, keepdim=True)
        near = ref_scores >= row_max - 80
        size = (ref_scores.abs() + m.double().abs()).nan_to_num(0.0, 0.0, 0.0)
        size = torch.where(near & torch.isfinite(ref_scores), size, torch.zeros_like(size))
        err = err + 2 * EPS32 * size.amax(-1)
    return err.unsqueeze(-1)


def reference_scores(call, t):
    """float64 scores as the reference forms them (after scale, softcap, additive mask; -inf
    for keys hidden by the bool mask, causal or the window), [*batch, Hq, L, S]."""
    q, k = t["q"].double(), t["k"].double()
    k = k.expand(*q.shape[:-3], *k.shape[-3:]).repeat_interleave(call.Hq // call.Hkv, -3)
    scale = 1.0 / math.sqrt(call.E) if call.scale is None else call.scale
    s = (q @ k.mT) * scale
    if call.softcap:
        s = call.softcap * torch.tanh(s / call.softcap)
    m = t["attn_mask"]
    if m is not None:
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    left, right = call.window or (-1, -1)
    bottom_right = call.causal_align == "bottom_right"
    seen = visible(call.L, call.S, call.is_causal, left, right, bottom_right, s.device)
    return s if seen is None else s.masked_fill(~seen, float("-inf"))
