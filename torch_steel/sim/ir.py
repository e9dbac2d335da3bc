"""Makes the memory intrinsics of a shader TU visible to the simulator's checkers, and gives its
basic blocks the instruction counters' hooks (count_blocks, below).

    python torch_steel/sim/ir.py in.ll out.ll

Shader code is compiled with -fsanitize-coverage=trace-loads,trace-stores, which reports every
load and store instruction, but not `llvm.memcpy` / `llvm.memmove` / `llvm.memset`: clang emits
those for struct copies (also across address spaces, steel_shim/construct.h) and the optimizer
turns copy and fill loops into them. Without this pass their bytes would be invisible to the
bounds, race and alignment checkers and to the counters.

Every call of such an intrinsic in the optimized IR is redirected to a wrapper defined here that
first reports the source and destination ranges to the runtime (`steel_sim_memop`, in
mps_src/sim/shader/callbacks.cpp) with its own return address (the shader code that copies),
then does the copy. Standalone (no imports of the package): ninja runs it once per TU.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

_CALL = re.compile(r"@llvm\.(memcpy|memmove|memset)(\.inline)?((?:\.p\d+)+)\.(i32|i64)\(")
_KIND = {"memcpy": 1, "memmove": 1, "memset": 0}


def _ptr(space: str) -> str:
    return "ptr" if space == "0" else f"ptr addrspace({space})"


def _wrapper(op: str, spaces: list[str], width: str) -> str:
    name = f"@steel_sim.{op}.{'.'.join('p' + s for s in spaces)}.{width}"
    intrinsic = f"@llvm.{op}.{'.'.join('p' + s for s in spaces)}.{width}"
    dst = _ptr(spaces[0])
    lines = []
    if op == "memset":
        params = f"{dst} %d, i8 %v, {width} %n, i1 %vol"
        body_call = f"call void {intrinsic}({dst} %d, i8 %v, {width} %n, i1 false)"
        src_generic = "ptr null"
    else:
        src = _ptr(spaces[1])
        params = f"{dst} %d, {src} %s, {width} %n, i1 %vol"
        body_call = f"call void {intrinsic}({dst} %d, {src} %s, {width} %n, i1 false)"
        if spaces[1] == "0":
            src_generic = "ptr %s"
        else:
            lines.append(f"  %sg = addrspacecast {src} %s to ptr")
            src_generic = "ptr %sg"
    if spaces[0] == "0":
        dst_generic = "ptr %d"
    else:
        lines.append(f"  %dg = addrspacecast {dst} %d to ptr")
        dst_generic = "ptr %dg"
    n64 = "%n"
    if width == "i32":
        lines.append("  %n64 = zext i32 %n to i64")
        n64 = "%n64"
    return "\n".join(
        [
            f"define internal void {name}({params}) noinline {{",
            "  %pc = call ptr @llvm.returnaddress(i32 0)",
            *lines,
            f"  call void @steel_sim_memop({dst_generic}, {src_generic}, i64 {n64}, "
            f"i32 {_KIND[op]}, ptr %pc)",
            f"  {body_call}",
            "  ret void",
            "}",
        ]
    )


# `call void @__sanitizer_cov_load8(ptr %p)` and the access it reports, on the next line.
_COV = re.compile(
    r"call void @__sanitizer_cov_(load|store)(\d+)\((ptr(?: addrspace\(\d+\))? (%[\w.]+))\)"
)
_ALIGN = re.compile(r"\b(?:load|store)\b.*, ptr(?: addrspace\(\d+\))? (%[\w.]+), align (\d+)")


def underaligned(lines: list[str]) -> int:
    """Redirects the coverage callback of each load or store declared less aligned than its
    size (`load i64, ptr %p, align 2`: MLX's loaders read 8-byte structs that are alignas(2))
    to steel_sim_cov_access (mps_src/sim/shader/callbacks.cpp), which passes the alignment to
    the checkers: the alignment rule is the type's (MSL: pointers are aligned to their type),
    and the compiler splits what it cannot load at once. Returns how many it redirected."""
    n = 0
    for i, line in enumerate(lines[:-1]):
        m = _COV.search(line)
        if not m:
            continue
        a = _ALIGN.search(lines[i + 1])
        if not a or a.group(1) != m.group(4) or int(a.group(2)) >= int(m.group(2)):
            continue
        write = int(m.group(1) == "store")
        call = (
            f"call void @steel_sim_cov_access({m.group(3)}, i64 {m.group(2)}, "
            f"i64 {a.group(2)}, i32 {write})"
        )
        lines[i] = line[: m.start()] + call + line[m.end() :]
        n += 1
    return n


def rewrite(ir: str) -> str:
    wanted: dict[str, tuple[str, list[str], str]] = {}
    out_lines = []
    lines = ir.splitlines()
    if underaligned(lines):
        lines.append("declare void @steel_sim_cov_access(ptr, i64, i64, i32)")
        ir = "\n".join(lines) + "\n"
    for line in lines:
        if line.startswith("declare"):
            out_lines.append(line)
            continue
        if "@llvm.mem" in line and " call " in f" {line}":

            def redirect(m: re.Match) -> str:
                op, spaces, width = m.group(1), m.group(3)[2:].split(".p"), m.group(4)
                name = f"steel_sim.{op}.{'.'.join('p' + s for s in spaces)}.{width}"
                wanted[name] = (op, spaces, width)
                return f"@{name}("

            line = _CALL.sub(redirect, line)
        out_lines.append(line)
    if not wanted:
        return ir
    extra = [_wrapper(*w) for w in wanted.values()]
    declared = {m.group(0) for m in re.finditer(r"@llvm\.mem\w+(?:\.p\d+)+\.i\d+", ir)}
    for op, spaces, width in wanted.values():
        intrinsic = f"@llvm.{op}.{'.'.join('p' + s for s in spaces)}.{width}"
        if intrinsic in declared and f"declare void {intrinsic}(" in ir:
            continue
        dst = _ptr(spaces[0])
        if op == "memset":
            extra.append(f"declare void {intrinsic}({dst}, i8, {width}, i1 immarg)")
        else:
            extra.append(f"declare void {intrinsic}({dst}, {_ptr(spaces[1])}, {width}, i1 immarg)")
    extra.append("declare void @steel_sim_memop(ptr, ptr, i64, i32, ptr)")
    if "declare ptr @llvm.returnaddress(i32" not in ir:
        extra.append("declare ptr @llvm.returnaddress(i32 immarg)")
    return "\n".join(out_lines) + "\n\n" + "\n\n".join(extra) + "\n"


# ------------------------------------------------------------------------ instruction counters
#
# count_blocks() gives every basic block of the TU a histogram of the instructions a simdgroup
# issues for it (FIELDS) and, when that is not empty, a call at its entry,
# `steel_sim_block(ptr @hist)` (mps_src/sim/shader/callbacks.cpp), which adds the histogram to
# the running lane's tally when the launch counts instructions (runtime.cpp: count_block; the
# runtime folds the lanes of a simdgroup into one issue count per block). What counts:
#
# - Shader code (sources under shaders/ and test kernels, and the shim's construct.h and
#   types.h, which carry what the pre-pass rewrote the shader's own expressions into) counts by
#   LLVM opcode, a vector operation once per element (Apple GPUs are scalar per lane).
# - The shim's other functions (math, simd, matrix, atomics, kernel entry) do not count by their
#   code, which is only how the simulator computes them: a shim function that stands for a Metal
#   operation says which with a marker (steel_shim/count.h, STEEL_SHIM_OP(name, T)), counted as
#   `_OPS[name]` once per element; markers of shim functions it calls do not count.
# - FMA contraction: the simulator compiles with -ffp-contract=off, so that its results round
#   as the source says, but Metal compiles with fast math, whose contraction fuses a multiply
#   into the add that uses it. An fmul whose one use is an fadd or fsub of the same type in the
#   same basic block (the unit LLVM's instruction selection contracts in) is counted with that
#   add as one instruction (the add's: one FMA); an add takes one multiply at most. llvm.fma /
#   llvm.fmuladd calls and the shim's fma() count as one instruction anyway.
# - Not counted: what Metal's compiler folds or has no instruction for (values computed only from
#   function constants and branches on them, selects and i1 logic on them, phis, bitcasts,
#   vector element moves, also as shifts and truncations of a packed load, constant address
#   offsets, calls of shader functions, which Metal inlines), thread-private memory
#   (registers), the sanitizers' checks (!nosanitize, and the compares feeding a branch to a
#   block that ends in `unreachable`: an error path) and the runtime's calls.

FIELDS = (
    "fp32",
    "half",
    "transcendental",
    "convert",
    "int",
    "compare_select",
    "branch",
    "other",
    "mma_half",
    "mma_bfloat",
    "mma_float",
    "threadgroup_loads",
    "threadgroup_stores",
    "device_loads",
    "device_stores",
)
_SLOTS = 16  # FIELDS padded: runtime.cpp reads uint32_t[16] per block
_F = {name: i for i, name in enumerate(FIELDS)}

# Shim functions by the Metal operation they stand for: a class, or "arith" (fp32, half or int
# by the element type).
_TRANSCENDENTAL = (
    "exp exp2 exp10 log log2 log10 sqrt rsqrt sin cos tan asin acos atan sinh cosh tanh asinh "
    "acosh atanh sinpi cospi tanpi pow powr atan2 divide recip erf fmod"
).split()
_ARITH = (
    "floor ceil round rint trunc fabs saturate sign fract copysign fmin fmax step fdim fma mix "
    "max min clamp abs nextafter frexp ldexp fmax3 fmin3 fmedian3 max3 min3 median3 dot length"
).split()
_OPS = {
    **{n: "transcendental" for n in _TRANSCENDENTAL},
    **{n: "arith" for n in _ARITH},
    "select": "compare_select",
    "isnan": "compare_select",
    "isinf": "compare_select",
    "isfinite": "compare_select",
    "mma": "mma",
    "simdgroup_load_device": "device_loads",
    "simdgroup_store_device": "device_stores",
    "simdgroup_load_threadgroup": "threadgroup_loads",
    "simdgroup_store_threadgroup": "threadgroup_stores",
}

_FLOAT_TYPES = {"float": "fp32", "double": "fp32", "half": "half", "bfloat": "half"}
_INT_OPS = set("add sub mul udiv sdiv urem srem shl lshr ashr and or xor".split())
_FP_OPS = {"fadd", "fsub", "fmul", "frem", "fneg"}
_CONVERT = {"fpext", "fptrunc", "sitofp", "uitofp", "fptosi", "fptoui"}
_INT_CASTS = {"zext", "sext", "trunc", "ptrtoint", "inttoptr"}
_FREE = {
    "phi",
    "bitcast",
    "addrspacecast",
    "alloca",
    "extractelement",
    "insertelement",
    "shufflevector",
    "extractvalue",
    "insertvalue",
    "freeze",
    "fence",
    "ret",
    "unreachable",
}
_INTRINSIC_CLASS = {
    **{
        n: "transcendental"
        for n in "sqrt exp exp2 exp10 log log2 log10 sin cos tan pow powi tanh".split()
    },
    **{
        n: "arith"
        for n in (
            "fma fmuladd fabs minnum maxnum minimum maximum copysign floor ceil trunc rint "
            "nearbyint round roundeven canonicalize"
        ).split()
    },
    **{
        n: "int"
        for n in (
            "smin smax umin umax abs ctpop ctlz cttz bitreverse bswap fshl fshr "
            "sadd.with.overflow uadd.with.overflow ssub.with.overflow usub.with.overflow "
            "smul.with.overflow umul.with.overflow sadd.sat uadd.sat ssub.sat usub.sat"
        ).split()
    },
    "fptosi.sat": "convert",
    "fptoui.sat": "convert",
}
_LIBM = {
    f + s
    for f in "exp exp2 exp10 log log2 log10 sqrt sin cos tan asin acos atan atan2 sinh cosh tanh "
    "asinh acosh atanh pow erf fmod".split()
    for s in ("", "f")
}

# The sanitizers' callbacks and the runtime (steel_sim::, mangled _ZN9steel_sim): no instruction
# of the shader's.
_UNCOUNTED_CALLS = ("__sanitizer_", "__ubsan_", "_ZN9steel_sim", "steel_sim")
# Function constants, which Metal's compiler folds when it builds the pipeline.
_CONSTANT_CALL = re.compile(r"@_ZN9steel_sim\d+function_constant_")
_MD = re.compile(r"^!(\d+) = (?:distinct )?!(\w+)\((.*)\)\s*$")
_MD_REF = {k: re.compile(k + r": !(\d+)") for k in ("scope", "inlinedAt", "file")}
_MD_STR = {k: re.compile(k + r': "((?:[^"\\]|\\.)*)"') for k in ("name", "filename", "directory")}
_DBG = re.compile(r", !dbg !(\d+)")
_LABEL = re.compile(r'^([-\w.$]+|"(?:[^"\\]|\\.)*"):')
_LOCAL = re.compile(r'%[-\w.$]+|%"(?:[^"\\]|\\.)*"')
# `select [flags] i1 %c, ...` (or a vector of i1): the condition.
_SELECT_COND = re.compile(r"^select (?:[a-z]+ )*(?:i1|<\d+ x i1>) (%[-\w.$]+),")
# `and / or / xor i1 a, b`: the operands.
_LOGIC_I1 = re.compile(r"^(?:and|or|xor) (?:disjoint )?i1 (\S+), (\S+)$")
# A constant shift right (group 1: its amount) or a truncation of an integer (group 2: its
# result's width).
_ELEMENT_SHIFT = re.compile(
    r"^(?:lshr (?:exact )?i\d+ \S+, (\d+)|trunc (?:nuw )?(?:nsw )?i\d+ \S+ to i(\d+))"
)
# A bitcast of an integer to a float type of its width.
_FP_BITCAST = re.compile(r"^bitcast (?:i16 \S+ to (?:half|bfloat)|i32 \S+ to float)\b")
_VEC = re.compile(r"^<(\d+) x ([\w]+)>")
_FLAGS = {
    "nnan",
    "ninf",
    "nsz",
    "arcp",
    "contract",
    "afn",
    "reassoc",
    "fast",
    "nuw",
    "nsw",
    "exact",
    "disjoint",
    "nneg",
    "samesign",
    "inbounds",
    "tail",
    "musttail",
    "notail",
    "noundef",
    "nonnull",
}
_ANNOTATION = re.compile(
    r"call i32 @llvm\.annotation\.i32[\w.]*\(i32 (\d+), ptr (?:nonnull )?(@[\w.$]+)"
)
_STRING = re.compile(r'^(@[\w.$]+) = .*c"((?:[^"\\]|\\.)*)\\00"')


class _Debug:
    """Inline chains of the module's debug locations: which frames are the shim's."""

    def __init__(self, ir: str):
        self.nodes: dict[str, tuple[str, str]] = {}
        for line in ir.splitlines():
            if line.startswith("!"):
                m = _MD.match(line)
                if m:
                    self.nodes[m.group(1)] = (m.group(2), m.group(3))
        self._sp: dict[str, str | None] = {}
        self._kind: dict[str, str] = {}

    def _ref(self, node: str, key: str) -> str | None:
        m = _MD_REF[key].search(self.nodes.get(node, ("", ""))[1])
        return m.group(1) if m else None

    def subprogram(self, scope: str | None) -> str | None:
        start = scope
        seen = 0
        while scope is not None and seen < 100:
            if scope in self._sp:
                return self._sp[scope]
            kind = self.nodes.get(scope, ("", ""))[0]
            if kind == "DISubprogram":
                break
            scope = self._ref(scope, "scope")
            seen += 1
        self._sp[start] = scope
        return scope

    def kind(self, sp: str | None) -> str:
        """'shader', 'transparent' (construct.h, types.h) or 'shim' (the rest of mps_src/sim)."""
        if sp is None:
            return "shader"
        if sp not in self._kind:
            f = self._ref(sp, "file")
            fields = self.nodes.get(f, ("", ""))[1] if f else ""
            name = _MD_STR["filename"].search(fields)
            directory = _MD_STR["directory"].search(fields)
            path = (directory.group(1) + "/" if directory else "") + (name.group(1) if name else "")
            if "mps_src/sim/" not in path:
                self._kind[sp] = "shader"
            elif path.endswith(("steel_shim/construct.h", "steel_shim/types.h")):
                self._kind[sp] = "transparent"
            else:
                self._kind[sp] = "shim"
        return self._kind[sp]

    def frames(self, loc: str) -> list[tuple[str | None, str | None]]:
        """(subprogram, inlinedAt) from the innermost frame out."""
        out = []
        while loc is not None and len(out) < 64:
            at = self._ref(loc, "inlinedAt")
            out.append((self.subprogram(self._ref(loc, "scope")), at))
            loc = at
        return out

    def in_shim(self, frames: list[tuple[str | None, str | None]]) -> bool:
        """Whether the innermost frames, up to the first frame of shader code, include the shim's
        own code (then the instruction is how the shim computes something, not counted)."""
        for sp, _ in frames:
            k = self.kind(sp)
            if k == "shader":
                return False
            if k == "shim":
                return True
        return False


def _elements(ty: str) -> tuple[int, str]:
    m = _VEC.match(ty)
    return (int(m.group(1)), m.group(2)) if m else (1, ty)


def _after_flags(words: list[str], i: int) -> int:
    while i < len(words) and words[i] in _FLAGS:
        i += 1
    return i


def _type_at(text: str) -> str:
    """The LLVM type at the start of text (a vector type whole)."""
    text = text.lstrip()
    if text.startswith("<"):
        return text[: text.index(">") + 1]
    return text.split(" ", 1)[0].rstrip(",")


def _space(ptr_text: str) -> int:
    m = re.match(r"\s*ptr addrspace\((\d+)\)", ptr_text)
    return int(m.group(1)) if m else 0


def _add(hist: list[int], cls: str, n: int, ty: str = "") -> None:
    if cls == "arith":
        cls = _FLOAT_TYPES.get(ty, "int")
    hist[_F[cls]] += n


def _memop(hist: list[int], body: str) -> None:
    """llvm.memcpy/memmove/memset: 16-byte accesses (one per started 16 bytes, as the loader
    moves them), of the address spaces they read and write."""
    m = re.search(r"@llvm\.(memcpy|memmove|memset)(?:\.inline)?((?:\.p\d+)+)\.i\d+\((.*)", body)
    if not m:
        return
    spaces = [int(s) for s in m.group(2)[2:].split(".p")]
    sizes = re.findall(r"i(?:32|64) (\d+), i1", m.group(3))
    n = max(1, (int(sizes[0]) + 15) // 16) if sizes else 1
    store = {1: "device_stores", 2: "device_stores", 3: "threadgroup_stores"}
    load = {1: "device_loads", 2: "device_loads", 3: "threadgroup_loads"}
    if spaces[0] in store:
        hist[_F[store[spaces[0]]]] += n
    if m.group(1) != "memset" and spaces[1] in load:
        hist[_F[load[spaces[1]]]] += n


def _classify(body: str, hist: list[int], defined: set[str]) -> None:
    """Adds one shader-code instruction (its text after any `%x = `) to hist."""
    words = body.split()
    if not words:
        return
    op = words[0]
    if op in _FREE:
        return
    if op == "br":
        if words[1] == "i1":
            hist[_F["branch"]] += 1
        return
    if op in ("switch", "indirectbr"):
        hist[_F["branch"]] += 1
        return
    if op == "load":
        i = _after_flags(words, 1)
        if i < len(words) and words[i] == "volatile":
            i += 1
        rest = body.split(None, i)[i]
        ty = _type_at(rest)
        ptr = rest[len(ty) + 1 :].lstrip(", ")
        space = _space(ptr)
        if space in (1, 2):
            hist[_F["device_loads"]] += 1
        elif space == 3:
            hist[_F["threadgroup_loads"]] += 1
        return
    if op == "store":
        m = re.search(r", ptr( addrspace\((\d+)\))? ", body)
        space = int(m.group(2)) if m and m.group(2) else 0
        if space == 1:
            hist[_F["device_stores"]] += 1
        elif space == 3:
            hist[_F["threadgroup_stores"]] += 1
        return
    if op == "getelementptr":
        # Address arithmetic only with a variable index (constant offsets fold into the access).
        parts = body.split(",")[2:]
        if any("%" in p for p in parts):
            hist[_F["int"]] += 1
        return
    if op in _FP_OPS or op == "fdiv" or op in _INT_OPS or op in ("icmp", "fcmp"):
        i = _after_flags(words, 1)
        if op in ("icmp", "fcmp"):
            i = _after_flags(words, i + 1)  # the predicate
        rest = body.split(None, i)[i] if i < len(words) else ""
        n, elem = _elements(_type_at(rest))
        if op in ("icmp", "fcmp"):
            hist[_F["compare_select"]] += n
        elif op == "fdiv":
            hist[_F["transcendental"]] += n
        elif op in _FP_OPS:
            _add(hist, "arith", n, elem)
        elif elem == "i1":
            hist[_F["compare_select"]] += n
        else:
            hist[_F["int"]] += n
        return
    if op in _CONVERT or op in _INT_CASTS:
        i = _after_flags(words, 1)
        n, _ = _elements(_type_at(body.split(None, i)[i]))
        hist[_F["convert" if op in _CONVERT else "int"]] += n
        return
    if op == "select":
        i = _after_flags(words, 1)
        rest = body.split(None, i)[i]
        value = rest.split(",", 1)[1] if "," in rest else rest
        n, _ = _elements(_type_at(value))
        hist[_F["compare_select"]] += n
        return
    if op in ("call", "invoke"):
        m = re.search(r"@([-\w.$]+)\(", body)
        if not m:
            hist[_F["other"]] += 1
            return
        callee = m.group(1)
        ret = body[: m.start()].split()
        rt = ret[-1] if ret else "void"
        if rt.endswith(">") and "<" in body[: m.start()]:
            rt = body[body.index("<", 0, m.start()) : m.start()].strip()
        n, elem = _elements(rt)
        if callee.startswith("llvm."):
            base = callee[5:]
            if base.startswith(("memcpy", "memmove", "memset")):
                _memop(hist, body)
                return
            # llvm.<name>.<type suffixes>
            for name, cls in _INTRINSIC_CLASS.items():
                if base == name or base.startswith(name + "."):
                    _add(hist, cls, n, elem)
                    return
            return  # lifetime, assume, annotation, ...: no instruction
        if callee in _LIBM:
            hist[_F["transcendental"]] += n
            return
        if callee in defined or callee.startswith(_UNCOUNTED_CALLS):
            return
        hist[_F["other"]] += 1
        return
    if op in ("atomicrmw", "cmpxchg"):
        hist[_F["other"]] += 1
        return
    hist[_F["other"]] += 1


_DEFINE = re.compile(r'^define [^@]*@([-\w.$]+|"(?:[^"\\]|\\.)*")\(')
_ASSIGN = re.compile(r'^\s+(%[-\w.$]+|%"(?:[^"\\]|\\.)*") = (.*)$')


def _function_hists(
    lines: list[str], debug: _Debug, defined: set[str], marked: set, markers: dict
) -> list[tuple[int, list[int]]]:
    """(index in lines where the block's hook goes, histogram) for each block of one function
    (lines[0] is its `define`, lines[-1] its `}`)."""
    fn_dbg = re.search(r"!dbg !(\d+)", lines[0])
    fn_shim = debug.kind(fn_dbg.group(1)) == "shim" if fn_dbg else False
    # Blocks: [start, end) line ranges; the first starts after `define`.
    blocks: list[list[int]] = [[1, 0]]
    labels: dict[str, int] = {}
    for i in range(1, len(lines) - 1):
        m = _LABEL.match(lines[i])
        if m:
            blocks[-1][1] = i
            labels["%" + m.group(1)] = len(blocks)
            blocks.append([i + 1, 0])
    blocks[-1][1] = len(lines) - 1
    # Defs and uses of local values, for function-constant folding and check slices.
    defs: dict[str, str] = {}
    def_line: dict[str, int] = {}
    uses: dict[str, int] = {}
    users: dict[str, list[int]] = {}
    for i in range(1, len(lines) - 1):
        line = lines[i]
        a = _ASSIGN.match(line)
        body = a.group(2) if a else line
        if a:
            defs[a.group(1)] = body
            def_line[a.group(1)] = i
        for v in _LOCAL.findall(body.split(", !")[0]):
            uses[v] = uses.get(v, 0) + 1
            users.setdefault(v, []).append(i)
    # Values Metal's compiler knows when it builds the pipeline: function constants and what is
    # computed from them alone (in order: SSA defs precede their uses outside phis).
    folded: set[str] = set()
    for name, body in defs.items():
        op = body.split(None, 1)[0] if body else ""
        if op == "call" and _CONSTANT_CALL.search(body):
            folded.add(name)
        elif op not in ("phi", "call", "load", "alloca") and op:
            operands = _LOCAL.findall(body.split(", !")[0])
            if operands and all(v in folded for v in operands):
                folded.add(name)
    # Moves: instructions that Metal's compiler turns into register moves or nothing.
    # - A select on a function constant is one of its operands when the pipeline is built, and
    #   an i1 and / or / xor with a function-constant operand is a constant or its other operand.
    # - The optimizer reads the elements of a <2 x half> (or bfloat) as one integer, shifted and
    #   truncated to 16 bits and bitcast to half (x86's form of an element read): element moves,
    #   free as extractelement is. A truncation to 16 or 32 bits whose every use is a bitcast to
    #   the float type of its width, and a constant shift right whose every use is such a
    #   truncation to a width the shift is a multiple of (an element's boundary).
    moves: set[str] = set()
    for name, body in defs.items():
        m = _SELECT_COND.match(body)
        if m and m.group(1) in folded:
            moves.add(name)
            continue
        m = _LOGIC_I1.match(body.split(", !")[0])
        if m and (m.group(1) in folded or m.group(2) in folded):
            moves.add(name)

    def element_move(name: str, seen: dict[str, bool]) -> bool:
        if name in seen:
            return seen[name]
        seen[name] = False
        m = _ELEMENT_SHIFT.match(defs.get(name, ""))
        shift = int(m.group(1)) if m and m.group(1) else None
        ok = bool(m) and (shift is not None or m.group(2) in ("16", "32"))
        for u in users.get(name, []) if ok else []:
            a = _ASSIGN.match(lines[u])
            use = a.group(2) if a else ""
            if shift is None:
                ok = bool(_FP_BITCAST.match(use))
            else:
                t = _ELEMENT_SHIFT.match(use)
                width = int(t.group(2)) if t and t.group(2) else 0
                ok = width > 0 and shift % width == 0 and element_move(a.group(1), seen)
            if not ok:
                break
        seen[name] = ok
        return ok

    shifts: dict[str, bool] = {}
    moves.update(name for name in defs if element_move(name, shifts))
    # Blocks that end in `unreachable` are error paths; a branch to one is a check.
    traps = set()
    for bi, (lo, hi) in enumerate(blocks):
        last = [ln for ln in lines[lo:hi] if ln.strip()]
        if last and last[-1].strip().startswith("unreachable"):
            traps.add(bi)
    excluded: set[str] = set()

    # The values a check computes only for its branch (used nowhere else): the check's own.
    def exclude_slice(value: str) -> None:
        # `value` lost a use (its branch); a value all of whose uses are excluded goes too.
        work = [value]
        while work:
            v = work.pop()
            uses[v] = uses.get(v, 0) - 1
            body = defs.get(v)
            if body is None or v in excluded or uses[v] > 0:
                continue
            if body.split(None, 1)[0] not in ("phi", "load", "store", "alloca", "atomicrmw"):
                excluded.add(v)
                work.extend(_LOCAL.findall(body.split(", !")[0]))

    check_branches = set()
    for lo, hi in blocks:
        for i in range(lo, hi):
            body = lines[i].strip()
            if body.startswith("br i1 "):
                targets = re.findall(r"label (%[-\w.$]+)", body)
                cond = body[6:].split(",", 1)[0]
                if (
                    any(labels.get(t) in traps for t in targets)
                    or cond in folded
                    or not cond.startswith("%")
                ):
                    check_branches.add(i)
                    exclude_slice(cond)

    def counted(i: int) -> bool:
        """Whether line i is shader code that counts (markers aside, which count apart)."""
        line = lines[i]
        if "!nosanitize" in line or i in check_branches:
            return False
        a = _ASSIGN.match(line)
        if a and (a.group(1) in excluded or a.group(1) in folded or a.group(1) in moves):
            return False
        d = _DBG.search(line)
        if d is not None:
            return not debug.in_shim(debug.frames(d.group(1)))
        return not fn_shim and not (a and unlocated_shim(i, a.group(1)))

    def located_in_shim(i: int) -> bool | None:
        """Whether line i's location is the shim's (None: it has no location, or is a phi)."""
        a = _ASSIGN.match(lines[i])
        d = _DBG.search(lines[i])
        if d is None or (a and a.group(2).startswith("phi")):
            return None
        return debug.in_shim(debug.frames(d.group(1)))

    def unlocated_shim(i: int, name: str) -> bool:
        """An instruction without a location whose users are all the shim's and whose located
        operands are the shim's only: shim code whose location the optimizer dropped when it
        speculated it (the `first ? v : op(acc, v)` of steel_shim::fold became an op beside a
        select, and a half simd_sum counted 31 half adds)."""
        outs = [located_in_shim(u) for u in users.get(name, [])]
        if not outs or not all(outs):
            return False
        ins = [located_in_shim(def_line[v]) for v in _LOCAL.findall(
            lines[i].split(" = ", 1)[1].split(", !")[0]) if v in def_line]  # fmt: skip
        return any(ins) and not any(x is False for x in ins)

    contracted = _contracted(lines, blocks, counted)
    out = []
    for lo, hi in blocks:
        hist = [0] * _SLOTS
        hook = lo
        for i in range(lo, hi):
            line = lines[i]
            stripped = line.strip()
            if not stripped or stripped.startswith(";"):
                if hook == i:
                    hook = i + 1
                continue
            a = _ASSIGN.match(line)
            body = a.group(2) if a else stripped
            op = body.split(None, 1)[0]
            if op in ("phi", "alloca", "landingpad") and hook == i:
                hook = i + 1
            m = _ANNOTATION.search(body)
            if m:
                d = _DBG.search(line)
                marker = markers.get(m.group(2))
                if marker is None or d is None:
                    continue
                frames = debug.frames(d.group(1))
                outer = []
                for sp, at in frames[1:]:
                    if debug.kind(sp) != "shim":
                        break
                    outer.append((sp, at))
                if any(f in marked for f in outer):
                    continue  # a shim function that another marked one calls
                name, elem = marker
                cls = _OPS.get(name, "other")
                n = int(m.group(1))
                if cls == "mma":
                    hist[_F["mma_" + ("half" if elem == "half" else elem)]] += 1
                elif cls == "arith":
                    hist[_F[_FLOAT_TYPES.get(elem, "int")]] += n
                else:
                    hist[_F[cls]] += n if cls in FIELDS[:8] else 1
                continue
            if not counted(i) or i in contracted:
                continue
            _classify(body.split(", !")[0], hist, defined)
        out.append((hook, hist))
    return out


def _contracted(
    lines: list[str], blocks: list[list[int]], counted: Callable[[int], bool]
) -> set[int]:
    """Lines of the fmuls that Metal's compiler contracts into an FMA (see "FMA contraction"
    above)."""
    users: dict[str, list[int]] = {}  # value -> the lines that use it
    for i in range(1, len(lines) - 1):
        a = _ASSIGN.match(lines[i])
        body = a.group(2) if a else lines[i]
        for v in _LOCAL.findall(body.split(", !")[0]):
            users.setdefault(v, []).append(i)
    out: set[int] = set()
    absorbed: set[int] = set()  # the fadds / fsubs that already took one fmul
    for lo, hi in blocks:
        for i in range(lo, hi):
            mul = _fp_op(lines[i])
            if mul is None or mul[1] != "fmul" or not counted(i):
                continue
            use = users.get(mul[0], [])
            if len(use) != 1 or not lo <= use[0] < hi or use[0] in absorbed:
                continue
            add = _fp_op(lines[use[0]])
            if add is None or add[1] not in ("fadd", "fsub") or add[2] != mul[2]:
                continue
            if counted(use[0]):
                out.add(i)
                absorbed.add(use[0])
    return out


def _fp_op(line: str) -> tuple[str, str, str] | None:
    """(value, opcode, type) of an fp arithmetic instruction; None for any other line."""
    a = _ASSIGN.match(line)
    if not a:
        return None
    words = a.group(2).split()
    if not words or words[0] not in _FP_OPS:
        return None
    i = _after_flags(words, 1)
    rest = a.group(2).split(None, i)[i] if i < len(words) else ""
    return a.group(1), words[0], _type_at(rest)


def count_blocks(ir: str) -> str:
    """The TU with a histogram and a counting hook per basic block (see above)."""
    debug = _Debug(ir)
    lines = ir.splitlines()
    strings = {}
    for line in lines:
        if line.startswith("@"):
            m = _STRING.match(line)
            if m and m.group(2).startswith("steel_op:"):
                _, name, elem = m.group(2).split(":")
                strings[m.group(1)] = (name, elem)
    defined = set()
    for line in lines:
        m = _DEFINE.match(line)
        if m:
            defined.add(m.group(1))
    # Shim frames (subprogram, inlinedAt) that hold a marker: their callees' markers don't count.
    marked = set()
    for line in lines:
        m = _ANNOTATION.search(line)
        if m and m.group(2) in strings:
            d = _DBG.search(line)
            if d:
                marked.add(debug.frames(d.group(1))[0])
    out: list[str] = []
    tables: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("define "):
            out.append(line)
            i += 1
            continue
        j = i
        while not lines[j].startswith("}"):
            j += 1
        fn = lines[i : j + 1]
        hooks = {}
        for hook, hist in _function_hists(fn, debug, defined, marked, strings):
            if any(hist):
                name = f"@steel_sim.block.{len(tables)}"
                tables.append(
                    f"{name} = private constant [{_SLOTS} x i32] ["
                    + ", ".join(f"i32 {v}" for v in hist)
                    + "]"
                )
                hooks.setdefault(hook, []).append(f"  call void @steel_sim_block(ptr {name})")
        for k, line2 in enumerate(fn):
            out.extend(hooks.get(k, []))
            out.append(line2)
        i = j + 1
    if not tables:
        return ir
    tables.append("declare void @steel_sim_block(ptr)")
    return "\n".join(out) + "\n\n" + "\n".join(tables) + "\n"


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    with open(dst, "w") as f:
        f.write(rewrite(count_blocks(text)))
