"""The source pre-pass of the Metal simulator: real MSL in, C++ for the shim out.

The simulator compiles each shipped .metal file as C++ (clang 19) against the shim in
mps_src/sim/shim (`#include <metal_stdlib>` finds it). The pass judges what Metal's compiler
judges: the file is first preprocessed with its headers (clang -E, with the macros Metal
predefines for the language version: macros expanded, #if evaluated; see _preprocess), and the
preprocessor's line markers stay in the output, so that compiler errors, the messages of this
pass and checker reports name the original file and line (no rewrite adds or removes a line).
Most of MSL compiles as is; this pass rewrites the few constructs C++ cannot express:

- kernels: `[[kernel]] void f(... [[buffer(0)]], uint3 tid [[thread_position_in_grid]])` loses
  its attributes, and a struct `__steel_kernel_f` after its body records what each parameter
  asks for (a `[[buffer(n), function_constant(c)]]` one only when c holds);
  `template [[host_name("x")]] [[kernel]] decltype(f<..>) f<..>;` (or `... void f<..>(...);`;
  `[[kernel]]` may be left out for a kernel template's instance) and every non-template kernel
  become a registration under the host name;
- `threadgroup T a[N];` in a function body becomes a reference to storage that the runtime
  shares between the lanes of a threadgroup;
- `constant T x [[function_constant(i)]];` becomes an object that reads the dispatch's value;
  a namespace-scope `constant T y = <expression>;` becomes one that evaluates it at each use;
- MSL vector construction and conversion (`float4(h)`, `float4(1, 2, a.xy)`, `(float4)h`,
  `static_cast<float4>(h)`, `vec<T, 2>(...)`), which C++ reads as bitcasts or rejects, become
  calls to the shim;
- floating-point literals without a suffix get `f` (MSL has no double), `h` becomes `f16`;
- every struct and class gets STEEL_SIM_AS_COPY (assignment across address spaces), the
  initializer of a local variable of class type and the operand of `return` in a function
  returning by value go through steel_shim::as_local (copies across address spaces,
  `Params p = *params;`, `return *params;`), and call arguments that dereference or subscript
  (`f(*params)`, `f(p[i])`) through steel_shim::arg_pass (by-value parameters);
- address-space-qualified member functions (`float f() const device`, declared, defined in
  the class or outside it) are renamed and reached through explicit-object templates;
- a kernel's device, constant or threadgroup parameter without [[buffer(n)]] or
  [[threadgroup(n)]] gets the first index no other parameter takes, as Metal assigns it;
- string literals become `constant char*` (MSL's address space for them), through
  steel_shim::literal_pass; casts to and constructions of a template's type parameter
  (`(q4_t) x`, `s2_t(x)`) go through the shim's vector-aware conversions;
- `#pragma unroll` with a count naming macros is dropped (no effect on results; preprocessing
  has removed the macros);
- other MSL attributes are removed.

Constructs outside MSL (C++ standard library includes, kernel parameters without attributes
that are no buffers, mutable static variables in functions) raise TranslateError naming
file:line. The shim refuses the rest (double, exceptions, allocation) at compile time.
"""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TranslateError", "translate"]


# C++ that the Metal Shading Language specification lists as unavailable ("Metal restrictions")
# and that clang would accept here; the rest (exceptions, new/delete, double, the standard
# library) is poisoned in the shim's <metal_stdlib>.
_NOT_MSL = {
    "goto": "MSL has no goto",
    "virtual": "MSL has no virtual functions",
    "thread_local": "MSL has no thread_local storage",
    "typeid": "MSL has no run-time type identification",
    "dynamic_cast": "MSL has no run-time type identification",
    "register": "MSL has no register storage class",
    # MSL is C++17-based: what C++20 and C++23 added is refused (the simulator compiles shaders
    # as C++23 for its own reasons, steel_shim/construct.h).
    "requires": "MSL is based on C++17: no requires clauses",
    "concept": "MSL is based on C++17: no concepts",
    "consteval": "MSL is based on C++17: no consteval",
    "constinit": "MSL is based on C++17: no constinit",
    "co_await": "MSL has no coroutines",
    "co_yield": "MSL has no coroutines",
    "co_return": "MSL has no coroutines",
}


class TranslateError(ValueError):
    """MSL that the simulator does not support; the message starts with file:line."""


# MSL's scalar element types, each of which also names vectors of 2, 3 and 4.
SCALAR_TYPES = (
    "bool",
    "char",
    "uchar",
    "short",
    "ushort",
    "int",
    "uint",
    "long",
    "ulong",
    "half",
    "bfloat",
    "float",
)
VECTOR_TYPES = frozenset(f"{base}{n}" for base in SCALAR_TYPES for n in (2, 3, 4))

# Kernel parameter attributes -> the shim's argument source.
POSITION_ATTRIBUTES = {
    "thread_position_in_grid": "kThreadPositionInGrid",
    "threadgroup_position_in_grid": "kThreadgroupPositionInGrid",
    "thread_position_in_threadgroup": "kThreadPositionInThreadgroup",
    "threads_per_threadgroup": "kThreadsPerThreadgroup",
    "dispatch_threads_per_threadgroup": "kDispatchThreadsPerThreadgroup",
    "threadgroups_per_grid": "kThreadgroupsPerGrid",
    "threads_per_grid": "kThreadsPerGrid",
    "dispatch_threads_per_grid": "kThreadsPerGrid",
    "thread_index_in_threadgroup": "kThreadIndexInThreadgroup",
    "simdgroup_index_in_threadgroup": "kSimdgroupIndexInThreadgroup",
    "thread_index_in_simdgroup": "kThreadIndexInSimdgroup",
    "simdgroups_per_threadgroup": "kSimdgroupsPerThreadgroup",
    "dispatch_simdgroups_per_threadgroup": "kSimdgroupsPerThreadgroup",
    "threads_per_simdgroup": "kThreadsPerSimdgroup",
    "thread_execution_width": "kThreadsPerSimdgroup",
}

_ACCESS = ("public", "private", "protected")

# Attributes C++ knows; everything else in [[...]] is MSL's and is removed.
CXX_ATTRIBUTES = frozenset(
    {
        "maybe_unused",
        "nodiscard",
        "likely",
        "unlikely",
        "fallthrough",
        "noreturn",
        "deprecated",
        "clang",
    }
)

# Headers a shader may include with <...>: the shim's, <simd/simd.h>, and headers of the
# kernel's own tree by path (`<dir/name.h>`, found through include directories). The C++
# standard library's (<cmath>, <vector>, <math.h>) are refused.
METAL_HEADERS = re.compile(r"metal_\w+|simd/simd\.h|[\w.-]+(?:/[\w.-]+)+\.(?:h|hpp|metal)")

