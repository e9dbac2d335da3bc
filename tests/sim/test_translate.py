"""The MSL pre-pass (torch_steel/sim/translate.py) and what the shim refuses at compile time.

Unit tests look at the translated text; the refusal tests translate a small kernel and run
`clang++-19 -fsyntax-only` on it against the shim: the control snippet must compile, each
broken variant (double, mixed address spaces, exceptions, allocation, std::) must not.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from torch_steel.sim.translate import TranslateError, translate

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "mps_src" / "sim" / "shim"


def tr(src: str) -> str:
    return translate(src, "k.metal")


def squash(s: str) -> str:
    return re.sub(r"\s+", "", s)


MARKER = re.compile(r'# (\d+) "([^"]*)"')


def by_line(out: str, path: str = "k.metal") -> list[str]:
    """The translated text of each line of the original file `path` (index n: line n + 1), as
    the preprocessor's line markers in the output attribute it."""
    lines: dict[int, list[str]] = {}
    where, n = None, 0
    for text in out.split("\n"):
        m = MARKER.match(text)
        if m:
            where, n = m.group(2), int(m.group(1))
            continue
        if where == path and text.strip():
            lines.setdefault(n, []).append(text)
        n += 1
    last = max(lines, default=0)
    return [" ".join(lines.get(i, [])) for i in range(1, last + 1)] + [""]


# ---------------------------------------------------------------------------- line keeping


def msl_sources() -> list[Path]:
    # The kernels that include PyTorch's or MLX's headers are the corpus tests' (they need the
    # wheels).
    kernels = sorted((Path(__file__).parent / "kernels").glob("*.metal"))
    files = sorted((ROOT / "shaders").rglob("*.metal"))
    return files + [k for k in kernels if not k.name.startswith(("pytorch_", "mlx_"))]


