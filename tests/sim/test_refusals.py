"""Constructs that Metal refuses must be refused here too, by the pre-pass (translate) or when
the shaders are compiled (kernels: tests/sim/kernels/lang_refused.metal)."""

from pathlib import Path

import pytest
import torch
from sim_helpers import requires_clang

from torch_steel import sim
from torch_steel.errors import SimulatorError
from torch_steel.sim.translate import TranslateError, translate

KERNELS = Path(__file__).parent / "kernels"

PRE_PASS = {
    "namespace-scope variable": ("int counter = 0;", "mutable namespace-scope variables"),
    "namespace-scope array": ("float table[4];", "mutable namespace-scope variables"),
    "static data member": ("struct S { static int count; };", "mutable static data members"),
    "auto parameter": ("void f(auto x) {}", "no `auto` function parameters"),
    "auto parameter, decltype(auto) return": (
        "decltype(auto) f(int n, auto x) { return x; }",
        "no `auto` function parameters",
    ),
    "deducing this": ("struct S { int f(this S& self); };", "no explicit object parameters"),
    "requires": ("template <typename T> requires true void g(T);", "no requires clauses"),
    "consteval": ("consteval int f() { return 1; }", "no consteval"),
    "function pointer": ("void (*callback)(int);", "no function pointers"),
    "two parameters, one buffer": (
        "kernel void k(device float* a [[buffer(0)]], device float* b [[buffer(0)]]) {}",
        r"two kernel parameters with \[\[buffer\(0\)\]\]",
    ),
}


@pytest.mark.parametrize("case", sorted(PRE_PASS))
def test_pre_pass_refuses(case):
    src, message = PRE_PASS[case]
    with pytest.raises(TranslateError, match=message):
        translate(src, "x.metal")


def test_pre_pass_accepts_the_msl_forms():
    src = (
        "constant float k = 1.0f;\n"
        "struct S { float a; static constexpr int n = 3; int f(int x); int b[4]; };\n"
        "void f(device float* q) {\n"
        "  int counter = 0; float table[4];\n"
        "  auto g = [](auto x) { return x; };\n"
        "  device float* p = (device float*)q + 1;\n"
        "}\n"
        "decltype(auto) h(int x) { return x; }\n"
        "template <typename T> decltype(auto) first(thread T& v) { return (v[0]); }\n"
        "struct R { decltype(auto) get(int i) const { return i; } };\n"
    )
    translate(src, "x.metal")


COMPILE = [
    "a cast between address spaces is not MSL",
    "reinterpret_cast from 'threadgroup float *' to 'device float *' is not allowed",
    "reinterpret_cast from 'device float *' to 'float *' is not allowed",
    "variable length arrays",
    "memory_order_seq_cst",
    "64-bit atomics support only atomic_fetch_min/max_explicit on ulong",
    "atomic_bool has no fetch operations",
    "atomic_float is supported in device memory only",
]


@requires_clang
def test_compiler_refuses():
    with pytest.raises(SimulatorError) as e:
        sim.run_kernel(
            "refused_vla",
            sources=[KERNELS / "lang_refused.metal"],
            grid=(1,),
            threads=(1,),
            buffers={0: torch.zeros(1)},
        )
    for message in COMPILE:
        assert message in str(e.value), message
