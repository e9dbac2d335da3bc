"""The Metal host's op call (mps/host.h, what module.mm runs) without Metal:
tests/mps/host_record.cpp runs it with a recording encoder. Its record must be the plan the
simulator executes, its outputs the plan's allocations; a repeated call plans nothing and builds
no pipeline; and the op layer reaches it as on MPS (what bench/bench_overhead.py times)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_record_build  # noqa: E402

import torch_steel  # noqa: E402
from torch_steel import backends, metal, sim  # noqa: E402

GEMM = {"alpha": 1.0, "beta": 0.0, "activation": "none"}


@pytest.fixture(scope="module")
def recorder():
    try:
        module = host_record_build.extension()
    except Exception as error:  # no compiler or torch headers: nothing to run
        pytest.skip(f"the host recorder does not build: {error}")
    if module is None:
        pytest.skip("no C++ compiler")
    return module


def _expected_record(plan, slots):
    """What MetalBackend would be asked for `plan`, from the simulator's view of it."""
    lines = []
    for d in plan.dispatches:
        lines.append(f"pipeline {d.kernel}")
        for b in d.bindings:
            if b.kind == "tensor":
                t = slots[b.slot]
                lines.append(f"tensor {b.index} {b.slot} {t.storage_offset() * t.element_size()}")
            else:
                lines.append(f"bytes {b.index} {len(b.bytes)}")
        lines += [f"tgmem {i} {n}" for i, n in d.threadgroup_memory.items()]
        lines.append("dispatch " + " ".join(str(x) for x in (*d.grid, *d.threads)))
    return lines


CALLS = {
    "gemm": (
        "gemm",
        lambda: [torch.randn(40, 24), torch.randn(8, 24).t(), None, None],  # b transposed
        GEMM,
    ),
    "gemm_offset": (
        "gemm",
        lambda: [torch.randn(50, 24)[3:43], torch.randn(24, 8), torch.randn(8), None],
        GEMM,
    ),
    "sdpa": (
        "sdpa",
        lambda: [torch.randn(1, 2, 5, 64, dtype=torch.float16)] * 3 + [None, None],
        {"dropout_p": 0.0, "is_causal": True, "scale": 0.125},
    ),
}


@pytest.mark.parametrize("name", CALLS)
def test_the_record_is_the_simulated_plan(recorder, name):
    if not sim.available():
        pytest.skip("the simulator is unavailable")
    op, make, options = CALLS[name]
    tensors = make()
    outputs = recorder.run_op(op, tensors, options)
    plan = sim.plan(op, tensors, options)
    assert plan.ok
    allocations = plan.allocations
    assert [(tuple(o.shape), o.dtype) for o in outputs] == [
        (a.sizes, a.dtype) for a in allocations if a.is_output
    ]
    slots = [t.contiguous() if i in plan.contiguous_inputs else t for i, t in enumerate(tensors)]
    slots += outputs  # every allocation of these plans is an output
    assert len(slots) == plan.inputs + len(allocations)
    assert recorder.last_record() == _expected_record(plan, slots)


def test_a_repeated_call_plans_nothing(recorder):
    tensors = [torch.randn(7, 9), torch.randn(9, 5), None, None]
    recorder.run_op("gemm", tensors, GEMM)
    hits, misses = recorder.plan_cache_stats()
    pipelines = recorder.pipelines_built()
    for _ in range(3):
        recorder.run_op("gemm", [torch.randn(7, 9), torch.randn(9, 5), None, None], GEMM)
    assert recorder.plan_cache_stats() == (hits + 3, misses)
    assert recorder.pipelines_built() == pipelines


def test_a_refusal_names_its_reason(recorder):
    with pytest.raises(RuntimeError, match="steel plan refused: "):
        recorder.run_op("no_such_op", [torch.randn(2)], {})


def test_the_op_layer_reaches_the_host_as_on_mps(recorder, monkeypatch):
    monkeypatch.setattr(backends, "_device_type", lambda tensors: "mps")
    monkeypatch.setattr(backends, "metal_status", lambda: (True, ""))
    monkeypatch.setattr(metal, "_extension", lambda: recorder)
    monkeypatch.setattr(metal, "_load_library", lambda ext: None)
    q = torch.randn(1, 40, 2, 64, dtype=torch.float16).transpose(1, 2)  # BLHD, L > 8: prefill
    with torch_steel.backend("metal"):
        out = torch_steel.sdpa(q, q, q, is_causal=True)
        assert recorder.last_record()[0] == "pipeline steel_attention_f16_e64_v64"
        # The output follows the query's layout, as F.sdpa's does.
        assert out.shape == q.shape and out.stride() == q.stride()
        c = torch_steel.gemm(torch.randn(4, 8), torch.randn(8, 3))
        assert c.shape == (4, 3)
        assert recorder.last_record()[0] == "pipeline steel_gemv_nn_f32"  # 4 rows: the GEMV


