"""The Metal host and the simulator agree on what a plan encodes.

tests/mps/plan_record.cpp walks steel::make_plan's plan through the Metal host's CheckedEncoder
(mps_src/mps/checked_encoder.h, the code module.mm runs before each Metal call) with a recording
backend. Its record must equal the plan that torch_steel.sim executes, binding by binding, and the
host's checks (Metal's binding, inline-bytes, threadgroup-memory and thread limits) must accept
every plan.
"""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PLAN_DIR = ROOT / "mps_src" / "plan"
_DTYPE_CODES = {
    torch.float16: 0,
    torch.bfloat16: 1,
    torch.float32: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.bool: 5,
}
_CONSTANT_TYPES = {0: int, 1: int, 2: int, 3: float}  # steel::FunctionConstant::Type


def _compiler() -> str | None:
    return shutil.which("clang++-19") or shutil.which("g++")


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C++ compiler (clang++-19 or g++) to build the plan recorder")
    exe = tmp_path_factory.mktemp("plan_record") / "plan_record"
    sources = [str(ROOT / "tests" / "mps" / "plan_record.cpp")]
    sources += [str(p) for p in sorted(PLAN_DIR.glob("*.cpp"))]
    build = subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O1",
            "-Wall",
            "-I",
            str(ROOT / "mps_src"),
            "-I",
            str(ROOT / "shaders"),
            *sources,
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        pytest.fail(f"building the plan recorder failed:\n{build.stderr}")
    return exe


@pytest.fixture(scope="module")
def sim():
    from torch_steel import sim as module

    try:
        ready = module.available()
    except Exception as error:  # the simulator (issue 3) is being built in parallel
        pytest.skip(f"torch_steel.sim is not ready: {error!r}")
    if not ready:
        pytest.skip("torch_steel.sim is unavailable (no clang-19, or the simulator build fails)")
    return module


def _record(
    exe: Path, op: str, tensors, options, constant_types: bool = False, pipelines=None
) -> dict:
    """The recorder's plan; with constant_types, each dispatch also has "constant_types":
    {index: steel::FunctionConstant::Type code} (the simulator's view has no types).

    pipelines: made-up pipeline limits, {"kernel prefix": (max threads, static threadgroup
    bytes), "device_tgmem": bytes}; the host's re-plan loop plans against them and the record
    has "attempts"."""
    lines = [f"op {op}"]
    for t in tensors:
        if t is None:
            lines.append("none")
        else:
            lines.append(
                " ".join(
                    str(x)
                    for x in [
                        "tensor",
                        _DTYPE_CODES[t.dtype],
                        t.dim(),
                        *t.shape,
                        *t.stride(),
                        t.storage_offset(),
                    ]
                )
            )
    for name, value in options.items():
        if isinstance(value, str):
            lines.append(f"string {name} {value}")
        else:
            lines.append(f"number {name} {float(value)!r}")
    for prefix, limit in (pipelines or {}).items():
        if prefix == "device_tgmem":
            lines.append(f"device_tgmem {limit}")
        else:
            lines.append(f"limit {prefix} {limit[0]} {limit[1]}")
    out = subprocess.run(
        [str(exe)], input="\n".join(lines) + "\n", check=True, capture_output=True, text=True
    ).stdout
    first = out.split(" ", 1)
    if first[0] == "refused":
        return {"ok": False, "reason": first[1].rstrip("\n")}
    assert first[0] != "invalid", f"the Metal host would reject this plan: {out}"
    plan = {"ok": True, "allocations": [], "dispatches": []}
    for line in out.splitlines():
        kind, *f = line.split(" ")
        if kind == "inputs":
            plan["inputs"] = int(f[0])
        elif kind == "attempts":
            plan["attempts"] = int(f[0])
        elif kind == "contiguous":
            plan["contiguous"] = sorted(int(x) for x in f)
        elif kind == "allocation":
            plan["allocations"].append(
                (f[0], bool(int(f[1])), bool(int(f[2])), tuple(int(x) for x in f[4:]))
            )
        elif kind == "pipeline":
            constants, types = {}, {}
            for i in range(int(f[1])):
                index, ctype, value = f[2 + 3 * i : 5 + 3 * i]
                constants[int(index)] = _CONSTANT_TYPES[int(ctype)](float(value))
                types[int(index)] = int(ctype)
            plan["dispatches"].append(
                {"kernel": f[0], "constants": constants, "bindings": [], "tgmem": {}}
            )
            if constant_types:
                plan["dispatches"][-1]["constant_types"] = types
        elif kind == "tensor":
            plan["dispatches"][-1]["bindings"].append((int(f[0]), "tensor", int(f[1]), b""))
        elif kind == "bytes":
            plan["dispatches"][-1]["bindings"].append((int(f[0]), "bytes", -1, bytes.fromhex(f[1])))
        elif kind == "tgmem":
            plan["dispatches"][-1]["tgmem"][int(f[0])] = int(f[1])
        elif kind == "dispatch":
            plan["dispatches"][-1]["grid"] = tuple(int(x) for x in f[:3])
            plan["dispatches"][-1]["threads"] = tuple(int(x) for x in f[3:])
        else:
            raise AssertionError(f"unexpected recorder line {line!r}")
    return plan