_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\r\f\v]+|\\\n|\n)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<string>(?:u8|u|U|L)?"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>\.?\d(?:[eEpP][+-]|[\w.])*)
  | (?P<ident>[A-Za-z_]\w*)
  | (?P<punct>::|->\*|->|.)
    """,
    re.VERBOSE | re.DOTALL,
)

_DIRECTIVE_START = re.compile(r"[ \t]*#")

_FLOAT = re.compile(
    r"^(?:(?P<dec>(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)"
    r"|(?P<hex>0[xX][0-9a-fA-F]*\.?[0-9a-fA-F]*[pP][+-]?\d+))(?P<suffix>[a-zA-Z0-9]*)$"
)


@dataclass
class Tok:
    kind: str
    text: str
    line: int  # 1-based line of the token's first character in the original file
    col: int
    path: str = ""  # the original file (from the preprocessor's line markers)


def _tokenize(text: str, first_line: int = 1) -> list[Tok]:
    """C++ tokens of `text`, whitespace and comments included; a preprocessor line (with its
    continuations) is one `directive` token. Lines count from first_line."""
    toks: list[Tok] = []
    line, line_start, pos = first_line, 0, 0
    at_line_start = True
    n = len(text)
    while pos < n:
        if at_line_start:
            m = _DIRECTIVE_START.match(text, pos)
            if m:
                end = pos
                while True:
                    nl = text.find("\n", end)
                    if nl < 0:
                        end = n
                        break
                    # A directive ends at a newline that is not escaped and not in a comment.
                    seg = text[end:nl]
                    if seg.endswith("\\"):
                        end = nl + 1
                        continue
                    opened = seg.rfind("/*")
                    if opened >= 0 and seg.find("*/", opened) < 0:
                        close = text.find("*/", nl)
                        end = n if close < 0 else close + 2
                        continue
                    end = nl
                    break
                toks.append(Tok("directive", text[pos:end], line, pos - line_start + 1))
                nls = text.count("\n", pos, end)
                if nls:
                    line += nls
                    line_start = text.rfind("\n", pos, end) + 1
                pos = end
                at_line_start = False
                continue
        m = _TOKEN.match(text, pos)
        kind = m.lastgroup
        s = m.group()
        toks.append(Tok(kind, s, line, pos - line_start + 1))
        nls = s.count("\n")
        if nls:
            line += nls
            line_start = pos + s.rfind("\n") + 1
        if kind == "ws" and s == "\n":
            at_line_start = True
        elif kind not in ("ws", "comment"):
            at_line_start = False
        pos = m.end()
    return toks


class _Rewriter:
    """Edits over one token list: replacements keep the number of newlines they cover."""

    def __init__(self, toks: list[Tok]):
        self.toks = toks
        self.sig = [
            i for i, t in enumerate(toks) if t.kind not in ("ws", "comment", "directive_done")
        ]
        self.replace: dict[int, tuple[int, str]] = {}  # first token -> (end token, text)
        self.append: dict[int, list[str]] = {}  # after token i

    # ---- helpers over significant tokens (k indexes self.sig)
    def t(self, k: int) -> str:
        return self.toks[self.sig[k]].text if 0 <= k < len(self.sig) else ""

    def kind(self, k: int) -> str:
        return self.toks[self.sig[k]].kind if 0 <= k < len(self.sig) else ""

    def where(self, k: int) -> str:
        k = min(max(k, 0), len(self.sig) - 1)
        tok = self.toks[self.sig[k]]
        return f"{tok.path}:{tok.line}"

    def error(self, k: int, message: str) -> TranslateError:
        return TranslateError(f"{self.where(k)}: {message}")

    def match(self, k: int) -> int:
        """Index of the bracket closing the one at k."""
        open_ = self.t(k)
        close = {"(": ")", "[": "]", "{": "}", "<": ">"}[open_]
        depth = 0
        for j in range(k, len(self.sig)):
            s = self.t(j)
            if s == open_:
                depth += 1
            elif s == close:
                depth -= 1
                if depth == 0:
                    return j
            elif open_ == "<" and s in (";", "{", "}"):
                break
        raise self.error(k, f"unbalanced '{open_}'")

    def open_brace(self, k: int) -> int:
        """Index of the innermost `{` still open at token k, k included (-1 at file scope)."""
        depth = 0
        while k >= 0:
            depth += self.t(k) == "}"
            depth -= self.t(k) == "{"
            if depth < 0:
                break
            k -= 1
        return k

    def flat(self, a: int, b: int) -> str:
        """Significant tokens a..b-1 joined on one line."""
        return " ".join(self.t(k) for k in range(a, b))

    def sub(self, a: int, b: int, text: str) -> None:
        """Replaces significant tokens a..b-1 (and what lies between them) by text."""
        start, end = self.sig[a], self.sig[b - 1] + 1
        if any(t.kind == "directive_done" for t in self.toks[start:end]):
            raise self.error(
                a,
                "a preprocessor directive inside a construct the simulator "
                "rewrites is not supported",
            )
        for i in list(self.replace):
            if start <= i < end or i <= start < self.replace[i][0]:
                raise self.error(a, "overlapping rewrites (unsupported construct)")
        self.replace[start] = (end, text)

    def drop(self, a: int, b: int) -> None:
        """Removes significant tokens a..b-1 with the rewrites inside them."""
        start, end = self.sig[a], self.sig[b - 1] + 1
        for i in [i for i in self.replace if start <= i < end]:
            del self.replace[i]
        for i in [i for i in self.append if start <= i < end]:
            del self.append[i]
        self.sub(a, b, "")

    def add_after(self, k: int, text: str) -> None:
        self.append.setdefault(self.sig[k], []).append(text)

    def rendered(self, a: int, b: int) -> str:
        """Significant tokens a..b-1 as render gives them (with the rewrites made inside them),
        for a construct that replaces them by text of its own built around them."""
        return self.render(self.sig[a], self.sig[b - 1] + 1)

    def render(self, i: int = 0, stop: int | None = None) -> str:
        out: list[str] = []
        toks = self.toks
        stop = len(toks) if stop is None else stop
        while i < stop:
            if i in self.replace:
                end, text = self.replace[i]
                covered = "".join(t.text for t in toks[i:end])
                lost = covered.count("\n") - text.count("\n")
                out.append(text)
                if lost > 0:
                    out.append("\n" * lost)
                last = end - 1
                i = end
            else:
                out.append(toks[i].text)
                last = i
                i += 1
            for extra in self.append.get(last, ()):
                out.append(extra)
        return "".join(out)


def _decl_id(path: str, line: int, col: int) -> int:
    return zlib.crc32(f"{path}:{line}:{col}".encode()) & 0xFFFFFFFF


class _Translator:
    """The rewrites of one file (see the module docstring)."""

    def __init__(self):
        self.kernel_templates: set[str] = set()  # names of the kernel templates seen so far
        # Names of the functions this file has defined so far, as templates and not: only
        # calls to a non-template one get argument_copy (a template parameter `device T&`
        # deduces nothing from steel_shim::arg_pass's proxy).
        self.plain_functions: set[str] = set()
        self.template_functions: set[str] = set()

    # ------------------------------------------------------------------ expression rewrites
    def expressions(self, r: _Rewriter) -> None:
        """Literals, vector constructors and vector casts, anywhere in code."""
        k = 0
        n = len(r.sig)
        type_params = self.template_type_parameters(r)
        while k < n:
            s, kind = r.t(k), r.kind(k)
            if kind == "number":
                self.literal(r, k)
            elif kind == "string" and s.startswith('"') and self.constant_string(r, k):
                # MSL keeps string literals in the constant address space (`constant char*`
                # parameters take them, MLX's os_log fallback among them); here a literal is a
                # generic array, which steel_shim::literal_pass's comma turns into a constant
                # pointer. Adjacent literals are concatenated first.
                end = k
                while r.kind(end + 1) == "string" and r.t(end + 1).startswith('"'):
                    end += 1
                r.add_after(k - 1, " (::steel_shim::literal_pass(),")
                r.add_after(end, ")")
                k = end
            elif kind == "ident" and s in VECTOR_TYPES and r.t(k + 1) == "(":
                if r.t(k - 1) not in ("operator", ".", "->", "~", "struct", "class"):
                    a = k - 2 if r.t(k - 1) == "::" and r.t(k - 2) == "metal" else k
                    if r.t(k - 1) != "::" or a != k:
                        r.sub(a, k + 1, f"::steel_shim::vmake<{s}>")
                        self.comparison_arguments(r, k + 1)
            elif (
                kind == "ident"
                and s in type_params
                and r.t(k + 1) == "("
                and r.t(k + 2) not in ("*", "&", "^")  # `T (*f)(...)` declares
                and r.t(k - 1) not in ("operator", ".", "->", "~", "::", "typename", "<")
            ):
                # `T(x)` for a template's type parameter T, which may be a vector: MSL
                # constructs vectors from any vector of the same size, C++ only from its own.
                r.sub(k, k + 1, f"::steel_shim::construct<{s}>")
            elif kind == "ident" and s == "vec" and r.t(k + 1) == "<":
                close = r.match(k + 1)
                if r.t(close + 1) == "(" and r.t(k - 1) not in ("operator", ".", "->"):
                    a = k - 2 if r.t(k - 1) == "::" and r.t(k - 2) == "metal" else k
                    if r.t(k - 1) != "::" or a != k:
                        r.sub(a, close + 1, f"::steel_shim::vmake<metal::{r.flat(k, close + 1)}>")
                        k = close
            elif s == "static_cast" and r.t(k + 1) == "<" and self.is_vector_type(r, k + 2):
                # static_cast between clang vectors is a bitcast; in MSL it converts.
                close = r.match(k + 1)
                if r.t(close + 1) == "(":
                    target = r.flat(k + 2, close)
                    if r.t(k + 2) == "vec":
                        target = f"metal::{target}"
                    r.sub(k, close + 1, f"::steel_shim::vmake<{target}>")
                    k = close
            elif s == "[" and self.address_space_array_parameter(r, k):
                # `constant T x[N]` as a parameter: C++ refuses the qualifier on an array
                # parameter, MSL means the pointer it decays to.
                close = r.match(k)
                r.sub(k - 1, close + 1, f"* {r.t(k - 1)}")
                k = close
            elif s == "(" and self.address_space_cast(r, k):
                close = self.address_space_cast(r, k)
                r.sub(k, close + 1, f"::steel_shim::as_cast<{r.flat(k + 1, close)}>() ->* ")
                k = close
            elif (
                s == "("
                and (r.t(k + 1) in VECTOR_TYPES or r.t(k + 1) in type_params)
                and (r.t(k + 2) == ")")
            ):
                # A cast to a vector type, or to a template's type parameter, which may be one
                # (llama.cpp's `(q4_t) q4[i]`, float4 to half4): C++ reads a cast between clang
                # vectors as a bitcast, MSL converts.
                nxt, prev = r.t(k + 3), r.t(k - 1)
                operand = r.kind(k + 3) in ("ident", "number") or nxt in ("(", "-", "!", "~", "+")
                after_name = r.kind(k - 1) == "ident" and prev not in ("return", "else", "case")
                if operand and not after_name and prev not in (")", "]"):
                    r.sub(k, k + 3, f"::steel_shim::cast<{r.t(k + 1)}>() ->* ")
                    k += 2
            k += 1

    @staticmethod
    def template_type_parameters(r: _Rewriter) -> frozenset[str]:
        """The names of the file's template type parameters (`template <typename q4_t, ...>`)."""
        names = set()
        for k in range(len(r.sig)):
            if r.t(k) == "template" and r.t(k + 1) == "<":
                try:
                    close = r.match(k + 1)
                except TranslateError:
                    continue
                for j in range(k + 2, close):
                    if r.t(j) in ("typename", "class") and r.kind(j + 1) == "ident":
                        if r.t(j + 2) in (",", ">", "=") or j + 2 == close:
                            names.add(r.t(j + 1))
        return frozenset(names)

    _NOT_STRING_VALUE = frozenset({"static_assert", "_Pragma", "asm", "__asm__", "__attribute__"})

    @classmethod
    def constant_string(cls, r: _Rewriter, k: int) -> bool:
        """Whether the string literal at k is a value in code: not an operand of static_assert,
        an attribute (`[[host_name("x")]]`), `extern "C"` or `operator ""`, nor the initializer of
        a character array (`char s[] = "x"`)."""
        prev = r.t(k - 1)
        if prev in ("extern", "operator", "#") or (prev == "=" and r.t(k - 2) == "]"):
            return False
        depth = 0
        for j in range(k - 1, -1, -1):
            t = r.t(j)
            if t in (")", "]", "}"):
                depth += 1
            elif t in ("(", "[", "{"):
                if depth == 0:
                    if t == "{":
                        return True
                    if t == "(" and r.t(j - 1) in cls._NOT_STRING_VALUE:
                        return False
                    if t == "[" and r.t(j - 1) == "[":
                        return False
                else:
                    depth -= 1
            elif t == ";" and depth == 0:
                return True
        return True

    @staticmethod
    def address_space_array_parameter(r: _Rewriter, k: int) -> bool:
        """Whether the `[` at k ends a parameter `constant T name[N]` (or device, threadgroup)."""
        if r.kind(k - 1) != "ident" or r.t(k + 1) == "[":  # [[attributes]]
            return False
        if r.t(r.match(k) + 1) not in (",", ")"):
            return False
        j = k - 2
        while j >= 0 and r.t(j) not in ("(", ",", ";", "{", "}", ")", "="):
            j -= 1
        if r.t(j) not in ("(", ","):
            return False
        words = {r.t(x) for x in range(j + 1, k - 1)}
        return bool(words & {"constant", "device", "threadgroup"})

    @staticmethod
    def address_space_cast(r: _Rewriter, k: int) -> int:
        """The `)` of a C-style cast to a pointer in an address space at k (`(device T*)x`),
        or 0. Such casts become steel_shim::as_cast, which refuses to change the address space
        (clang allows it; Metal does not)."""
        j = k + 1
        while r.t(j) in ("const", "volatile"):
            j += 1
        if r.t(j) not in ("device", "threadgroup", "constant", "thread"):
            return 0
        while j < len(r.sig) and r.t(j) not in (")", ";", "{", "(", "["):
            j += 1
        if r.t(j) != ")" or r.t(j - 1) != "*":
            return 0
        prev, nxt = r.t(k - 1), r.t(j + 1)
        operand = r.kind(j + 1) in ("ident", "number") or nxt in ("(", "&", "*", "-", "!", "~")
        after_name = r.kind(k - 1) == "ident" and prev not in ("return", "else", "case")
        if not operand or after_name or prev in (")", "]"):
            return 0
        return j

    @staticmethod
    def closes_nested_templates(r: _Rewriter, a: int, b: int) -> bool:
        """Whether tokens a..b-1 hold a `>>` that closes two template argument lists, each opened
        by a lone `<` after a name, before the call or braces of the innermost
        (`as_type<vec<T, 4>>(w)`): C++11 reads it as two closing brackets, not a shift."""
        opened = 0
        for k in range(a, b):
            t, nxt = r.t(k), r.t(k + 1) if r.sig[k + 1] == r.sig[k] + 1 else ""
            prev_joined = k > a and r.sig[k] == r.sig[k - 1] + 1 and r.t(k - 1) == t
            if t == "<" and nxt not in ("<", "=") and not prev_joined and r.kind(k - 1) == "ident":
                opened += 1
            elif t == ">" and nxt == ">" and opened >= 2 and r.t(k + 2) in ("(", "{", "::"):
                return True
        return False

    @staticmethod
    def comparison_arguments(r: _Rewriter, paren: int) -> None:
        """Marks the arguments of a vector constructor at `paren` that are comparisons.

        In MSL a vector comparison is a boolN, and `float4(a > b)` is 1.0 where it holds; clang
        gives an integer mask of -1s, which would convert to -1.0. A comparison argument (one
        with ==, !=, <=, >=, or a lone < or > and no ?:) is wrapped in steel_shim::mask01,
        which turns a mask into 0/1 (scalars pass unchanged).
        """
        close = r.match(paren)
        start = paren + 1
        depth = 0

        def adjacent(k: int) -> bool:
            return r.sig[k + 1] == r.sig[k] + 1

        def is_comparison(a: int, b: int) -> bool:
            lone_lt = lone_gt = found = False
            d = 0
            k = a
            while k < b:
                t = r.t(k)
                if t in ("(", "[", "{"):
                    d += 1
                elif t in (")", "]", "}"):
                    d -= 1
                elif d == 0:
                    pair = k + 1 < b and adjacent(k)
                    nxt = r.t(k + 1) if pair else ""
                    if t == "?":
                        return False
                    if t in ("=", "!", "<", ">") and nxt == "=":
                        found = True  # == != <= >=
                        k += 1
                    elif t in ("<", ">") and nxt == t:
                        k += 1  # a shift
                    elif t == "<":
                        lone_lt = True
                    elif t == ">":
                        lone_gt = True
                k += 1
            # Both a lone < and a lone >: template arguments, most likely (vec<T, 4>(...)).
            return found or lone_lt != lone_gt

        lone = {
            r.t(k)
            for k in range(paren + 1, close)
            if r.t(k) in ("<", ">")
            and not (adjacent(k) and r.t(k + 1) in ("=", r.t(k)))
            and not (adjacent(k - 1) and r.t(k - 1) == r.t(k))
        }
        if lone == {"<", ">"} or _Translator.closes_nested_templates(r, paren + 1, close):
            return  # template arguments somewhere: commas do not separate arguments reliably
        for k in range(paren + 1, close + 1):
            t = r.t(k)
            if t in ("(", "[", "{"):
                depth += 1
            elif t in (")", "]", "}") and k != close:
                depth -= 1
            elif (t == "," and depth == 0) or k == close:
                if k > start and is_comparison(start, k):
                    r.add_after(start - 1, " ::steel_shim::mask01(")
                    r.add_after(k - 1, ")")
                start = k + 1

    @staticmethod
    def is_vector_type(r: _Rewriter, k: int) -> bool:
        """Whether a vector type name (float4, metal::half2, vec<T, N>) starts at k."""
        if r.t(k) == "metal" and r.t(k + 1) == "::":
            k += 2
        return r.t(k) in VECTOR_TYPES or (r.t(k) == "vec" and r.t(k + 1) == "<")

    def literal(self, r: _Rewriter, k: int) -> None:
        s = r.t(k)
        m = _FLOAT.match(s)
        if not m:
            return
        body, suffix = s[: len(s) - len(m.group("suffix"))], m.group("suffix")
        if suffix == "":
            r.sub(k, k + 1, body + "f")
        elif suffix in ("h", "H"):
            r.sub(k, k + 1, body + "f16")
        elif suffix in ("bf", "BF"):
            r.sub(k, k + 1, f"((bfloat){body}f)")
        elif suffix not in ("f", "F"):
            raise r.error(k, f"floating-point literal '{s}' (MSL has no double)")

    # ------------------------------------------------------------------ attributes
    @staticmethod
    def attribute_end(r: _Rewriter, k: int) -> int:
        """k is at `[` `[`: index just past the closing `]` `]`."""
        close = r.match(k)
        if r.t(close - 1) != "]":
            raise r.error(k, "malformed attribute")
        return close + 1

    @staticmethod
    def attribute_items(r: _Rewriter, a: int, b: int) -> list[tuple[str, str, int]]:
        """(name, argument text, index) of each attribute in [[ ... ]] spanning a..b-1."""
        items = []
        k = a + 2
        while k < b - 2:
            name_k = k
            name = r.t(k)
            k += 1
            while r.t(k) == "::":
                name += "::" + r.t(k + 1)
                k += 2
            arg = ""
            if r.t(k) == "(":
                close = r.match(k)
                arg = r.flat(k + 1, close)
                k = close + 1
            items.append((name, arg, name_k))
            if r.t(k) == ",":
                k += 1
        return items

    # ------------------------------------------------------------------ directives
    @staticmethod
    def directive(tok: Tok) -> str:
        """A directive of the preprocessed text: line markers and pragmas pass, the marks that
        the preprocessor's stand-ins for the shim's headers leave become their #include. An unroll
        count that names identifiers (`#pragma unroll (MIN(DK8 / 2, 4 * NSG))`, llama.cpp) is
        dropped: it changes no result, and names macros of the original file, which clang
        expands only when it compiles the pragma, after preprocessing has removed them (the
        instruction counters then see that loop as the optimizer leaves it)."""
        m = _INCLUDE_MARK.match(tok.text)
        if m:
            return f"#include <{m.group(1)}>"
        if _UNROLL_PRAGMA.match(tok.text):
            return "\n" * tok.text.count("\n")
        return tok.text

    # ------------------------------------------------------------------ statements
    def statements(self, r: _Rewriter) -> None:
        scopes: list[str] = []  # "namespace", "class", "block", "init" per open brace
        # Per open brace: whether a `return` directly in it returns by value (and may copy
        # out of another address space, return_copy).
        by_value: list[bool] = []
        k = 0
        n = len(r.sig)
        stmt_start = 0
        while k < n:
            s = r.t(k)
            at_ns = all(x == "namespace" for x in scopes)
            start_of_stmt = k == stmt_start
            if s == "[" and r.t(k + 1) == "[":
                end = self.attribute_end(r, k)
                items = self.attribute_items(r, k, end)
                names = {name for name, _, _ in items}
                if "kernel" in names:
                    k = self.kernel(r, k, end)
                    continue
                elif "function_constant" in names:
                    pass  # handled by constant_decl
                elif not all(name.split("::")[0] in CXX_ATTRIBUTES for name in names):
                    r.sub(k, end, "")
                k = end
                continue
            if s == "template" and r.t(k + 1) == "[":
                k = self.instantiation(r, k)
                stmt_start = k
                continue
            if s in _NOT_MSL:
                raise r.error(k, f"'{s}' is not MSL ({_NOT_MSL[s]})")
            if s == "this" and r.t(k - 1) in ("(", ","):
                raise r.error(k, "MSL is based on C++17: no explicit object parameters")
            if s == "auto" and r.t(k - 1) in ("(", ",") and self.in_function_parameters(r, k):
                raise r.error(k, "MSL is based on C++17: no `auto` function parameters")
            if (
                s == "("
                and r.t(k + 1) == "*"
                and self.is_function_pointer(r, k)
                and not self.in_function_parameters(r, k)
                and not self.in_template_parameters(r, k)
            ):
                # A function-pointer parameter is resolved when the call is inlined, as Apple's
                # compiler does for PyTorch's c10/metal/atomic.h, and a template's is a constant
                # of each instance (llama.cpp's `void (*deq_k)(...)` dequantizers); any other
                # function pointer needs [[visible]] functions and a visible_function_table,
                # not modelled here.
                raise r.error(
                    k,
                    "MSL has no function pointers here (only parameters of inlined functions; "
                    "[[visible]] functions and visible function tables are not simulated)",
                )
            if (
                start_of_stmt
                and (at_ns or (scopes and scopes[-1] == "class"))
                and self.mutable_variable(r, k, member=not at_ns)
            ):
                what = "static data members" if not at_ns else "namespace-scope variables"
                raise r.error(
                    k,
                    f"mutable {what} are not MSL (program-scope data is `constant`, or constexpr)",
                )
            if s == "kernel" and r.t(k + 1) == "void" and at_ns:
                k = self.kernel(r, k, k + 1)
                continue
            if start_of_stmt and s == "constant" and at_ns:
                nk = self.constant_decl(r, k)
                if nk is not None:
                    k = stmt_start = nk
                    continue
            if start_of_stmt and scopes and scopes[-1] == "block":
                if s in ("static", "thread_local") and self.mutable_static(r, k):
                    raise r.error(
                        k, "static variables in functions are not MSL (all lanes would share one)"
                    )
                nk = self.threadgroup_decl(r, k)
                if nk is not None:
                    k = stmt_start = nk
                    continue
                self.local_copy(r, k)
            if s == "return" and scopes and scopes[-1] == "block" and by_value[-1]:
                self.return_copy(r, k)
            if s == "(" and "block" in scopes:
                self.argument_copy(r, k)
            if s == ")" and (at_ns or scopes[-1] == "class"):
                self.as_member(r, k)
            if s in ("struct", "class") and r.t(k - 1) != "enum" and "block" not in scopes:
                self.struct_copy(r, k)
            if s == "{":
                kind = self.scope_kind(r, stmt_start, k)
                outer = by_value[-1] if scopes and scopes[-1] == "block" else None
                by_value.append(kind == "block" and self.returns_by_value(r, stmt_start, k, outer))
                if kind == "block" and outer is None:
                    self.record_function(r, stmt_start, k)
                scopes.append(kind)
                stmt_start = k + 1
            elif s == "}":
                if scopes:
                    scopes.pop()
                    by_value.pop()
                stmt_start = k + 1
            elif s == ";":
                stmt_start = k + 1
            elif s == ":" and r.t(k - 1) in ("public", "private", "protected"):
                stmt_start = k + 1
            elif s == ")" and scopes and scopes[-1] == "block" and self.is_control(r, k):
                stmt_start = k + 1
            elif s in ("else", "do") and scopes and scopes[-1] == "block":
                stmt_start = k + 1
            k += 1

    _NOT_VARIABLE = frozenset(
        {
            "using",
            "typedef",
            "template",
            "struct",
            "class",
            "union",
            "enum",
            "namespace",
            "static_assert",
            "extern",
            "friend",
            "public",
            "private",
            "protected",
            "operator",
            "inline",
            "kernel",
            "#",
        }
    )

    def mutable_variable(self, r: _Rewriter, k: int, member: bool) -> bool:
        """Whether the declaration starting at k (namespace scope, or a class member when
        `member`) defines a variable that is neither constant nor constexpr; a member only
        when static (non-static members are fields)."""
        if r.t(k) in self._NOT_VARIABLE or r.kind(k) not in ("ident",) or r.t(k) == "[":
            return False
        words = []
        j = k
        while j < len(r.sig) and r.t(j) not in (";", "{", "=", "(", ":"):
            if r.t(j) == "<":
                j = r.match(j) + 1
                continue
            words.append(r.t(j))
            j += 1
        if j >= len(r.sig) or r.t(j) in ("(", "{", ":") or len(words) < 2:
            return False  # a function, a definition with a body, a bit field, an expression
        if any(w in ("const", "constexpr", "constant", "operator", "~") for w in words):
            return False
        if member and "static" not in words:
            return False
        return r.kind(j - 1) == "ident" or r.t(j - 1) == "]"

    @staticmethod
    def in_function_parameters(r: _Rewriter, k: int) -> bool:
        """Whether k is inside the parameter list of a function declaration (not of a lambda,
        whose `auto` parameters C++14 has, nor a call)."""
        depth = 0
        for j in range(k - 1, -1, -1):
            t = r.t(j)
            if t == ")":
                depth += 1
            elif t == "(":
                if depth == 0:
                    # `for (auto x = ...)`, `if (auto x = ...)`: a declaration, not a parameter;
                    # `decltype(auto) f(...)`: a C++14 return type.
                    return (
                        r.kind(j - 1) == "ident"
                        and r.t(j - 1) not in ("for", "if", "while", "switch", "decltype")
                        and r.t(j - 2) not in (".", "->", "=", "(")
                    )
                depth -= 1
            elif t in (";", "{", "}"):
                return False
        return False

    @staticmethod
    def in_template_parameters(r: _Rewriter, k: int) -> bool:
        """Whether k is inside a `template <...>` parameter list (a non-type parameter there,
        `void (*f)(int)` too, is a constant of each instance)."""
        parens = angles = 0
        for j in range(k - 1, -1, -1):
            t = r.t(j)
            if t in (";", "{", "}"):
                return False
            if t == ")":
                parens += 1
            elif t == "(":
                parens -= 1
            elif parens == 0 and t in (">", ">>"):
                angles += len(t)
            elif parens == 0 and t == "<":
                if angles == 0:
                    return r.t(j - 1) == "template"
                angles -= 1
        return False

    @staticmethod
    def is_function_pointer(r: _Rewriter, k: int) -> bool:
        """`( * name ) (`: a pointer-to-function declarator, or a call through one."""
        j = k + 2
        if r.kind(j) != "ident":
            return False
        while r.kind(j) == "ident" and r.t(j + 1) == "::":
            j += 2
        return r.kind(j) == "ident" and r.t(j + 1) == ")" and r.t(j + 2) == "("

    @staticmethod
    def mutable_static(r: _Rewriter, k: int) -> bool:
        """Whether the block-scope declaration at k is a static variable that is not constant."""
        j = k
        while r.t(j) not in (";", "{", "") and r.t(j) != "=":
            if r.t(j) in ("constexpr", "constant", "const"):
                return False
            j += 1
        return True

    @staticmethod
    def is_control(r: _Rewriter, close: int) -> bool:
        """Whether the `)` at close ends the head of if/for/while/switch."""
        depth = 0
        for j in range(close, -1, -1):
            if r.t(j) == ")":
                depth += 1
            elif r.t(j) == "(":
                depth -= 1
                if depth == 0:
                    return r.t(j - 1) in ("if", "for", "while", "switch")
        return False

    @staticmethod
    def scope_kind(r: _Rewriter, stmt_start: int, brace: int) -> str:
        j = stmt_start
        if r.t(j) == "template" and r.t(j + 1) == "<":
            j = r.match(j + 1) + 1  # default template arguments are not initializers
        words = [r.t(x) for x in range(j, brace)]
        if "namespace" in words or words[:1] == ["extern"]:
            return "namespace"
        if _Translator.lambda_head(words):
            return "block"  # `auto f = [&](int i) {`: a function body, not an initializer
        # `T x = {`, `f(a, {`: a braced initializer. An `=` inside parentheses is a default
        # argument and `operator=` a name: the brace opens a function body.
        depth = 0
        for x, w in enumerate(words):
            depth += (w in ("(", "[")) - (w in (")", "]"))
            if w == "=" and depth == 0 and (x == 0 or words[x - 1] != "operator"):
                return "init"
        if words and words[-1] in (",", "(", "return"):
            return "init"
        if r.t(j) in ("struct", "class", "union", "enum"):
            return "class"
        return "block"

    # ---- template [[host_name("x")]] [[kernel]] decltype(f<...>) f<...>;
    def instantiation(self, r: _Rewriter, k: int) -> int:
        j = k + 1
        host = None
        is_kernel = False
        while r.t(j) == "[" and r.t(j + 1) == "[":
            end = self.attribute_end(r, j)
            for name, arg, _ in self.attribute_items(r, j, end):
                if name == "host_name":
                    host = arg
                elif name == "kernel":
                    is_kernel = True
            j = end
        if r.t(j) == "kernel":  # `template [[host_name("x")]] kernel void f<...>(...);`
            is_kernel = True
            j += 1
        semi = j
        while r.t(semi) != ";":
            if semi >= len(r.sig):
                raise r.error(k, "explicit instantiation without ';'")
            semi += 1
        stop = min(semi + 1, len(r.sig))
        if not is_kernel and host is None:
            return stop
        if r.t(j) == "decltype" and r.t(j + 1) == "(":
            close = r.match(j + 1)
            func = r.flat(close + 1, semi)
            name_end = close + 1
            while name_end < semi and r.t(name_end) != "<":
                name_end += 1
            qual_parts = [r.t(x) for x in range(close + 1, name_end)]
            args = r.flat(name_end + 1, r.match(name_end)) if name_end < semi else ""
        elif r.t(semi - 1) == ">" and not self.has_signature_paren(r, j, semi):
            # A function type by name: `typedef decltype(f<...>) f_t;` then
            # `template [[host_name("x")]] kernel f_t f<...>;` (llama.cpp's form).
            name_end = self.match_back(r, semi - 1)
            start = name_end - 1
            while r.t(start - 1) == "::" and r.kind(start - 2) == "ident":
                start -= 2
            func = r.flat(start, semi)
            qual_parts = [r.t(x) for x in range(start, name_end)]
            args = r.flat(name_end + 1, semi - 1)
        else:
            # The long form: template [[...]] [[kernel]] void f<...>(parameters...);
            paren = self.signature_paren(r, j, semi)
            if r.t(paren - 1) != ">":
                raise r.error(
                    j,
                    "kernel instantiations must name the template arguments: "
                    '`template [[host_name("x")]] [[kernel]] decltype(f<...>) f<...>;`',
                )
            name_end = self.match_back(r, paren - 1)
            start = name_end - 1
            while r.t(start - 1) == "::" and r.kind(start - 2) == "ident":
                start -= 2
            func = r.flat(start, paren)
            qual_parts = [r.t(x) for x in range(start, name_end)]
            args = r.flat(name_end + 1, paren - 1)
        base = qual_parts[-1]
        qual = "".join(qual_parts[:-1])
        # An instance of a kernel template is a kernel with or without [[kernel]] of its own.
        if not is_kernel and base not in self.kernel_templates:
            raise r.error(k, "[[host_name]] on an instantiation that is not [[kernel]]")
        if host is None:
            host = f'"{base}"'
        params = f"{qual}__steel_kernel_{base}"
        r.sub(
            k,
            stop,
            f"STEEL_SIM_REGISTER(({host}), ({params}::template instance<{args}>), {func})",
        )
        return stop

    @staticmethod
    def has_signature_paren(r: _Rewriter, a: int, b: int) -> bool:
        """Whether a `(` outside template arguments lies between a and b."""
        depth = 0
        for k in range(a, b):
            s = r.t(k)
            depth += (s == "<") - (s == ">")
            if s == "(" and depth == 0:
                return True
        return False

    @staticmethod
    def signature_paren(r: _Rewriter, a: int, b: int) -> int:
        """The `(` opening the parameter list between a and b (outside template arguments)."""
        depth = 0
        for k in range(a, b):
            s = r.t(k)
            if s == "<":
                depth += 1
            elif s == ">":
                depth -= 1
            elif s == "(" and depth == 0:
                return k
        raise r.error(a, "cannot find the instantiated kernel's parameter list")

    @staticmethod
    def match_back(r: _Rewriter, close: int) -> int:
        """Index of the `<` matching the `>` at close."""
        depth = 0
        for k in range(close, -1, -1):
            depth += r.t(k) == ">"
            depth -= r.t(k) == "<"
            if depth == 0:
                return k
        raise r.error(close, "unbalanced '>'")

    # ---- [[kernel]] void f(params) { body }
    def kernel(self, r: _Rewriter, marker: int, marker_end: int) -> int:
        host = None
        max_threads = None
        if r.t(marker) == "[":
            items = self.attribute_items(r, marker, marker_end)
            for name, arg, _ in items:
                if name == "host_name":
                    host = arg
                elif name == "max_total_threads_per_threadgroup":
                    max_threads = arg
                elif name != "kernel":
                    raise r.error(marker, f"unsupported kernel attribute [[{name}]]")
        r.sub(marker, marker_end, "")
        # Attributes before the marker at the start of the declaration (e.g. [[host_name]]).
        head = self.template_head(r, marker)
        j = marker_end
        declared: list[str] = []  # the tokens before the parameter list, attributes left out
        while r.t(j) != "(":
            if r.t(j) in (";", "{", "}") or j >= len(r.sig):
                raise r.error(marker, "cannot find the kernel's parameter list")
            if r.t(j) == "[" and r.t(j + 1) == "[":
                end = self.attribute_end(r, j)
                for name, arg, _ in self.attribute_items(r, j, end):
                    if name == "host_name":
                        host = arg
                    elif name == "max_total_threads_per_threadgroup":
                        max_threads = arg
                r.sub(j, end, "")
                j = end
                continue
            declared.append(r.t(j))
            j += 1
        name = r.t(j - 1)
        if head is not None:
            self.kernel_templates.add(name)
        if r.kind(j - 1) != "ident":
            raise r.error(j, "cannot find the kernel's name")
        if declared[-2:-1] != ["void"]:
            raise r.error(j - 1, "a kernel function returns void (MSL)")
        if host is None:
            host = f'"{name}"'
        close = r.match(j)
        after = close + 1
        if r.t(after) == ";":
            # A declaration (its parameters may lack attributes): the definition registers.
            x = j + 1
            while x < close:
                if r.t(x) == "[" and r.t(x + 1) == "[":
                    end = self.attribute_end(r, x)
                    r.sub(x, end, "")
                    x = end
                else:
                    x += 1
            return after + 1
        params, conditions = self.kernel_params(r, j + 1, close, f"__steel_kernel_{name}")
        if r.t(after) != "{":
            raise r.error(after, "expected the kernel's body")
        body_end = r.match(after)
        plist = f"::steel_shim::plist<{', '.join(params)}>"
        if max_threads is not None:  # checked at launch, as Metal's pipeline limits it
            plist = f"::steel_shim::limited<({max_threads}), {plist}>"
        if head is None:
            struct = (
                f" struct __steel_kernel_{name} {{{''.join(conditions)} using params = {plist}; }};"
                f" STEEL_SIM_REGISTER(({host}), (__steel_kernel_{name}::params), {name})"
            )
        else:
            # Per instantiation (the limit may depend on the template parameters): an
            # instantiation registers `instance<its template arguments>`.
            struct = (
                f" struct __steel_kernel_{name} {{{''.join(conditions)}"
                f" template <{head}> using instance = {plist}; }};"
            )
        r.add_after(body_end, struct)
        return close + 1

    @staticmethod
    def template_head(r: _Rewriter, k: int) -> str | None:
        """The parameters of the `template <...>` (maybe followed by attributes) right before
        token k, or None."""
        j = k - 1
        while r.t(j) == "]" and r.t(j - 1) == "]":
            depth = 0
            while j >= 0:
                depth += r.t(j) == "]"
                depth -= r.t(j) == "["
                if depth == 0:
                    break
                j -= 1
            j -= 1
        if r.t(j) != ">":
            return None
        close = j
        depth = 0
        while j >= 0:
            depth += r.t(j) == ">"
            depth -= r.t(j) == "<"
            if depth == 0:
                return r.flat(j + 1, close) if r.t(j - 1) == "template" else None
            j -= 1
        return None

    def kernel_params(
        self, r: _Rewriter, a: int, b: int, struct: str
    ) -> tuple[list[str], list[str]]:
        """Each parameter's argument source, and the conditions of [[function_constant(c)]]
        parameters as static functions of `struct`."""
        out: list[str] = []
        conditions: list[str] = []
        seen_slots: set[tuple[str, str]] = set()
        if a == b or (b == a + 1 and r.t(a) == "void"):
            return out, conditions
        depth = 0
        start = a
        ranges = []
        for k in range(a, b + 1):
            s = r.t(k) if k < b else ","
            if s in ("(", "[", "{", "<"):
                depth += 1
            elif s in (")", "]", "}", ">") and depth > 0:
                depth -= 1
            elif s == "," and depth == 0:
                ranges.append((start, k))
                start = k + 1
        implicit = self.implicit_slots(r, ranges)
        for start, k in ranges:
            source, condition = self.kernel_param(r, start, k, implicit)
            slot = re.match(r"::steel_shim::(buffer|threadgroup_buffer)<\((.*)\)>$", source)
            if slot:
                key = (slot.group(1), slot.group(2).replace(" ", ""))
                if key in seen_slots:
                    what = "buffer" if key[0] == "buffer" else "threadgroup"
                    message = f"two kernel parameters with [[{what}({key[1]})]] (Metal refuses)"
                    raise r.error(start, message)
                seen_slots.add(key)
            if condition is not None:
                fn = f"steel_present_{len(out)}"
                conditions.append(f" static bool {fn}() {{ return bool({condition}); }}")
                source = f"::steel_shim::present_if<{source}, &{struct}::{fn}>"
            out.append(source)
        return out, conditions

    @staticmethod
    def implicit_slots(r: _Rewriter, ranges: list[tuple[int, int]]) -> dict[int, str]:
        """The [[buffer(n)]] or [[threadgroup(n)]] of each device, constant or threadgroup
        parameter written without an attribute, by its first token: MSL's compiler assigns such
        a parameter "the first available location index" (MSL specification, section 5.2.1),
        i.e. in parameter order the lowest index of its kind that no parameter names (llama.cpp's
        kernels bind every buffer this way). With an index that is not a literal among the
        others, the free ones cannot be known here: such a parameter is refused."""
        taken: dict[str, set[int]] = {"buffer": set(), "threadgroup": set()}
        unknown: set[str] = set()
        bare: list[tuple[int, str]] = []
        for a, b in ranges:
            toks = [r.t(k) for k in range(a, b)]
            if "[" in toks and toks[toks.index("[") + 1 : toks.index("[") + 2] == ["["]:
                at = toks.index("[")
                name = toks[at + 2] if at + 2 < len(toks) else ""
                if name in taken and toks[at + 3 : at + 4] == ["("]:
                    arg = toks[at + 4]
                    if arg.isdigit() and toks[at + 5 : at + 6] in ([")"], [","]):
                        taken[name].add(int(arg))
                    else:
                        unknown.add(name)
                continue
            kind = "threadgroup" if "threadgroup" in toks else None
            if "device" in toks or "constant" in toks:
                kind = "buffer"
            if kind is not None:
                bare.append((a, kind))
        slots: dict[int, str] = {}
        for a, kind in bare:
            if kind in unknown:
                raise r.error(
                    a,
                    f"kernel parameter '{r.t(a)} ...' has no [[{kind}(n)]] beside one whose index "
                    "is not a literal: the index Metal assigns it cannot be known here",
                )
            n = 0
            while n in taken[kind]:
                n += 1
            taken[kind].add(n)
            template = "buffer" if kind == "buffer" else "threadgroup_buffer"
            slots[a] = f"::steel_shim::{template}<({n})>"
        return slots

    def kernel_param(
        self, r: _Rewriter, a: int, b: int, implicit: dict[int, str]
    ) -> tuple[str, str | None]:
        """(argument source, function-constant condition or None) of one kernel parameter;
        `implicit`: the slots of those without an attribute (implicit_slots)."""
        for k in range(a, b):
            if r.t(k) == "[" and r.t(k + 1) == "[":
                end = self.attribute_end(r, k)
                items = self.attribute_items(r, k, end)
                r.sub(k, end, "")
                name, arg, _ = items[0]
                condition = next((a for n, a, _ in items[1:] if n == "function_constant"), None)
                if name == "buffer":
                    return f"::steel_shim::buffer<({arg})>", condition
                if name == "threadgroup":
                    return f"::steel_shim::threadgroup_buffer<({arg})>", condition
                if name in POSITION_ATTRIBUTES:
                    return f"::steel_shim::attr<::steel_shim::{POSITION_ATTRIBUTES[name]}>", None
                raise r.error(k, f"kernel parameter attribute [[{name}]] is not supported")
        if a in implicit:
            return implicit[a], None
        raise r.error(a, f"kernel parameter '{r.flat(a, b)}' has no [[...]] attribute")

    # ---- constant T name [[function_constant(i)]];  /  constant T name = expr;
    def constant_decl(self, r: _Rewriter, k: int) -> int | None:
        semi = k
        while r.t(semi) != ";":
            if semi >= len(r.sig) or r.t(semi) in ("{", "}"):
                return None
            semi += 1
        words = [r.t(j) for j in range(k, semi)]
        if "constexpr" in words or "(" in words[:3]:
            return None
        init = next((j for j in range(k + 2, semi) if r.t(j) in ("(", "{")), None)
        if init is not None and not {"=", "["} & set(words) and r.kind(init - 1) == "ident":
            # `constant T x(args);`: an object of class type constructed in constant memory.
            # C++ constructs it in generic memory; x is that object seen in the constant space,
            # so that members qualified `constant` are the ones called on it.
            name, ctype = r.t(init - 1), r.flat(k + 1, init - 1)
            value = f"__steel_constant_value_{name}"
            r.sub(
                k,
                semi + 1,
                f"static const {ctype} {value}{r.rendered(init, semi)}; "
                f"constant {ctype}& {name} = *(constant {ctype}*)&{value};",
            )
            return semi + 1
        for j in range(k, semi):
            if r.t(j) == "[" and r.t(j + 1) == "[":
                end = self.attribute_end(r, j)
                items = self.attribute_items(r, j, end)
                if items[0][0] != "function_constant":
                    return None
                name = r.t(j - 1)
                ctype = r.flat(k + 1, j - 1)
                if end != semi:
                    raise r.error(j, "a function constant declaration has no initializer")
                r.sub(
                    k,
                    semi + 1,
                    f"static constexpr ::steel_shim::function_constant<{ctype}, "
                    f"({items[0][1]})> {name}{{}};",
                )
                return semi + 1
        if "=" not in words:
            return None
        eq = k + words.index("=")
        if r.t(eq - 1) == "]":
            return None  # a constant array: stays a constant-address-space global
        name = r.t(eq - 1)
        ctype = r.flat(k + 1, eq - 1)
        expr_idents = [
            r.t(j)
            for j in range(eq + 1, semi)
            if r.kind(j) == "ident" and r.t(j) not in ("true", "false")
        ]
        if not expr_idents:
            return None
        # constexpr, so that one over plain constants is a constant expression (an array bound,
        # `constant int N = M * 2;`); over function constants it is evaluated at each use.
        r.sub(k, eq + 1, f"static constexpr {ctype} __steel_fc_{name}() {{ return (")
        r.sub(
            semi,
            semi + 1,
            f"); }} static constexpr ::steel_shim::derived_constant<{ctype}, "
            f"&__steel_fc_{name}> {name}{{}};",
        )
        return semi + 1

    # ---- float f() const device { ... }: a member function for objects in an address space
    _SPACES = ("device", "constant", "threadgroup", "thread")

    def as_member(self, r: _Rewriter, close: int) -> None:
        """C++ has no address-space-qualified member functions. `thread` (MSL's default) is
        removed. A constructor or destructor in another space constructs (destroys) the same
        value: it loses the qualifier, or goes when a variant of the same signature for thread
        objects (or an earlier one) is in the class. Any other member function (operators,
        conversions, templates) in another space is renamed (an overload for thread objects may
        sit beside it) and, after its body, an explicit-object template of the original name
        for objects in that space calls it on the object seen as generic memory (the checkers
        see accesses by address, whatever the space)."""
        j = close + 1
        spaces = []
        while r.t(j) in ("const", "volatile", *self._SPACES):
            if r.t(j) in self._SPACES:
                spaces.append(j)
            j += 1
        if not spaces or r.t(j) not in ("{", ";", ":", "="):
            return
        is_const = any(r.t(x) == "const" for x in range(close + 1, j))
        open_, depth = close, 0
        while open_ >= 0:
            depth += r.t(open_) == ")"
            depth -= r.t(open_) == "("
            if depth == 0:
                break
            open_ -= 1
        kind, name_at = self.member_kind(r, open_)
        if kind is None:
            raise r.error(close, "unsupported address-space-qualified member function")
        name = r.flat(name_at, open_)
        if kind == "operator":  # `operator*=` is tokens `*` and `=`
            name = "operator" + "".join(r.t(x) for x in range(name_at + 1, open_))
        outside = r.t(name_at - 1) == "::"
        body_end = self.member_end(r, j)
        space = r.t(spaces[0])
        for x in spaces:
            r.sub(x, x + 1, "")
        if kind == "special":  # a constructor or a destructor
            if space != "thread" and self.has_twin(r, name_at, open_, close, outside):
                r.drop(self.declaration_start(r, name_at) + 1, body_end + 1)
            return
        if space == "thread" or r.t(j) in (":", "="):
            return
        first = self.declaration_start(r, name_at) + 1
        head = None
        if r.t(first) == "template" and r.t(first + 1) == "<":
            head = re.sub(r"\. \. \.", "...", r.flat(first + 2, r.match(first + 1)))
        if kind == "conversion":
            target_type = r.flat(name_at + 1, open_)
            renamed = f"__steel_{space}_to_{re.sub(r'[^A-Za-z0-9_]', '_', target_type)}"
            r.sub(name_at, open_, f"{target_type} {renamed}")
        else:
            tag = name if kind == "function" else f"operator_{zlib.crc32(name.encode()):08x}"
            renamed = f"__steel_{space}_{tag}"
            r.sub(name_at, open_, renamed)
        if outside:
            return
        params, args = self.forwarded_parameters(r, open_, close)
        c = "const " if is_const else ""
        self_param = f"this {c}{space} __SteelSelf& __steel_self"
        targs = self.template_arguments(head)
        call = f".template {renamed}<{targs}>" if targs else f".{renamed}"
        target = f"(({c}__SteelSelf&)__steel_self){call}({', '.join(args)})"
        tparams = f"{head}, class __SteelSelf" if head else "class __SteelSelf"
        extra = f", {params}" if params else ""
        returns = "" if kind == "conversion" else "decltype(auto) "
        r.add_after(
            body_end,
            f" template <{tparams}> {returns}{name}({self_param}{extra}) {{ return {target}; }}",
        )

    @staticmethod
    def member_kind(r: _Rewriter, open_: int) -> tuple[str | None, int]:
        """What the member function whose parameter list opens at open_ is ("special" for a
        constructor or destructor, "conversion", "operator", "function"), and where its name
        starts."""
        start = _Translator.declaration_start(r, open_)
        j = next((x for x in range(open_ - 1, start, -1) if r.t(x) == "operator"), start)
        if r.t(j) == "operator":
            symbol = r.kind(j + 1) == "punct" or r.t(j + 1) in ("new", "delete")
            return ("operator" if symbol else "conversion"), j
        if r.kind(open_ - 1) != "ident":
            return None, open_
        name_at = open_ - 1
        if r.t(name_at - 1) == "~":
            return "special", name_at - 1
        owner = (
            r.t(name_at - 2)
            if r.t(name_at - 1) == "::"
            else _Translator.enclosing_class(r, name_at)
        )
        return ("special" if owner == r.t(name_at) else "function"), name_at

    @staticmethod
    def enclosing_class(r: _Rewriter, k: int) -> str | None:
        """The name of the class whose body holds token k (None outside one)."""
        x = r.open_brace(k - 1) - 1
        while x >= 0 and r.t(x) not in (";", "{", "}"):
            if r.t(x) in ("struct", "class", "union"):
                y = x + 1
                while r.t(y) == "[" or r.t(y) == "alignas":
                    y = (r.match(y + 1) if r.t(y) == "alignas" else r.match(y)) + 1
                return r.t(y)
            x -= 1
        return None

    @staticmethod
    def declaration_start(r: _Rewriter, k: int) -> int:
        """The token before the declaration holding token k (a `;`, brace or access label)."""
        j = k - 1
        depth = 0
        while j >= 0:
            t = r.t(j)
            depth += t in (")", "]")
            depth -= t in ("(", "[")
            if depth == 0 and (t in (";", "{", "}") or (t == ":" and r.t(j - 1) in _ACCESS)):
                return j
            j -= 1
        return -1

    @staticmethod
    def member_end(r: _Rewriter, j: int) -> int:
        """The last token of a member function whose qualifiers end before token j: its `;`, or
        its body's `}` (after a constructor's initializers)."""
        if r.t(j) == ";":
            return j
        if r.t(j) == "=":
            while r.t(j) != ";":
                j += 1
            return j
        if r.t(j) == ":":
            j += 1
            while True:
                while r.t(j) not in ("(", "{"):
                    j += 1 if r.t(j) != "<" else 0
                    if r.t(j) == "<":
                        j = r.match(j) + 1
                j = r.match(j) + 1
                if r.t(j) == "...":
                    j += 1
                if r.t(j) != ",":
                    break
                j += 1
        return r.match(j)

    def has_twin(self, r: _Rewriter, name_at: int, open_: int, close: int, outside: bool) -> bool:
        """Whether the class declares this constructor (destructor) for thread objects, or in
        an earlier address space: the same template head, name and parameters."""
        if outside:
            return True  # the declaration in the class decided
        start = self.declaration_start(r, name_at)
        mine = r.flat(start + 1, close + 1)
        lo = r.open_brace(start)
        hi = r.match(lo)
        for x in range(lo + 1, hi):
            if (
                x == name_at
                or r.t(x) != r.t(name_at)
                or r.t(x + 1 if r.t(x) != "~" else x + 2) != "("
            ):
                continue
            paren = x + 1 if r.t(x) != "~" else x + 2
            end = r.match(paren)
            other = r.flat(self.declaration_start(r, x) + 1, end + 1)
            if other != mine:
                continue
            quals = {r.t(y) for y in range(end + 1, end + 4)}
            if x < name_at or not quals & {"device", "constant", "threadgroup"}:
                return True
        return False

    @staticmethod
    def forwarded_parameters(r: _Rewriter, open_: int, close: int) -> tuple[str, list[str]]:
        """The parameter list of a wrapper (unnamed parameters get names) and the arguments
        that pass them on."""
        params, args = [], []
        depth, a = 0, open_ + 1
        for x in range(open_ + 1, close + 1):
            t = r.t(x)
            if t in ("(", "[", "<", "{"):
                depth += 1
            elif t in (")", "]", ">", "}") and x != close:
                depth -= 1
            if x == close or (t == "," and depth == 0):
                if x > a:
                    toks = [r.t(y) for y in range(a, x)]
                    if "=" in toks:
                        toks = toks[: toks.index("=")]  # the wrapper's caller gives it
                    toks = " ".join(toks).replace(". . .", "...").split()
                    pack = "..." in toks
                    last = toks[-1]
                    named = (
                        len(toks) > 1
                        and re.fullmatch(r"[A-Za-z_]\w*", last)
                        and last not in SCALAR_TYPES
                        and last not in ("char", "signed", "unsigned", "short", "long")
                        and toks[-2] not in ("::",)
                    )
                    if not named:
                        last = f"__steel_arg{len(args)}"
                        toks.append(last)
                    params.append(" ".join(toks))
                    args.append(f"{last}..." if pack else last)
                a = x + 1
        return ", ".join(params), args

    @staticmethod
    def template_arguments(head: str | None) -> str:
        """The named template parameters of a template head, as arguments (packs expanded)."""
        if not head:
            return ""
        out, depth, part = [], 0, []
        for ch in head + ",":
            if ch in "<([":
                depth += 1
            elif ch in ">)]":
                depth -= 1
            if ch == "," and depth == 0:
                words = "".join(part).split("=")[0].split()
                if len(words) > 1 and re.fullmatch(r"\.*[A-Za-z_]\w*", words[-1]):
                    pack = "..." in "".join(part).split("=")[0]
                    out.append(words[-1].lstrip(".") + ("..." if pack else ""))
                part = []
            else:
                part.append(ch)
        return ", ".join(out)

    # ---- Params p = *params;: a local variable initialized from another address space
    _NOT_CLASS = (
        frozenset(SCALAR_TYPES)
        | frozenset(
            {
                "size_t",
                "ptrdiff_t",
                "int8_t",
                "uint8_t",
                "int16_t",
                "uint16_t",
                "int32_t",
                "uint32_t",
                "int64_t",
                "uint64_t",
                "void",
            }
        )
        | VECTOR_TYPES
    )
    _NOT_DECLARATION = frozenset(
        {
            "return",
            "case",
            "default",
            "goto",
            "using",
            "typedef",
            "else",
            "do",
            "static",
            "constexpr",
            "extern",
            "template",
            "typename",
            "operator",
            "device",
            "constant",
            "threadgroup",
            "thread",
            "threadgroup_imageblock",
            "ray_data",
            "object_data",
        }
    )

    @staticmethod
    def _expression_end(r: _Rewriter, start: int) -> int | None:
        """The `;` ending the expression that starts at token `start`, or None where the
        expression is not one to wrap: a comma at its top level (several declarators or a
        comma expression), a bracket closing what it did not open, or no `;`."""
        depth = 0
        for end in range(start, len(r.sig)):
            s = r.t(end)
            if s in ("(", "[", "{"):
                depth += 1
            elif s in (")", "]", "}"):
                depth -= 1
                if depth < 0:
                    return None
            elif depth == 0 and s == ",":
                return None
            elif depth == 0 and s == ";":
                return end
        return None

    def local_copy(self, r: _Rewriter, k: int) -> None:
        """`T name = expression;` in a function body, T a class type or `auto`: MSL
        copy-initializes from an object in any address space (`Params p = *params;` with
        `constant Params* params`), C++ only from a generic one. The initializer is wrapped in
        steel_shim::as_local (steel_shim/construct.h), which copies an object of another space
        and passes anything else through. Scalar and vector types (never in another space
        here), braced initializers and declarations of several names are left alone."""
        j = k
        words = []
        n = len(r.sig)
        while j < n:
            s = r.t(j)
            if s in self._NOT_DECLARATION:
                return
            if s in ("const", "volatile", "::"):
                j += 1
            elif r.kind(j) == "ident":
                words.append(s)
                j += 1
                if r.t(j) == "<":
                    try:
                        j = r.match(j) + 1
                    except TranslateError:
                        return  # a comparison, not template arguments
            else:
                break
        if j >= n or r.t(j) != "=" or r.t(j + 1) in ("{", "=") or len(words) < 2:
            return
        if words[-2] in self._NOT_CLASS:
            return
        end = self._expression_end(r, j + 1)
        if end is None or end == j + 1:
            return
        r.add_after(j, " ::steel_shim::as_local(")
        r.add_after(end - 1, ")")

    _NOT_BY_VALUE = frozenset({"&", "&&", "decltype", "void"})

    def returns_by_value(self, r: _Rewriter, start: int, brace: int, outer: bool | None) -> bool:
        """Whether the function whose body (or a block of it) the brace at `brace` opens
        returns by value, judged from its declaration `start`..`brace`: no `&`, `decltype` or
        `void` in the return type (a trailing one after `->` if given), so that return_copy
        neither turns a returned reference into a copy nor wraps a void expression. A block
        nested in a function (`outer` is not None) inherits its flag unless it is a lambda
        with a trailing return type."""
        j = start
        if r.t(j) == "template" and r.t(j + 1) == "<":
            j = r.match(j + 1) + 1
        words = self.without_attributes([r.t(x) for x in range(j, brace)])
        is_lambda = self.lambda_head(words)
        if "->" in words and (is_lambda or outer is None):
            trailing = words[len(words) - words[::-1].index("->") :]
            return not self._NOT_BY_VALUE.intersection(trailing)
        if is_lambda:
            return True  # deduced, decayed: a copy is what it returns
        if outer is not None:
            return outer
        head = words[: words.index("(")] if "(" in words else words
        return not self._NOT_BY_VALUE.intersection(head)

    @staticmethod
    def without_attributes(words: list[str]) -> list[str]:
        """The tokens less each `[[...]]` attribute list: in `[[kernel,
        max_total_threads_per_threadgroup(WM * WN * 32)]] void f(` the leading `[` would pass
        for a lambda's captures and the attribute's parentheses for the parameter list."""
        out: list[str] = []
        depth = 0  # brackets open inside an attribute list
        for x, w in enumerate(words):
            if depth == 0 and w == "[" and words[x + 1 : x + 2] == ["["]:
                depth = 1
            elif depth:
                depth += (w == "[") - (w == "]")
            else:
                out.append(w)
        return out

    @staticmethod
    def lambda_head(words: list[str]) -> bool:
        """Whether the tokens before a `{` end a lambda's head (`[&](int i) mutable`, `[=]`):
        a `[` where an expression starts, the brace after its parameters or captures."""
        if not words or words[-1] not in (")", "]", "mutable") and "->" not in words:
            return False
        return any(
            w == "[" and (x == 0 or words[x - 1] in ("=", "(", ",", "return", "{", ";"))
            for x, w in enumerate(words)
        )

    def record_function(self, r: _Rewriter, start: int, brace: int) -> None:
        """Notes the name of the function whose body the brace at `brace` opens."""
        head = [r.t(x) for x in range(start, brace)]
        if "(" not in head:
            return
        name = head[head.index("(") - 1] if head.index("(") > 0 else ""
        if r.kind(start + head.index("(") - 1) != "ident" or name == "operator":
            return
        is_template = head[0] == "template" or "<" in head[: head.index("(")]
        (self.template_functions if is_template else self.plain_functions).add(name)

    def argument_copy(self, r: _Rewriter, k: int) -> None:
        """`f(*p, ...)`: MSL passes an object of any address space to a parameter taking it by
        value, C++ only a generic one. An argument that dereferences (`*p`, the form copies
        out of another space take) becomes `(steel_shim::arg_pass(), *p)`
        (steel_shim/construct.h), which converts such an object into a checked copy or back into
        its reference, as the parameter asks, and leaves any other argument as it is (a vector
        element among them, which no function's reference parameter could take). Only calls by
        name of a non-template function defined earlier in the file (record_function) qualify:
        a template would deduce its parameter from the proxy, and neither keywords nor
        declarators (`T (*rows)[4]`) are calls."""
        name = r.t(k - 1)
        if name not in self.plain_functions or name in self.template_functions:
            return
        try:
            close = r.match(k)
        except TranslateError:
            return
        if r.t(close + 1) in ("[", "("):
            return
        start = k + 1
        depth = 0
        for j in range(k + 1, close + 1):
            s = r.t(j)
            if s in ("(", "[", "{"):
                depth += 1
            elif s in (")", "]", "}") and j < close:
                depth -= 1
            elif depth == 0 and (s == "," or j == close):
                if self.is_object_argument(r, start, j):
                    r.add_after(start - 1, " (::steel_shim::arg_pass(),")
                    r.add_after(j - 1, ")")
                start = j + 1

    @staticmethod
    def is_object_argument(r: _Rewriter, a: int, b: int) -> bool:
        """Whether tokens a..b-1 name an object the way a copy out of another address space
        does: a dereference (`*p`, `*(p + i)`) or a subscript chain (`p[i]`, `s.rows[i]`,
        `p->v[i]`). A bare name is left out, as it may be a type passed to a macro."""
        if b - a < 2:
            return False
        if r.t(a) == "*":
            return True
        if r.kind(a) != "ident" or r.t(b - 1) != "]":
            return False
        j = a
        while j < b:
            s = r.t(j)
            if s == "[":
                j = r.match(j) + 1
            elif r.kind(j) == "ident" or s in (".", "->", "::"):
                j += 1
            else:
                return False
        return j == b

    def return_copy(self, r: _Rewriter, k: int) -> None:
        """`return expression;` in a function returning by value: MSL copies a returned object
        out of any address space (`return *params;` with `constant Params* params`), C++ only
        out of the generic one. As for local_copy, the expression goes through
        steel_shim::as_local; `return;`, braced lists and comma expressions are left alone."""
        if k + 1 >= len(r.sig) or r.t(k + 1) in (";", "{"):
            return
        end = self._expression_end(r, k + 1)
        if end is None:
            return
        r.add_after(k, " ::steel_shim::as_local(")
        r.add_after(end - 1, ")")

    # ---- threadgroup T name[N]; in a function body
    def threadgroup_decl(self, r: _Rewriter, k: int) -> int | None:
        align = None
        j = k
        if r.t(j) == "alignas" and r.t(j + 1) == "(":
            close = r.match(j + 1)
            align = r.flat(j + 2, close)
            j = close + 1
        if r.t(j) != "threadgroup":
            return None
        semi = j
        depth = 0
        commas = []
        while True:
            s = r.t(semi)
            if semi >= len(r.sig) or s in ("{", "}"):
                return None
            if s in ("(", "[", "<"):
                depth += 1
            elif s in (")", "]", ">"):
                depth -= 1
            elif s == "," and depth == 0:
                commas.append(semi)
            elif s == ";" and depth <= 0:
                break
            semi += 1
        first_end = commas[0] if commas else semi
        # The first declarator: type tokens, name, dimensions.
        dims_at = next((x for x in range(j + 1, first_end) if r.t(x) == "["), first_end)
        words = [r.t(x) for x in range(j + 1, dims_at)]
        if "*" in words or "&" in words or "=" in words or "(" in words:
            return None  # a pointer or reference to threadgroup memory: a plain local
        name_k = dims_at - 1
        ctype = r.flat(j + 1, name_k)
        if not ctype:
            raise r.error(j, "cannot parse this threadgroup declaration")
        declarators = [(name_k, dims_at, first_end)]
        bounds = commas + [semi]
        for start, end in zip(bounds[:-1], bounds[1:]):
            d_dims = next((x for x in range(start + 1, end) if r.t(x) == "["), end)
            declarators.append((start + 1, d_dims, end))
        out = []
        for name_at, dims_k, end in declarators:
            if name_at != dims_k - 1 or r.kind(name_at) != "ident":
                raise r.error(j, "cannot parse this threadgroup declaration")
            name = r.t(name_at)
            dims = r.flat(dims_k, end)
            tok = r.toks[r.sig[name_at]]
            decl_id = _decl_id(tok.path, tok.line, tok.col)
            targs = f"{ctype}{dims}" + (f", {align}" if align else "")
            ref = f"(&{name}){dims}" if dims else f"&{name}"
            out.append(
                f"threadgroup {ctype} {ref} = ::steel_shim::tg_array<{targs}>("
                f"{decl_id}u, __PRETTY_FUNCTION__);"
            )
        r.sub(k, semi + 1, " ".join(out))
        return semi + 1

    # ---- struct X { ... }: assignment across address spaces
    def struct_copy(self, r: _Rewriter, k: int) -> None:
        j = k + 1
        name = None
        while j < len(r.sig):
            s = r.t(j)
            if s == "[" and r.t(j + 1) == "[":
                j = self.attribute_end(r, j)
                continue
            if s == "alignas" and r.t(j + 1) == "(":
                j = r.match(j + 1) + 1
                continue
            if r.kind(j) == "ident" and name is None:
                name = s
            elif s in (";", "(", ")", ",", ">", "=", "*", "&"):
                return  # a declaration, a template parameter or an elaborated type
            elif s == "{":
                break
            elif s == "<" and name is not None:
                j = r.match(j) + 1
                continue
            j += 1
        if name is None or name == "final" or j >= len(r.sig):
            return
        if r.t(k) == "class":
            r.add_after(j, f" public: STEEL_SIM_AS_COPY({name}) private:")
        else:
            r.add_after(j, f" STEEL_SIM_AS_COPY({name})")

    # ------------------------------------------------------------------ driver
    def run(self, toks: list[Tok]) -> str:
        for i, tok in enumerate(toks):
            if tok.kind == "directive":
                toks[i] = Tok("directive_done", self.directive(tok), tok.line, tok.col, tok.path)
        r = _Rewriter(toks)
        self.expressions(r)
        self.statements(r)
        return r.render()


