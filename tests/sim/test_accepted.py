"""Constructs that Metal accepts must build and run here too (kernels:
tests/sim/kernels/lang_accepted.metal, with <sub/helper.h> from kernels/accepted_inc)."""

import struct
from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError

KERNELS = Path(__file__).parent / "kernels"
SRC = [KERNELS / "lang_accepted.metal"]
INC = [KERNELS / "accepted_inc"]

pytestmark = requires_clang


def run(name, **kw):
    return sim.run_kernel(name, sources=SRC, include_dirs=INC, **kw)


def test_template_kernel_with_default_arguments_and_metal_array():
    for suffix, dtype in (("f32", torch.float32), ("half", torch.float16), ("int", torch.int32)):
        out = torch.zeros(8, dtype=dtype)
        run(f"accepted_template_{suffix}", grid=(1,), threads=(8,), buffers={0: out})
        assert out.tolist() == [float(i % 4 + 4) for i in range(8)]


def test_forward_declared_kernel_constant_bound_and_helpers():
    out = torch.zeros(8)
    run("accepted_forward", grid=(1,), threads=(8,), buffers={0: out})
    assert out.tolist() == [i * 3.0 - 128.0 for i in range(8)]


def test_constant_array_parameter():
    out = torch.zeros(1)
    run("accepted_constant_array", grid=(1,), threads=(1,), buffers={0: out})
    assert out.item() == 10.0


def test_template_kernel_with_dependent_thread_limit_and_threadgroup_array():
    out = torch.zeros(64)
    run("accepted_limited_2", grid=(1,), threads=(64,), buffers={0: out})
    assert out.tolist() == [float(i + (i + 1) % 64) for i in range(64)]
    # [[max_total_threads_per_threadgroup(kWarps * 32)]] of this instance is 64.
    with pytest.raises(SimulatorError, match="max_total_threads_per_threadgroup"):
        run("accepted_limited_2", grid=(1,), threads=(96,), buffers={0: torch.zeros(96)})


def test_default_argument_before_a_body_with_a_threadgroup_array():
    out = torch.zeros(4)
    run("accepted_default_argument", grid=(1,), threads=(4,), buffers={0: out})
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_address_space_qualified_member_functions_on_device_objects():
    pairs = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    out = torch.zeros(6)
    run("accepted_device_members", grid=(1,), threads=(2,), buffers={0: pairs, 1: out})
    assert out.tolist() == [-1.0, 3.0, 60.0, -2.0, 8.0, 160.0]
    assert pairs.tolist() == [[2.0, 4.0], [6.0, 10.0]]


def test_apple_builtins_compute_what_their_functions_do():
    x = torch.linspace(-2.0, 2.0, 32)
    out = torch.zeros(32 * 8)
    run("accepted_metal_builtins", grid=(1,), threads=(32,), buffers={0: x, 1: out})
    out = out.view(32, 8).double()
    xd = x.double()
    # The precise exp (Table 8.1: <= 4 ulp; the shim rounds the binary32 result once) and the
    # correctly rounded rest, against float64.
    assert torch.allclose(out[:, 0], xd.exp(), rtol=4 * 2.0**-23, atol=0)
    assert torch.equal(out[:, 1], torch.maximum(torch.maximum(xd, torch.full_like(xd, 0.5)), -xd))
    assert torch.allclose(out[:, 2], torch.atan2(xd, torch.full_like(xd, 2.0)), rtol=6 * 2.0**-23)
    assert torch.equal(out[:, 3], (xd * xd + 1.0).float().double())
    assert torch.allclose(out[:, 4], torch.full_like(xd, xd.sum().item()), atol=1e-5)
    assert torch.equal(out[:, 5], xd.view(16, 2).flip(1).reshape(32))
    assert (out[:, 6] == 32).all()
    assert torch.equal(out[:, 7], 2 * xd)


def test_params_struct_copied_from_constant_and_device_memory():
    raw = struct.pack("<ifff", 3, 0.5, 0.25, -1.0)
    dev = torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()
    out = torch.zeros(4 * 6)
    run("accepted_params_copy", grid=(1,), threads=(4,), buffers={0: raw, 1: dev, 2: out})
    total = 0.5 + 0.25 - 1.0
    row = [3 * 0.5 - 1.0, 3 * 0.5 + 0.25, 3 - 1.0, total, 2 * total, 3 * total]
    assert out.view(4, 6).tolist() == [row] * 4