def _sim_view(p) -> dict:
    """The simulator's plan in the recorder's terms."""
    if not p.ok:
        return {"ok": False, "reason": p.reason}
    return {
        "ok": True,
        "inputs": p.inputs,
        "contiguous": sorted(p.contiguous_inputs),
        "allocations": [
            (
                str(a.dtype).removeprefix("torch."),
                bool(a.zero_init),
                bool(a.is_output),
                tuple(a.sizes),
            )
            for a in p.allocations
        ],
        "dispatches": [
            {
                "kernel": d.kernel,
                # Bool constants compare as 0/1, like the recorder's int_value.
                "constants": {
                    int(i): (float(v) if isinstance(v, float) else int(v))
                    for i, v in d.constants.items()
                },
                "bindings": [
                    (
                        b.index,
                        b.kind,
                        b.slot if b.kind == "tensor" else -1,
                        bytes(b.bytes) if b.kind == "bytes" else b"",
                    )
                    for b in d.bindings
                ],
                "tgmem": {int(i): int(n) for i, n in d.threadgroup_memory.items()},
                "grid": tuple(d.grid),
                "threads": tuple(d.threads),
            }
            for d in p.dispatches
        ],
    }


def _t(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype)


# gemm tensors [a, b, bias, c]; shapes only matter (plans never read data).
_GEMM_CASES = {
    "square_f16": ([_t(64, 64), _t(64, 64), None, None], {}),
    "edges_f32": ([_t(1, 13, dtype=torch.float32), _t(13, 7, dtype=torch.float32), None, None], {}),
    "batched_bias_gelu_bf16": (
        [
            _t(3, 33, 20, dtype=torch.bfloat16),
            _t(20, 17, dtype=torch.bfloat16),
            _t(17, dtype=torch.bfloat16),
            None,
        ],
        {"activation": "gelu"},
    ),
    "transposed_b_with_c": (
        [_t(40, 24), _t(30, 24).t(), None, _t(40, 30)],
        {"alpha": 0.5, "beta": 2.0, "activation": "relu"},
    ),
    "beta_zero_ignores_c": ([_t(16, 16), _t(16, 16), None, _t(16, 16)], {"beta": 0.0}),
    "split_k_f32": (
        [_t(8, 4096, dtype=torch.float32), _t(4096, 8, dtype=torch.float32), None, None],
        {},
    ),
    "storage_offsets": (
        [_t(70, 50)[3:, 5:], _t(50, 40)[5:, 1:], _t(40)[1:], None],
        {"activation": "silu"},
    ),
    "strided_copy": ([_t(32, 64)[:, ::2], _t(32, 32), None, None], {}),
    "broadcast_batches": (
        [_t(2, 1, 16, 8), _t(1, 3, 8, 16), _t(16), _t(16)],
        {"beta": 1.0, "activation": "gelu_tanh"},
    ),
    "mixed_dtypes_refused": ([_t(8, 8), _t(8, 8, dtype=torch.float32), None, None], {}),
}