# ---------------------------------------------------------------------------- preprocessing
# The pre-pass judges what Metal's compiler judges: the preprocessed tokens of a translation
# unit, macros expanded and #if evaluated with the macros Metal predefines for the language
# version. clang does the preprocessing (-E); its line markers name the original file and line
# of every token, and stay in the output, so compiler errors and checker reports point there.

# -std=metal<version> -> __METAL_VERSION__.
LANGUAGE_VERSIONS = {"metal3.0": 300, "metal3.1": 310, "metal3.2": 320, "metal4.0": 400}
DEFAULT_LANGUAGE = "metal3.1"
# Headers that exist from MSL 4 on: a file that includes them is MSL 4 unless told otherwise.
_MSL4_HEADERS = ("metal_tensor", "MetalPerformancePrimitives/")

_MARKER = re.compile(r'[ \t]*#[ \t]*(?:line[ \t]+)?(\d+)[ \t]+"((?:[^"\\]|\\.)*)"')
# `#pragma unroll (MIN(a, b))`: a count that names identifiers (macros, which preprocessing has
# removed by the time clang reads the pragma); a plain count, `unroll(full)` and `clang loop`
# hints stay, since they shape the code the instruction counters see.
_UNROLL_PRAGMA = re.compile(r"[ \t]*#[ \t]*pragma[ \t]+unroll\b[^\n]*[A-Za-z_]")
_INCLUDE_MARK = re.compile(r"[ \t]*#[ \t]*pragma[ \t]+steel_sim_include[ \t]+<([^>]*)>")
_CLANG_ERROR = re.compile(r"^(.*?):(\d+):\d+: (?:fatal )?error: (.*)$", re.M)