def test_params_struct_passed_returned_and_assigned_by_value_across_address_spaces():
    constant = struct.pack("<ifff", 3, 0.5, 0.25, -1.0)
    structs = struct.pack("<ifff", 5, 2.0, 1.0, 0.5) + struct.pack("<ifff", 7, 0.25, -2.0, 4.0)
    dev = torch.frombuffer(bytearray(structs), dtype=torch.uint8).clone()
    out = torch.zeros(4 * 7)
    c = run(
        "accepted_params_by_value",
        grid=(1,),
        threads=(4,),
        buffers={0: constant, 1: dev, 2: out},
        counters=True,
    )
    row = [3 * 0.5 + 0.25, 7 * 0.25 - 2.0, -1.0, 0.5 + 2.0, 0.5, 3 * (2.0 + 1.0 + 0.5), 3 * -0.25]
    assert out.view(4, 7).tolist() == [row] * 4
    # The counters see the copies: at least the bytes each lane uses (buffer 0: 12 for
    # accepted_weigh, 4 + 4 for the by-reference call and the returned copy, 12 for q.total();
    # buffer 1: the 16 copied into threadgroup memory, then 12 + 4 per lane).
    assert c["buffers"][0]["read"] >= 4 * 32
    assert c["buffers"][1]["read"] >= 16 + 4 * 16
    # The copies are checked: with a device buffer one struct short, `accepted_weigh(dp[1])`
    # reads past its end (the optimizer keeps only the bytes the callee uses).
    line = 1 + SRC[0].read_text().splitlines().index("  out[i * 7 + 1] = accepted_weigh(dp[1]);")
    msg = r"out-of-bounds device read of \d+ bytes at byte offset 16 of \[\[buffer\(1\)\]\]"
    msg += rf"(.|\n)*lang_accepted.metal:{line}:"
    with pytest.raises(SimulatorError, match=msg):
        run(
            "accepted_params_by_value",
            grid=(1,),
            threads=(4,),
            buffers={0: constant, 1: dev[:16].clone(), 2: out},
        )


def test_members_qualified_with_every_address_space():
    """Issue 26 findings 1 to 3: constructors, conversions (to a vector, to any scalar by a
    template), operators, member templates, variadic templates with unnamed parameters, a
    destructor and static members, qualified with thread, threadgroup, device or constant,
    each called on an object in its space; the result is the variant Metal picks."""
    SRC2 = [KERNELS / "lang_member_spaces.metal"]
    n = 32
    pairs = torch.stack([torch.arange(n) * 0.25 + 1.0, torch.arange(n) * 0.5 - 3.0], 1)
    p = pairs.clone().contiguous()
    out = torch.zeros(n * 12)
    sim.run_kernel("member_spaces", sources=SRC2, grid=(1,), threads=(n,), buffers={0: p, 1: out})
    out = out.view(n, 12).double()
    lo, hi = pairs[:, 0].double(), pairs[:, 1].double()
    i = torch.arange(n).double()
    expected = torch.stack(
        [
            lo - hi,  # device conversion
            lo + hi,  # threadgroup conversion (of a copy made from the device vector)
            torch.full((n,), 12.0, dtype=torch.float64),  # constant: 3 * 4
            i,  # thread: lo
            4.0 + lo,
            hi + 2.0,  # device operator+ (no +100)
            torch.full((n,), 104.0, dtype=torch.float64),  # thread operator+
            hi,  # threadgroup operator[]
            lo**3 + 2.0,
            2.0 * i,
            i + 1.0,
            (lo - hi) * 0.5,  # after the device operator*=
        ],
        1,
    )
    # Exact: every value is a small multiple of 1/4 (float holds them exactly).
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(p.double(), torch.stack([lo, hi], 1) * 0.5, rtol=0, atol=0)


@pytest.mark.parametrize(("std", "version"), [("metal3.1", 310), ("metal3.2", 320)])
def test_logging_with_metal_logging_and_its_fallback(std, version):
    """Issue 26 finding 2: MSL 3.2's <metal_logging> (metal::os_log) and the empty fallback
    that headers carry for older versions, each under the -std that selects it."""
    out = torch.zeros(8, dtype=torch.int32)
    sim.run_kernel(
        "logging",
        sources=[KERNELS / "lang_logging.metal"],
        grid=(1,),
        threads=(8,),
        buffers={0: out},
        std=std,
    )
    assert out.tolist() == [version + i for i in range(8)]


def test_function_pointer_parameters_resolved_when_inlined():
    """Issue 26 finding 5: a `T (*op)(T, T)` parameter called with a function's name (PyTorch's
    c10/metal/atomic.h form); other function pointers stay refused (test_refusals)."""
    out = torch.zeros(16)
    sim.run_kernel(
        "function_pointer_parameter",
        sources=[KERNELS / "lang_member_spaces.metal"],
        grid=(1,),
        threads=(8,),
        buffers={0: out},
    )
    i = torch.arange(8, dtype=torch.float64)
    expected = torch.stack([i + 2.0, torch.clamp(i, min=2.0)], 1).flatten()
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=0)  # small integers: exact


# Constructs of other projects' production Metal (issue 26, deliverable 3: MLX and llama.cpp
# failed on each before the simulator took it), kernels in lang_corpus.metal.
CORPUS = [KERNELS / "lang_corpus.metal"]


def run_corpus(name, **kw):
    return sim.run_kernel(name, sources=CORPUS, **kw)