@pytest.mark.parametrize("case", sorted(_GEMM_CASES))
def test_gemm_plans_pass_host_checks(case, recorder):
    """Every gemm plan encodes within Metal's limits (_record fails on "invalid")."""
    tensors, options = _GEMM_CASES[case]
    record = _record(recorder, "gemm", tensors, options)
    if case.endswith("_refused"):
        assert not record["ok"]
    else:
        assert record["ok"], record
        assert record["dispatches"], "an op on non-empty tensors encodes at least one dispatch"
        outputs = [a for a in record["allocations"] if a[2]]
        assert len(outputs) == 1 and outputs[0][0] == str(tensors[0].dtype).removeprefix("torch.")


@pytest.mark.parametrize("case", sorted(_GEMM_CASES))
def test_gemm_encoder_matches_simulator(case, recorder, sim):
    tensors, options = _GEMM_CASES[case]
    record = _record(recorder, "gemm", tensors, options)
    assert record == _sim_view(sim.plan("gemm", tensors, options))
    if case.endswith("_refused"):
        assert not record["ok"]
    else:
        assert record["ok"], record
        assert record["dispatches"], "an op on non-empty tensors encodes at least one dispatch"


_LSE = torch.empty(2, 4, 33)
_CU_Q = torch.tensor([0, 7, 7, 40], dtype=torch.int32)
_CU_K = torch.tensor([0, 7, 43, 50], dtype=torch.int32)
_BLHD = _t(2, 33, 4, 64).transpose(1, 2)
# Attention plans: the forward [q, k, v, mask, sinks] and the backward [grad_out, q, k, v, out,
# lse, mask, sinks, grad_lse] (the most buffers any plan binds).
_ATTN_CASES = {
    "sdpa_plain": ("sdpa", [_t(2, 4, 33, 64), _t(2, 4, 47, 64), _t(2, 4, 47, 64), None, None],
                   {"scale": 0.125}),
    "sdpa_mask_sinks_blhd": ("sdpa", [_BLHD, _t(2, 2, 47, 64), _t(2, 2, 47, 64),
                                      _t(33, 47, dtype=torch.bool), _t(4)],
                             {"is_causal": True, "window_left": 9}),
    "sdpa_backward_everything": ("sdpa_backward",
                                 [_BLHD, _BLHD, _t(2, 2, 47, 64), _t(2, 2, 47, 64), _BLHD, _LSE,
                                  _t(1, 4, 1, 47), _t(4), _LSE],
                                 {"softcap": 20.0, "is_causal": True}),
    "sdpa_backward_mask_grad": ("sdpa_backward",
                                [_BLHD, _BLHD, _t(2, 2, 47, 64), _t(2, 2, 47, 64), _BLHD, _LSE,
                                 _t(2, 1, 33, 47), None, None],
                                {"mask_grad": True, "window_left": 5}),
    "sdpa_varlen_backward": ("sdpa_varlen_backward",
                             [_t(40, 4, 64), _t(40, 4, 64), _t(50, 2, 64), _t(50, 2, 64),
                              _t(40, 4, 64), torch.empty(4, 40), _CU_Q, _CU_K, _t(4),
                              torch.empty(4, 40)],
                             {"is_causal": True, "bottom_right": True, "max_seqlen_q": 33,
                              "max_seqlen_k": 43}),
    "sdpa_dropout_refused": ("sdpa", [_t(1, 1, 8, 64), _t(1, 1, 8, 64), _t(1, 1, 8, 64), None,
                                      None], {"dropout_p": 1.0}),
    # Decode: one pass, and split-K (partial kernel + merge, the partials as scratch).
    "sdpa_decode_one_pass": ("sdpa", [_t(4, 32, 1, 128), _t(4, 8, 4096, 128),
                                      _t(4, 8, 4096, 128), None, _t(32)], {"num_splits": 1}),
    "sdpa_decode_split": ("sdpa", [_t(1, 8, 4, 64), _t(1, 2, 3000, 64), _t(1, 2, 3000, 64),
                                   _t(4, 3000, dtype=torch.bool), _t(8)],
                          {"is_causal": True, "bottom_right": True}),
    "sdpa_varlen_paged": ("sdpa_varlen", [_t(3, 8, 64), _t(40, 16, 2, 64), _t(40, 16, 2, 64),
                                          _t(3, dtype=torch.int32), None, None,
                                          _t(2, 20, dtype=torch.int32), _t(2, dtype=torch.int32)],
                          {"max_seqlen_q": 2, "max_seqlen_k": 320}),
    "sdpa_varlen_paged_prefill": ("sdpa_varlen", [_t(40, 8, 64), _t(40, 16, 2, 64),
                                          _t(40, 16, 2, 64), _t(3, dtype=torch.int32), None,
                                          None, _t(2, 20, dtype=torch.int32),
                                          _t(2, dtype=torch.int32)],
                                          {"max_seqlen_q": 30, "max_seqlen_k": 320}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_ATTN_CASES))
