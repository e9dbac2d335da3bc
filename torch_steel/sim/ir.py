"""Makes the memory intrinsics of a shader TU visible to the simulator's checkers.

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


def rewrite(ir: str) -> str:
    wanted: dict[str, tuple[str, list[str], str]] = {}
    out_lines = []
    for line in ir.splitlines():
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


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    with open(dst, "w") as f:
        f.write(rewrite(text))