@pytest.mark.parametrize("path", msl_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_line_stays_where_it_was(path):
    """The pre-pass preprocesses; the line markers in its output give every code line of the
    file (and of its headers) its original line, so compiler errors and reports point there."""
    src = path.read_text()
    out = translate(src, str(path), [ROOT / "shaders", path.parent / "accepted_inc"])
    lines = by_line(out, str(path))
    checked = 0
    for n, original in enumerate(src.split("\n")):
        # An identifier that starts the line and survives (macros and MSL attributes do not)
        # is on that line.
        word = re.match(r"\s*([A-Za-z_]\w*)", original)
        if not word or word.group(1) in ("kernel", "function_constant", "constant"):
            continue
        survives = re.compile(rf"\b{word.group(1)}\b")
        if n < len(lines) and lines[n] and survives.search(out):
            assert survives.search(lines[n]), (n + 1, original, lines[n])
            checked += 1
    assert checked > 0


# ---------------------------------------------------------------------------- kernels

KERNEL = """\
#include <metal_stdlib>
using namespace metal;
kernel void add(const device float* a [[buffer(0)]],
                device float* out [[buffer(1)]],
                constant uint& n [[buffer(2)]],
                threadgroup float* scratch [[threadgroup(0)]],
                uint3 gid [[thread_position_in_grid]],
                ushort lane [[thread_index_in_simdgroup]]) {
  out[gid.x] = a[gid.x];
}
"""


def test_plain_kernel_is_registered_with_its_parameter_sources():
    out = tr(KERNEL)
    assert "[[" not in out and "kernel void" not in out
    assert "void add(const device float* a ," in out or "void add(const device float* a," in out
    params = re.search(r"struct __steel_kernel_add \{ using params = (.*?); \};", out).group(1)
    assert squash(params) == squash(
        "::steel_shim::plist<::steel_shim::buffer<(0)>, ::steel_shim::buffer<(1)>, "
        "::steel_shim::buffer<(2)>, ::steel_shim::threadgroup_buffer<(0)>, "
        "::steel_shim::attr<::steel_shim::kThreadPositionInGrid>, "
        "::steel_shim::attr<::steel_shim::kThreadIndexInSimdgroup>>"
    )
    assert 'STEEL_SIM_REGISTER(("add"), (__steel_kernel_add::params), add)' in out
    # The registration follows the body's closing brace, on its line.
    assert by_line(out)[9].startswith("} struct __steel_kernel_add")


TEMPLATE_KERNEL = """\
namespace ns {
template <typename T, int N>
[[kernel]] void scale(device T* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] *= T(N);
}
}  // namespace ns
template [[host_name("scale_f16_2")]] [[kernel]] decltype(ns::scale<half, 2>) ns::scale<half, 2>;
#define INST(name, T) \\
  template [[host_name("scale_" #name)]] [[kernel]] \\
  decltype(ns::scale<T, 3>) ns::scale<T, 3>;
INST(f32, float)
INST(f16, half)
"""


def test_template_kernel_instantiations_are_registered():
    out = tr(TEMPLATE_KERNEL)
    lines = by_line(out)
    assert "STEEL_SIM_REGISTER" not in lines[4]  # a template: only its instances register
    assert "struct __steel_kernel_scale" in lines[4]
    assert squash(lines[6]) == squash(
        'STEEL_SIM_REGISTER(("scale_f16_2"), '
        "(ns::__steel_kernel_scale::template instance<half, 2>), ns::scale<half, 2>)"
    )
    # Instantiations by a macro are judged expanded, at the line of each use.
    for n, (name, t) in ((10, ("f32", "float")), (11, ("f16", "half"))):
        assert squash(lines[n]) == squash(
            f'STEEL_SIM_REGISTER(("scale_" "{name}"), '
            f"(ns::__steel_kernel_scale::template instance<{t}, 3>), ns::scale<{t}, 3>)"
        )


def test_function_constant_parameters_are_conditional():
    out = tr(
        "kernel void k(device float* a [[buffer(0)]],\n"
        "              device float* m [[buffer(3), function_constant(has_mask)]]) {}\n"
    )
    assert "static bool steel_present_1() { return bool(has_mask); }" in out
    assert (
        "::steel_shim::present_if<::steel_shim::buffer<(3)>, &__steel_kernel_k::steel_present_1>"
        in out
    )


def test_long_form_instantiation_is_registered():
    src = (
        'template [[host_name("scale_f32")]] [[kernel]] void ns::scale<float, 4>(\n'
        "    device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]);\n"
    )
    lines = by_line(tr(src))
    assert squash(lines[0]) == squash(
        'STEEL_SIM_REGISTER(("scale_f32"), '
        "(ns::__steel_kernel_scale::template instance<float, 4>), ns::scale<float, 4>)"
    )
    assert lines[1] == ""


@pytest.mark.parametrize(
    ("src", "message"),
    [
        # A buffer without [[buffer(n)]] takes the first free index (test_accepted); a scalar
        # parameter without an attribute is no argument Metal knows how to bind.
        ("kernel void f(float a) {}", "has no [[...]] attribute"),
        ("kernel void f(float4 p [[stage_in]]) {}", "[[stage_in]] is not supported"),
        ("#include <vector>\n", "MSL has no C++ standard library"),
        ("#define K kernel void f(float a) {}\nK", "has no [[...]] attribute"),
        ("#if __METAL_VERSION__ >= 310 && __METAL__\nfloat x = 1.0L;\n#endif", "no double"),
        ("float x = 1.0L;", "MSL has no double"),
        ("void f() { static int calls = 0; }", "static variables in functions"),
        ("void f(int n) { again: if (--n) goto again; }", "'goto' is not MSL"),
        ("struct S { virtual float f(); };", "'virtual' is not MSL"),
        ("void f() { thread_local const int k = 1; }", "'thread_local' is not MSL"),
        ("thread_local int counter;", "'thread_local' is not MSL"),
        ("struct A {}; bool f(A a) { return typeid(a) == typeid(A); }", "'typeid' is not MSL"),
        ("void f(int x) { register int y = x; }", "'register' is not MSL"),
        ("[[kernel]] int f(device float* o [[buffer(0)]]) { return 0; }", "returns void"),
        ("[[kernel]] float4 f(uint i [[thread_position_in_grid]]) { return 0; }", "returns void"),
        (
            'template [[host_name("x")]] [[kernel]] void f(int x [[buffer(0)]]);',
            "kernel instantiations must name the template arguments",
        ),
    ],
)
def test_unsupported_constructs_name_file_and_line(src, message):
    with pytest.raises(TranslateError) as e:
        tr("\n" + src)
    line = 3 if src.startswith(("#if", "#define")) else 2  # a macro's: where it is used
    assert str(e.value).startswith(f"k.metal:{line}:")
    assert message in str(e.value)


def test_host_only_includes_are_allowed_outside_metal():
    src = "#ifdef __METAL_VERSION__\n#include <metal_stdlib>\n#else\n#include <cstdint>\n#endif\n"
    assert "#include <metal_stdlib>" in tr(src) and "cstdint" not in tr(src)
    with pytest.raises(TranslateError, match="k.metal:3: #include <cstdint>: MSL has no C"):
        tr("#ifndef __METAL_VERSION__\n#else\n#include <cstdint>\n#endif\n")


def test_macros_are_judged_expanded_and_conditions_with_metal_predefined_macros():
    """Metal's compiler preprocesses first (issue 26, findings 4 and 7): a macro that makes a
    declaration constant is seen expanded, kernels defined by a function-like macro are kernels,
    and #if sees __METAL_VERSION__ of the language version (-std) and __HAVE_TENSOR__ in MSL 4."""
    src = """\
#define C10_METAL_CONSTEXPR constant constexpr
C10_METAL_CONSTEXPR unsigned error_message_count = 30;
#define INSTANTIATE(NAME, T) \\
  kernel void NAME(device T* a [[buffer(0)]], uint i [[thread_position_in_grid]]) { a[i] = 1; }
INSTANTIATE(fill_float, float)
INSTANTIATE(fill_half, half)
#if __METAL_VERSION__ >= 320
constant int version_32 = 1;
#elif __METAL_VERSION__ == 310 && defined(__METAL__) && !defined(__x86_64__)
constant int version_31 = 1;
#endif
#ifdef __HAVE_TENSOR__
constant int tensors = 1;
#endif
"""
    lines = by_line(tr(src))
    assert lines[1].strip() == "constant constexpr unsigned error_message_count = 30;"
    for n, name, t in ((4, "fill_float", "float"), (5, "fill_half", "half")):
        assert f"void {name}(device {t}* a" in lines[n]
        assert (
            f'STEEL_SIM_REGISTER(("{name}"), (__steel_kernel_{name}::params), {name})' in (lines[n])
        )
    out = "\n".join(lines)
    assert "version_31" in out and "version_32" not in out and "tensors" not in out
    later = "\n".join(by_line(translate(src, "k.metal", std="metal4.0")))
    assert "version_32" in later and "tensors" in later
    with pytest.raises(TranslateError, match="unknown language version"):
        translate(src, "k.metal", std="metal9")


def test_language_version_follows_what_the_file_uses():
    """Issue 26 finding 10: MSL 4 by what the file includes (any name), or by -std."""
    tensor = "#include <metal_tensor>\n"
    assert tr(tensor).startswith("#define STEEL_SIM_METAL_VERSION 400\n")
    assert tr("void f();\n").startswith("#define STEEL_SIM_METAL_VERSION 310\n")
    assert translate("void f();\n", "k.metal", std="metal3.2").startswith(
        "#define STEEL_SIM_METAL_VERSION 320\n"
    )


# ---------------------------------------------------------------------------- declarations


def test_threadgroup_arrays_in_bodies_become_shared_storage():
    src = """\
void f(threadgroup float* p [[threadgroup(0)]]) {}
kernel void k(uint i [[thread_index_in_threadgroup]]) {
  threadgroup float a[64];
  threadgroup half b[4][8], c[2];
  alignas(16) threadgroup T d[N * sizeof(T)];
  threadgroup float* q = a;
  threadgroup float s;
  for (int j = 0; j < 2; ++j) threadgroup_barrier(mem_flags::mem_threadgroup);
}
"""
    lines = by_line(tr(src))
    assert re.fullmatch(
        r"  threadgroup float \(&a\)\[ 64 \] = ::steel_shim::tg_array<float\[ 64 \]>"
        r"\(\d+u, __PRETTY_FUNCTION__\);",
        lines[2],
    )
    assert "(&b)[ 4 ] [ 8 ]" in lines[3] and "tg_array<half[ 2 ]>" in lines[3]
    assert "tg_array<T[ N * sizeof ( T ) ], 16>" in lines[4]
    assert lines[5] == "  threadgroup float* q = a;"
    assert "threadgroup float &s = ::steel_shim::tg_array<float>(" in lines[6]
    ids = re.findall(r"tg_array<[^>]*>\((\d+)u", "\n".join(lines))
    assert len(ids) == len(set(ids)) == 5  # one id per declaration


def test_function_constants():
    src = """\
constant bool has_bias [[function_constant(3)]];
constant int act [[function_constant(STEEL_ACT + 1)]];
constant bool plain = has_bias && act == 2;
constant float kPi = 3.14159;
constant float kTable[2] = {1.0, 2.0};
struct S { static constant constexpr int x = 3; };
"""
    lines = by_line(tr(src))
    assert lines[0] == ("static constexpr ::steel_shim::function_constant<bool, (3)> has_bias{};")
    assert "function_constant<int, (STEEL_ACT + 1)> act{};" in lines[1]
    assert squash(lines[2]) == squash(
        "static constexpr bool __steel_fc_plain() { return ( has_bias && act == 2); } static "
        "constexpr ::steel_shim::derived_constant<bool, &__steel_fc_plain> plain{};"
    )
    assert lines[3] == "constant float kPi = 3.14159f;"  # a plain constant stays a constant
    assert lines[4] == "constant float kTable[2] = {1.0f, 2.0f};"
    assert "static constant constexpr int x = 3;" in lines[5]


def test_structs_get_address_space_copies():
    src = """\
template <typename T, short N> struct alignas(N * sizeof(T)) Chunk { T v[N]; };
class Loader : public Base<int> { int x; };
enum class Mode { a, b };
struct Fwd;
void f() { struct Local { int y; }; }
"""
    lines = by_line(tr(src))
    assert "Chunk { STEEL_SIM_AS_COPY(Chunk) T v[N]; };" in lines[0]
    assert "{ public: STEEL_SIM_AS_COPY(Loader) private: int x; };" in lines[1]
    assert "STEEL_SIM_AS_COPY" not in "".join(lines[2:])


def test_copies_out_of_other_spaces_only_where_a_value_is_taken():
    src = """\
P get(constant P* p) { return *p; }
const device P& ref(const device P* p) { return *p; }
const device auto& fwd(const device P* p) { return p[0]; }
void none(device float* o) { return other(o); }
float use(P p, device P* q) { auto l = [&]() { return *q; }; return take(p) + use(*q, q); }
template <typename T> float deduce(const device T& x) { return use(*x, x) + deduce(*x); }
"""
    lines = by_line(tr(src))
    # By-value returns (also the lambda's, deduced) copy; references (also deduced) and void
    # keep what they return.
    assert squash("{ return ::steel_shim::as_local(*p); }") in squash(lines[0])
    assert "as_local" not in "".join(lines[1:4])
    assert squash("return ::steel_shim::as_local(*q); }") in squash(lines[4])
    # Arguments that dereference, in calls of the non-template functions defined so far; not a
    # bare name, and not a template's (which would deduce from the proxy).
    assert squash("use((::steel_shim::arg_pass(), *q), q)") in squash(lines[4])
    assert "take(p)" in lines[4]
    assert squash("use((::steel_shim::arg_pass(), *x), x) + deduce(*x)") in squash(lines[5])


# ---------------------------------------------------------------------------- expressions


@pytest.mark.parametrize(
    ("src", "expected"),
    [
        ("x = float4(1, 2, a.xy);", "x = ::steel_shim::vmake<float4>(1, 2, a.xy);"),
        ("x = metal::half2(h);", "x = ::steel_shim::vmake<half2>(h);"),
        ("x = vec<T, 2>(a, b);", "x = ::steel_shim::vmake<metal::vec < T , 2 >>(a, b);"),
        ("x = (float4)h * 2;", "x = ::steel_shim::cast<float4>() ->* h * 2;"),
        ("x = (int2)(v);", "x = ::steel_shim::cast<int2>() ->* (v);"),
        ("return (half2)v;", "return ::steel_shim::cast<half2>() ->* v;"),
        ("x = static_cast<float2>(h);", "x = ::steel_shim::vmake<float2>(h);"),
        ("x = static_cast<vec<T, 4>>(h);", "x = ::steel_shim::vmake<metal::vec < T , 4 >>(h);"),
        ("x = static_cast<float>(h);", "x = static_cast<float>(h);"),
        # `>>` closing two template argument lists is no shift: the commas inside them do not
        # split the constructor's arguments, and no argument is taken for a comparison.
        (
            "x = float4(as_type<vec<T, 4>>(w.xy));",
            "x = ::steel_shim::vmake<float4>(as_type<vec<T, 4>>(w.xy));",
        ),
        (
            "x = float4(a < (b >> 2));",
            "x = ::steel_shim::vmake<float4>( ::steel_shim::mask01(a < (b >> 2)));",
        ),
        (
            "void f() { float4 y; } float4 g(float4 v);",
            "void f() { float4 y; } float4 g(float4 v);",
        ),
        ("n = sizeof(float4) * 2;", "n = sizeof(float4) * 2;"),
        ("operator float4() const;", "operator float4() const;"),
        ("x = 1.0 + .5 + 1e-3 + 2.f + 0x1p-3;", "x = 1.0f + .5f + 1e-3f + 2.f + 0x1p-3f;"),
        ("h = 1.5h * x;", "h = 1.5f16 * x;"),
        ("i = 10u + 0x1F + 3;", "i = 10u + 0x1F + 3;"),
        # Only the literal's address space changes (constant, as in MSL), not its text.
        ('s = "float4(1.0)"; // float4(1.0)', 's = (::steel_shim::literal_pass(), "float4(1.0)");'),
    ],
)
def test_expression_rewrites(src, expected):
    assert by_line(tr(src))[0] == expected


def test_other_attributes_are_removed():
    out = tr("[[max_total_threads_per_threadgroup(256)]] void f([[maybe_unused]] int x) {}")
    assert by_line(out)[0] == " void f([[maybe_unused]] int x) {}"


# ---------------------------------------------------------------------------- compile refusals

CONTROL = """\
#include <metal_stdlib>
using namespace metal;
struct Chunk { float v[4]; };
inline void take_tg(threadgroup float* p) { p[0] = 1.0; }
inline void take_thread(thread float* p) { p[0] = 1.0; }
kernel void k(device float* out [[buffer(0)]], constant float* c [[buffer(1)]],
              uint i [[thread_position_in_grid]]) {
  threadgroup float tg[64];
  threadgroup Chunk chunks[2];
  float local[2] = {0, 0};
  take_tg(tg);
  take_thread(local);
  chunks[0] = *(const device Chunk*)out;  // struct copy across address spaces is MSL
  out[i] = c[i] + tg[i] + local[0] + chunks[0].v[0];
  /*BROKEN*/
}
"""

BROKEN = {
    "double": "double d = out[i]; out[i] = float(d);",
    "device_to_threadgroup": "take_tg(out);",
    "device_to_thread": "take_thread(out);",
    "constant_to_device": "device float* p = c; p[0] = 1;",
    "threadgroup_to_device": "device float* p = tg; p[0] = 1;",
    "throw": "if (i > 100) throw 1;",
    "try": "try { out[i] = 1; } catch (...) {}",
    "new": "float* p = new float[4]; out[i] = p[0];",
    "malloc": "float* p = (float*)malloc(16); out[i] = p[0];",
    "std": "out[i] = std::max(1.0f, 2.0f);",
    # The constant address space is read-only in MSL.
    "write_constant": "c[i] = out[i];",
    "write_constant_copy": "constant float* q = c + 1; *q = 0;",
    # simd_* functions take no bool, long or ulong operands (MSL 6.9.2).
    "simd_sum_long": "out[i] = float(simd_sum(long(i)));",
    "simd_shuffle_bool": "out[i] = simd_shuffle(i > 3, ushort(0)) ? 1 : 0;",
    # MSL 3.1's atomic_float has no min/max (issue 26 finding 6).
    "atomic_float_max": (
        "atomic_fetch_max_explicit((device atomic_float*)out, 1.0f, memory_order_relaxed);"
    ),
    "atomic_float_min": (
        "atomic_fetch_min_explicit((device atomic_float*)out, 1.0f, memory_order_relaxed);"
    ),
}


def syntax_check(tmp_path: Path, src: str) -> subprocess.CompletedProcess:
    f = tmp_path / "k.cpp"
    f.write_text(translate(src, "k.metal"))
    return subprocess.run(
        [
            "clang++-19",
            "-x",
            "c++",
            "-std=c++23",
            "-fsyntax-only",
            "-fno-exceptions",
            "-Wno-unknown-attributes",
            "-I",
            str(SHIM),
            "-I",
            str(ROOT / "mps_src"),
            str(f),
        ],
        capture_output=True,
        text=True,
        check=False,
    )


needs_clang = pytest.mark.skipif(
    shutil.which("clang++-19") is None,
    reason="clang-19 is not installed (apt-get install clang-19)",
)


@needs_clang
def test_control_kernel_compiles(tmp_path):
    proc = syntax_check(tmp_path, CONTROL)
    assert proc.returncode == 0, proc.stderr


@needs_clang
@pytest.mark.parametrize("name", list(BROKEN))
def test_msl_violations_do_not_compile(tmp_path, name):
    proc = syntax_check(tmp_path, CONTROL.replace("/*BROKEN*/", BROKEN[name]))
    assert proc.returncode != 0
    # The error points at the kernel's own line in the original file.
    assert "k.metal:15:" in proc.stderr, proc.stderr


KERNEL_WITH = (
    "#include <metal_stdlib>\nusing namespace metal;\n"
    "kernel void k(device float* out [[buffer(0)]], DECL) { out[0] = float(USE); }\n"
)
ON_DEVICE = "points to device or constant memory"
BAD_PARAMETERS = {
    "thread_pointer_buffer": ("thread float* p [[buffer(1)]]", "p[0]", ON_DEVICE),
    "threadgroup_pointer_buffer": ("threadgroup float* p [[buffer(1)]]", "p[0]", ON_DEVICE),
    "by_value_buffer": ("float p [[buffer(1)]]", "p", "is a pointer or a reference"),
    "device_pointer_threadgroup": (
        "device float* p [[threadgroup(0)]]",
        "p[0]",
        "is a threadgroup pointer",
    ),
    "float_position": ("float p [[thread_position_in_grid]]", "p", "is uint or ushort"),
    "int_lane": ("int p [[thread_index_in_simdgroup]]", "p", "is uint or ushort"),
}
GOOD_PARAMETERS = [
    ("constant float* p [[buffer(1)]]", "p[0]"),
    ("const device float& p [[buffer(1)]]", "p"),
    ("threadgroup float* p [[threadgroup(0)]]", "p[0]"),
    ("ushort2 p [[thread_position_in_grid]]", "p.x"),
    ("const uint p [[thread_index_in_simdgroup]]", "p"),
]


@needs_clang
@pytest.mark.parametrize("name", list(BAD_PARAMETERS))
def test_kernel_parameters_of_types_msl_refuses_do_not_compile(tmp_path, name):
    """MSL's buffer arguments are device or constant pointers or references, [[threadgroup(n)]]
    ones threadgroup pointers, and thread-position attributes uint or ushort (or vectors)."""
    decl, use, message = BAD_PARAMETERS[name]
    proc = syntax_check(tmp_path, KERNEL_WITH.replace("DECL", decl).replace("USE", use))
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


@needs_clang
@pytest.mark.parametrize(("decl", "use"), GOOD_PARAMETERS)
def test_kernel_parameters_msl_allows_compile(tmp_path, decl, use):
    proc = syntax_check(tmp_path, KERNEL_WITH.replace("DECL", decl).replace("USE", use))
    assert proc.returncode == 0, proc.stderr