def test_attention_encoder_matches_simulator(case, recorder, sim):
    """Attention plans pass the host's checks (buffer indices, setBytes sizes, threads) and the
    recorder encodes exactly what the simulator runs."""
    op, tensors, options = _ATTN_CASES[case]
    record = _record(recorder, op, tensors, options)
    assert record == _sim_view(sim.plan(op, tensors, options))
    assert record["ok"] == (not case.endswith("_refused")), record


@pytest.mark.parametrize(
    ("defect", "message"),
    [
        ("index", "buffer(31) is beyond Metal's 31 buffer bindings"),
        ("twice", "buffer(0) is bound twice"),
        ("absent", "buffer(2) binds slot 1, which holds no tensor"),
        ("slot", "buffer(2) binds slot 3, which holds no tensor"),
        ("bytes", "buffer(3) has 4097 inline bytes; setBytes takes 1 to 4096"),
        ("tgmem", "threadgroup(0) length 1000 is not a positive multiple of 16"),
        ("tgindex", "threadgroup(31) is beyond Metal's 31 threadgroup memory bindings"),
        ("tgtwice", "threadgroup(0) is set twice"),
        ("tgtotal", "32784 bytes of threadgroup memory, more than 32768"),
        ("threads", "1025 threads per threadgroup, more than 1024"),
        ("grid", "empty grid or threadgroup (a plan for empty tensors has no dispatches)"),
        ("constant", "function constant 0 = 2 does not fit its type"),
    ],
)
def test_host_rejects_plans_metal_would_misread(recorder, defect, message):
    """The host's checks, on a test planner (plan_record.cpp) that plants one defect a plan."""
    tensors = [_t(4), None]  # slot 1 is an absent optional
    out = subprocess.run(
        [str(recorder)],
        check=True,
        capture_output=True,
        text=True,
        input=f"op mps_test_defect\ntensor 0 1 4 1 0\nnone\nstring defect {defect}\n",
    ).stdout
    assert out == f"invalid kernel defect_{defect}: {message}\n"
    # The same planner without a defect encodes.
    assert _record(recorder, "mps_test_defect", tensors, {"defect": "none"})["ok"]


def test_unknown_op_is_refused(recorder):
    record = _record(recorder, "no_such_op", [_t(4, 4)], {})
    assert record == {"ok": False, "reason": "no Metal kernel for op 'no_such_op' yet"}