def _predefined(version: int) -> list[str]:
    """The macros Metal's compiler predefines for a macOS target at this language version
    (clang's own x86-64 and Linux macros are dropped with -undef; __cplusplus stays C++17's, the
    base of MSL 3 and 4)."""
    macros = {
        "__METAL_VERSION__": version,
        "__METAL__": 1,
        "__METAL_MACOS__": 1,
        "__clang__": 1,
        "__HAVE_SIMDGROUP_MATRIX__": 1,
        "__HAVE_BFLOAT__": 1,
    }
    if version >= 400:
        macros["__HAVE_TENSOR__"] = 1
    return [f"-D{k}={v}" for k, v in macros.items()]


@functools.cache
def _header_stand_ins(shim: Path) -> Path:
    """A tree with one stand-in per header of the shim. The preprocessor includes these instead
    of the shim's C++ (whose macros, `device` among them, must not be expanded in shader code:
    in Metal they are keywords); each leaves a mark that becomes the #include again."""
    root = Path(tempfile.mkdtemp(prefix="steel_sim_headers_"))
    atexit.register(shutil.rmtree, root, True)
    for f in shim.rglob("*"):
        rel = f.relative_to(shim)
        if f.is_file() and rel.parts[0] != "steel_shim" and f.suffix != ".md":
            stand_in = root / rel
            stand_in.parent.mkdir(parents=True, exist_ok=True)
            stand_in.write_text(f"#pragma once\n#pragma steel_sim_include <{rel.as_posix()}>\n")
    return root