def test_bitwise_simd_builtin_on_a_float_compiles_and_refuses_to_run():
    """MLX's bfloat16 simd_xor passes a float to __metal_simd_xor in a function no kernel
    calls: Metal compiles it, so the file must build; the integer form reduces, and running
    the float form is an error (what it would do is undocumented)."""
    out = torch.zeros(8, dtype=torch.int32)
    f = torch.ones(8)
    run_corpus("simd_xor_builtin", grid=(1,), threads=(8,), buffers={0: out, 1: f, 2: b"\0" * 4})
    assert out.tolist() == [0xFF] * 8  # the xor of 1 << lane over lanes 0-7
    with pytest.raises(SimulatorError, match="__metal_simd_xor on a non-integer"):
        buffers = {0: out, 1: f, 2: struct.pack("<I", 1)}
        run_corpus("simd_xor_builtin", grid=(1,), threads=(8,), buffers=buffers)


def test_vector_element_passed_by_value():
    out = torch.zeros(16)
    run_corpus("vector_element_argument", grid=(1,), threads=(8,), buffers={0: out})
    assert out.tolist() == [float(j) for j in range(16)]  # 2 * (i, i + 0.5)


def test_void_return_of_a_void_call_in_an_attributed_kernel():
    out = torch.zeros(8)
    run_corpus("void_return", grid=(1,), threads=(8,), buffers={0: out})
    assert out.tolist() == [3.0 * i if i % 2 == 0 else -1.0 for i in range(8)]


def test_function_pointer_template_parameter():
    x = torch.arange(8, dtype=torch.float32) + 1
    out = torch.zeros(8)
    run_corpus("template_function_pointer", grid=(1,), threads=(8,), buffers={0: x, 1: out})
    assert out.tolist() == [-(i + 1.0) if i % 2 else 2 * (i + 1.0) for i in range(8)]


def test_buffer_parameters_without_an_index_take_the_first_free_one():
    x = torch.arange(8, dtype=torch.float32)
    y, z = torch.zeros(8), torch.zeros(8)
    buffers = {0: struct.pack("<f", 3.0), 1: x, 2: z, 3: y}
    run_corpus("implicit_buffer_indices", grid=(1,), threads=(8,), buffers=buffers)
    assert y.tolist() == (3 * x).tolist() and z.tolist() == (x + 1).tolist()


def test_instantiation_through_a_typedef_of_the_kernel_type():
    out = torch.zeros(4)
    run_corpus("typed_instance_float", grid=(1,), threads=(4,), buffers={0: out})
    assert out.tolist() == [0.5, 1.5, 2.5, 3.5]


def test_matrix_types():
    # [matrix, column, row], as MSL lays a matrix out; small integers, so every result is exact.
    src = torch.randint(-8, 8, (2, 4, 4)).to(torch.float16)
    dst = torch.zeros(2, 4, 4)
    prod = torch.zeros(2, 4)
    buffers = {0: src, 1: dst, 2: prod}
    run_corpus("matrix_types", grid=(1,), threads=(32,), buffers=buffers)
    m = src.double()
    m[:, 1, 2] += 1
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert torch.equal(dst.double(), 2 * m)
    assert torch.equal(prod.double(), torch.einsum("icr,c->ir", m, v))  # sum of columns * v


def test_access_checked_against_its_type_alignment():
    """MLX's loaders copy 8-byte structs declared alignas(2) from 2-byte-aligned addresses: the
    alignment rule is the type's, so that passes; a half4 read from the same address is still
    misaligned."""
    src = torch.arange(40, dtype=torch.float16)
    out = torch.zeros(8, 4, dtype=torch.float16)
    run_corpus(
        "underaligned_struct_copy", grid=(1,), threads=(8,), buffers={0: src, 1: out, 2: b"\0" * 4}
    )
    assert torch.equal(out.flatten(), src[1:33])
    with pytest.raises(SimulatorError, match="misaligned device read of 8 bytes"):
        buffers = {0: src, 1: out, 2: struct.pack("<I", 1)}
        run_corpus("underaligned_struct_copy", grid=(1,), threads=(8,), buffers=buffers)


def test_an_included_metal_file_is_part_of_the_build(tmp_path):
    """llama.cpp's fa_f16.metal includes fa_common.metal, which holds the kernel: editing the
    included .metal must rebuild the library (the build's key hashed only .h files, so an edit
    ran the stale kernel)."""
    (tmp_path / "main.metal").write_text(
        '#include <metal_stdlib>\nusing namespace metal;\n#include "body.metal"\n'
    )
    body = tmp_path / "body.metal"
    kernel = "kernel void included_body(device float* out [[buffer(0)]]) {{ out[0] = {}; }}\n"
    for value in (1.0, 2.0):
        body.write_text(kernel.format(value))
        out = torch.zeros(1)
        sim.run_kernel(
            "included_body",
            sources=[tmp_path / "main.metal"],
            grid=(1,),
            threads=(1,),
            buffers={0: out},
        )
        assert out.item() == value