@pytest.mark.parametrize("max_threads", [32, 64, 128, 192])
@pytest.mark.parametrize("shape", [(256, 256, 256), (16, 16, 4096)], ids=["tiled", "split_k"])
def test_gemm_planner_honours_max_threads(recorder, max_threads, shape):
    """module.mm re-plans with "max_threads" when a pipeline allows fewer threads than planned:
    every GEMM tile needs 128 threads, the split-K reduction takes what it is given."""
    m, n, k = shape
    tensors = [_t(m, k), _t(k, n), None, None]
    record = _record(recorder, "gemm", tensors, {"max_threads": max_threads})
    if max_threads < 128:
        assert not record["ok"]
        assert "threads per threadgroup" in record["reason"], record["reason"]
        return
    assert record["ok"], record
    for d in record["dispatches"]:
        threads = d["threads"][0] * d["threads"][1] * d["threads"][2]
        assert 0 < threads <= max_threads and threads % 32 == 0, d


def _odd_layouts():
    """Operand layouts at the edges of "has a unit stride": size-1 dims with any stride, offsets,
    expanded (stride-0) dims, slices."""
    base = _t(8, 8, 8)
    return {
        "offset_contiguous": base.reshape(-1)[5:69].view(8, 8),
        "one_row_odd_stride": base[2, :1, :],
        "one_col_odd_stride": base[:, 3, :1],
        "one_by_one": base[1:2, 2:3, 3],
        "expanded_rows": _t(1, 8).expand(8, 8),
        "expanded_cols": _t(8, 1).expand(8, 8),
        "every_other_col": base[0, :, ::2],
        "batched_slice": base[1:, 2:, 1:],
    }


@pytest.mark.parametrize("side", ["a", "b"])
@pytest.mark.parametrize("layout", sorted(_odd_layouts()))
def test_copied_inputs_are_not_contiguous_in_torch(recorder, side, layout):
    """module.mm (like torch_steel.sim) makes the plan's copies with Tensor.contiguous(), which
    returns a tensor torch already calls contiguous as it is, storage offset included. The
    planner describes a copy as TensorDesc::contiguous(): offset 0, so it may assume 16-byte
    alignment. The two agree only while planners copy nothing torch calls contiguous."""
    x = _odd_layouts()[layout]
    other = _t(x.shape[-1], 8) if side == "a" else _t(8, x.shape[-2])
    tensors = [x, other, None, None] if side == "a" else [other, x, None, None]
    record = _record(recorder, "gemm", tensors, {})
    assert record["ok"], record
    for slot in record["contiguous"]:
        assert not tensors[slot].is_contiguous(), (layout, slot, tensors[slot].stride())


# ---- the re-plan loop (module.mm's plan_with_pipelines runs plan_within_limits) ---------------

_SPLIT_K = [_t(16, 4096), _t(4096, 16), None, None]  # split-K: a tile pass and a reduction


def _threads(dispatch):
    x, y, z = dispatch["threads"]
    return x * y * z


def test_replan_when_a_pipeline_allows_fewer_threads(recorder):
    planned = _record(recorder, "gemm", _SPLIT_K, {})
    reduce = planned["dispatches"][-1]
    assert reduce["kernel"].startswith("steel_gemm_splitk_reduce_") and _threads(reduce) > 200
    record = _record(
        recorder, "gemm", _SPLIT_K, {}, pipelines={"steel_gemm_splitk_reduce_": (200, 0)}
    )
    assert record["ok"], record
    assert record["attempts"] == 2
    tile, reduce = record["dispatches"]
    assert _threads(reduce) == 192  # the largest multiple of 32 within the pipeline's 200
    assert tile == planned["dispatches"][0]  # the tile pass had room: unchanged
    assert reduce["grid"][0] * 192 >= 16 * 16  # still one thread per output element


def test_within_limits_plans_once(recorder):
    record = _record(recorder, "gemm", _SPLIT_K, {}, pipelines={"steel_gemm_": (1024, 4096)})
    assert record["ok"] and record["attempts"] == 1
    assert record["dispatches"] == _record(recorder, "gemm", _SPLIT_K, {})["dispatches"]