def _preprocess_error(stderr: str, path: str) -> TranslateError:
    m = _CLANG_ERROR.search(stderr)
    if not m:
        return TranslateError(f"{path}:1: the preprocessor failed: {stderr.strip()[-2000:]}")
    where, message = f"{m.group(1)}:{m.group(2)}", m.group(3)
    missing = re.fullmatch(r"'(.+)' file not found", message)
    if missing and not METAL_HEADERS.fullmatch(missing.group(1)):
        return TranslateError(
            f"{where}: #include <{missing.group(1)}>: MSL has no C++ standard library (only "
            '<metal_*> headers and "..." includes)'
        )
    if missing and missing.group(1).startswith("metal_"):
        return TranslateError(f"{where}: <{missing.group(1)}> is not in the simulator's shim")
    return TranslateError(f"{where}: {message}")


def _preprocess(source: str, path: str, include_dirs, version: int) -> str:
    from torch_steel.sim.build import CXX, SHIM

    path_lit = path.replace("\\", "\\\\").replace('"', '\\"')
    cmd = [
        CXX,
        "-E",
        "-x",
        "c++",
        "-std=c++17",
        "-undef",
        "-nostdinc",
        "-nostdinc++",
        *_predefined(version),
        "-iquote",
        str(Path(path).parent),
        *[f"-I{d}" for d in include_dirs],
        f"-I{_header_stand_ins(SHIM)}",
        "-",
    ]
    done = subprocess.run(
        cmd, input=f'#line 1 "{path_lit}"\n' + source, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise _preprocess_error(done.stderr, path)
    # What comes before the file's own first line is clang's (<built-in>, <command line>).
    start = done.stdout.find(f'# 1 "{path_lit}"')
    return done.stdout[start:] if start >= 0 else done.stdout


def _located(text: str) -> list[Tok]:
    """Tokens of preprocessed text, each with the original file and line its line marker gives."""
    toks = _tokenize(text)
    path, delta = "", 0
    for tok in toks:
        if tok.kind == "directive":
            m = _MARKER.match(tok.text)
            if m:
                # The line after the marker is line m.group(1) of that file.
                path = m.group(2).encode().decode("unicode_escape")
                delta = int(m.group(1)) - (tok.line + 1)
        tok.path = path
        tok.line += delta
    return toks


def translate(
    source: str, path: str, include_dirs: tuple | list = (), std: str | None = None
) -> str:
    """MSL source -> C++ for the simulator's shim (see the module docstring): the translation
    unit of the file at `path` (its headers found beside it and in include_dirs), preprocessed
    as Metal's compiler would with -std=`std` (metal3.1 by default, metal4.0 when the file
    includes a header only MSL 4 has), then rewritten token for token."""
    if std is not None and std not in LANGUAGE_VERSIONS:
        raise TranslateError(
            f"{path}:1: unknown language version -std={std} (one of {', '.join(LANGUAGE_VERSIONS)})"
        )
    version = LANGUAGE_VERSIONS[std or DEFAULT_LANGUAGE]
    text = _preprocess(source, path, include_dirs, version)
    if std is None and version < 400:
        marks = [m.group(1) for m in _INCLUDE_MARK.finditer(text)]
        if any(m.startswith(_MSL4_HEADERS) for m in marks):
            version = 400
            text = _preprocess(source, path, include_dirs, version)
    return f"#define STEEL_SIM_METAL_VERSION {version}\n" + _Translator().run(_located(text))