def _stream_calls():
    """Calls of several ops and shapes; among them a decode stream over views of a KV cache,
    whose plans are one family rewritten per key length (plan/plan_cache.h)."""
    cache = torch.randn(1, 4, 300, 64, dtype=torch.float16)
    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    decode = {"dropout_p": 0.0, "is_causal": False, "scale": 0.125}
    calls = [("sdpa", [q, cache[:, :, :n], cache[:, :, :n], None, None], decode)
             for n in (40, 41, 77, 200, 299)]  # fmt: skip
    calls.append(("gemm", [torch.randn(7, 9), torch.randn(9, 5), None, None], GEMM))
    calls.append(CALLS["sdpa"][0:1] + (CALLS["sdpa"][1](), CALLS["sdpa"][2]))
    calls.append(("gemm", [torch.randn(33, 40).half(), torch.randn(40, 17).half(), None, None],
                  {**GEMM, "activation": "gelu"}))  # fmt: skip
    return calls


def test_prepared_pipelines_are_each_plans_own(recorder):
    """The host prepares a plan family's pipelines once (mps/host.h): every call of two rounds
    over interleaved ops, shapes and a decode stream is encoded as the same call planned and
    prepared afresh (its record and its pipelines' keys, constants included), and the second
    round found every plan prepared."""
    calls = _stream_calls()
    records = []
    for _ in range(2):
        hits = recorder.prepared_hits()
        for op, tensors, options in calls:
            recorder.run_op(op, tensors, options)
            records.append(recorder.last_record() + recorder.last_pipelines())
    assert recorder.prepared_hits() - hits == len(calls)
    recorder.plan_cache_reset(0)  # no plan cache: no family, nothing prepared
    try:
        fresh = []
        for _ in range(2):
            for op, tensors, options in calls:
                recorder.run_op(op, tensors, options)
                fresh.append(recorder.last_record() + recorder.last_pipelines())
    finally:
        recorder.plan_cache_reset()
    assert records == fresh
    assert len({tuple(r) for r in records}) > 3  # the calls differ


def test_loaded_kernels_skip_the_availability_checks(recorder, monkeypatch):
    """Once the kernels are loaded the Metal path is available for the rest of the process:
    an op call goes straight to the extension (no MPS, macOS or extension checks, no lock:
    issue 16), and before that it checks."""

    def unavailable():
        raise AssertionError("checked again")

    monkeypatch.setattr(backends, "_device_type", lambda tensors: "mps")
    monkeypatch.setattr(metal, "_extension", lambda: recorder)
    monkeypatch.setattr(backends, "metal_status", unavailable)
    monkeypatch.setattr(metal, "_load_library", unavailable)
    monkeypatch.setattr(metal, "_loaded", True)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with torch_steel.backend("metal"):
        assert torch_steel.gemm(a, b).shape == (4, 3)
        assert recorder.last_record()[0] == "pipeline steel_gemv_nn_f32"  # 4 rows: the GEMV
        monkeypatch.setattr(metal, "_loaded", False)
        with pytest.raises(AssertionError, match="checked again"):
            torch_steel.gemm(a, b)


def test_options_are_converted_once_per_set_of_objects(recorder):
    """The host converts a call's options once per set of name and value objects (a decode
    stream passes the same ones per token), and anew whenever one differs: a dict changed in
    place, or equal values of other objects, each with the options it holds."""
    options = {"alpha": 1.0, "beta": 0.0, "activation": "none"}
    converted = ({"alpha": 1.0, "beta": 0.0}, {"activation": "none"})
    assert recorder.parsed_options(options) == converted  # converted, or met in another test
    hits = recorder.options_hits()
    assert recorder.parsed_options(options) == converted
    assert recorder.parsed_options(dict(options)) == converted  # a new dict, the same objects
    assert recorder.options_hits() == hits + 2
    options["alpha"] = 2.5  # changed in place
    assert recorder.parsed_options(options) == ({"alpha": 2.5, "beta": 0.0}, converted[1])
    assert recorder.options_hits() == hits + 2
    scale = float(sum([0.5, 0.25]))  # equal to 0.75, another object each time
    for i in range(40):  # more sets of objects than the memo keeps
        other = {"alpha": float(sum([0.5, 0.25])), "beta": float(i), "activation": "relu"}
        assert recorder.parsed_options(other) == (
            {"alpha": scale, "beta": i},
            {"activation": "relu"},
        )
    assert recorder.options_hits() == hits + 2
    assert recorder.parsed_options(options) == ({"alpha": 2.5, "beta": 0.0}, converted[1])
    with pytest.raises(RuntimeError, match="option 'beta' must be a bool, number or string"):
        recorder.parsed_options({"alpha": 1.0, "beta": [0.0]})