def test_a_pipeline_below_the_tile_threads_is_a_refusal(recorder):
    record = _record(recorder, "gemm", _SPLIT_K, {}, pipelines={"steel_gemm_splitk_": (96, 0)})
    assert record == {
        "ok": False,
        "reason": "gemm: the pipeline allows 96 threads per threadgroup, the GEMM tiles need 128",
    }


def test_a_planner_that_ignores_max_threads_is_refused(recorder):
    """The test planner always asks for 1024 threads: the loop gives up instead of looping."""
    record = _record(
        recorder,
        "mps_test_defect",
        [_t(4), None],
        {"defect": "none"},
        pipelines={"defect_": (512, 0)},
    )
    assert record == {
        "ok": False,
        "reason": "kernel defect_none runs at most 512 threads per threadgroup on this device "
        "and the planner found no smaller plan",
    }


def test_threadgroup_memory_beyond_the_device_is_a_refusal(recorder):
    """Static (in-kernel) plus dynamic threadgroup memory against the device's limit."""
    tensors = [_t(4), None]
    options = {"defect": "none"}  # one dispatch with 1024 dynamic bytes at threadgroup(0)
    fits = _record(
        recorder,
        "mps_test_defect",
        tensors,
        options,
        pipelines={"defect_": (1024, 31744), "device_tgmem": 32768},
    )
    assert fits["ok"], fits
    record = _record(
        recorder,
        "mps_test_defect",
        tensors,
        options,
        pipelines={"defect_": (1024, 31760), "device_tgmem": 32768},
    )
    assert record == {
        "ok": False,
        "reason": "kernel defect_none needs 32784 bytes of threadgroup memory, the device has "
        "32768",
    }


def test_an_invalid_plan_is_stopped_before_any_pipeline(recorder):
    """validate_plan runs on each attempt before its pipelines are asked for: a planner bug is
    an error, not a refusal and not a Metal call (the made-up pipeline would refuse it)."""
    out = subprocess.run(
        [str(recorder)],
        check=True,
        capture_output=True,
        text=True,
        input="op mps_test_defect\ntensor 0 1 4 1 0\nnone\nstring defect twice\n"
        "limit defect_ 32 0\n",
    ).stdout
    assert out == "invalid kernel defect_twice: buffer(0) is bound twice\n"


# ---- function-constant types ------------------------------------------------------------------
#
# Metal specializes a kernel with MTLFunctionConstantValues, each value given with an MTLDataType
# that must be the type of the shader's `constant T name [[function_constant(i)]]` declaration
# (module.mm maps Bool/Int/UInt/Float to MTLDataTypeBool/Int/UInt/Float and passes 1 or 4 bytes).
# The simulator converts any value to the declared type, so only this check sees a planner that
# sets, say, an int constant as Bool, or a constant at an index the kernel does not declare.

SHADERS = ROOT / "shaders"
# steel::FunctionConstant::Type code -> MSL scalar type.
_MSL_TYPES = {0: "bool", 1: "int", 2: "uint", 3: "float"}
# Kernel host-name prefix -> the translation unit that defines those kernels (the longest
# matching prefix wins). A plan naming a kernel with no entry here fails the test below.
_KERNEL_SOURCES = {"steel_gemm_": "steel/gemm/gemm.metal", "steel_gemv_": "steel/gemm/gemm.metal"}
_DECLARATION = re.compile(
    r"\bconstant\s+(\w+)\s+(\w+)\s*\[\[\s*function_constant\(\s*(\w+)\s*\)\s*\]\]"
)
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)\s+(\d+)\b", re.M)


def _build_macos():
    spec = importlib.util.spec_from_file_location(
        "build_macos", ROOT / "mps_src" / "mps" / "build_macos.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def function_constant_declarations(text: str) -> dict[int, tuple[str, str]]:
    """{index: (MSL type, name)} of the function constants a (self-contained) source declares."""
    defines = {name: int(value) for name, value in _DEFINE.findall(text)}
    declared = {}
    for msl_type, name, index in _DECLARATION.findall(text):
        number = int(index) if index.isdigit() else defines.get(index)
        assert number is not None, f"function constant {name}: index {index} is not a number"
        assert number not in declared, f"function constant index {number} declared twice"
        declared[number] = (msl_type, name)
    return declared


def constant_type_errors(dispatch: dict, declared: dict[int, tuple[str, str]]) -> list[str]:
    """What Metal would refuse when specializing `dispatch` against `declared`."""
    errors = []
    for index, code in sorted(dispatch["constant_types"].items()):
        if index not in declared:
            errors.append(f"{dispatch['kernel']}: constant {index} is not declared by the shader")
        elif declared[index][0] != _MSL_TYPES[code]:
            errors.append(
                f"{dispatch['kernel']}: constant {index} ({declared[index][1]}) is declared "
                f"{declared[index][0]}, the plan sets it as {_MSL_TYPES[code]}"
            )
    return errors


@pytest.fixture(scope="module")
def shader_constants():
    amalgamate = _build_macos().amalgamate
    return {
        source: function_constant_declarations(amalgamate(SHADERS / source, SHADERS))
        for source in set(_KERNEL_SOURCES.values())
    }


def _source_of(kernel: str) -> str:
    prefixes = [p for p in _KERNEL_SOURCES if kernel.startswith(p)]
    assert prefixes, f"kernel {kernel}: add its source to _KERNEL_SOURCES"
    return _KERNEL_SOURCES[max(prefixes, key=len)]


def test_gemm_declares_its_constants(shader_constants):
    declared = shader_constants["steel/gemm/gemm.metal"]
    assert {t for t, _ in declared.values()} == {"bool", "int"}
    assert declared[112] == ("int", "gemm_activation")  # STEEL_GEMM_FC_ACTIVATION


@pytest.mark.parametrize(
    ("case", "options"),
    [(case, {}) for case in sorted(_GEMM_CASES) if not case.endswith("_refused")]
    + [("split_k_f32", {"max_threads": 128}), ("square_f16", {"activation": "gelu_tanh"})],
)
def test_gemm_constant_types_match_the_shader(case, options, recorder, shader_constants):
    tensors, case_options = _GEMM_CASES[case]
    record = _record(recorder, "gemm", tensors, {**case_options, **options}, constant_types=True)
    assert record["ok"], record
    errors = []
    for dispatch in record["dispatches"]:
        assert dispatch["constant_types"], "every GEMM kernel is specialized"
        errors += constant_type_errors(dispatch, shader_constants[_source_of(dispatch["kernel"])])
    assert not errors


def test_constant_type_check_catches_mismatches():
    """The check above fails on the mistakes it exists for (the simulator accepts them all)."""
    declared = function_constant_declarations(
        "#define FC_FLAG 7\n"
        "constant bool flag [[function_constant(FC_FLAG)]];\n"
        "constant int mode [[ function_constant( 8 ) ]];\n"
        "constant uint count [[function_constant(9)]];\n"
    )
    assert declared == {7: ("bool", "flag"), 8: ("int", "mode"), 9: ("uint", "count")}
    ok = {"kernel": "k", "constant_types": {7: 0, 8: 1, 9: 2}}
    assert constant_type_errors(ok, declared) == []
    wrong = {"kernel": "k", "constant_types": {7: 1, 8: 2, 9: 1, 10: 0}}
    assert constant_type_errors(wrong, declared) == [
        "k: constant 7 (flag) is declared bool, the plan sets it as int",
        "k: constant 8 (mode) is declared int, the plan sets it as uint",
        "k: constant 9 (count) is declared uint, the plan sets it as int",
        "k: constant 10 is not declared by the shader",
    ]
