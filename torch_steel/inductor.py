"""steel's ops in the Python that torch.compile's inductor writes for a graph (issue 16).

Inductor calls an op it has no lowering for (every steel op) through its overload,
`torch.ops.steel.<name>.default(...)`: through the dispatcher, which converts every argument and
result between Python and C++ twice more to reach the op's Python implementation, and through
the op's Autograd kernel, which a graph (autograd is outside it) does not need. That pass costs
more per call than the whole eager call (issue 16). Here each steel op writes, in its place, a
call of `steel_graph_calls.<name>(...)`: this module's function of that name (`add`), the op's
implementation itself when the dispatcher would call nothing else (ops.registry._undispatched, as
for an eager call), else the overload, so that the call means what it meant.

The hook is inductor's registry of codegen per extern kernel (CUSTOM_EXTERN_KERNEL_CODEGEN, by
the kernel's Python name). Where inductor has none (another torch), writes C++ (AOTInductor) or
an FX graph, the graph keeps the overload's call. So does a graph that inductor's caches hold
from before this hook (their keys do not see it): until they are cleared, or torch changes.
"""

from __future__ import annotations

import sys

try:
    from torch._inductor.codegen.custom_extern_kernel_codegen import (
        CUSTOM_EXTERN_KERNEL_CODEGEN,
        CustomCodegen,
    )
except ImportError:  # a torch without the registry: graphs call the overloads
    CUSTOM_EXTERN_KERNEL_CODEGEN = None

_IMPORT = f"import {__name__} as steel_graph_calls"


def _positional(node, wrapper):
    """The node's arguments as the op's schema orders them, each written as inductor writes it
    (its keyword arguments in their places), or None when one is missing or has no place."""
    args = node.codegen_args()
    kwargs = dict(node.kwargs)
    for argument in node.op_overload._schema.arguments[len(args) :]:
        if argument.name not in kwargs:
            return None
        args.append(wrapper.val_to_arg_str(kwargs.pop(argument.name)))
    return None if kwargs else args


def _codegen(name):
    def codegen(node, writeline):
        from torch._inductor.codegen.wrapper import ExternKernelAllocLine
        from torch._inductor.virtualized import V

        wrapper = V.graph.wrapper_code
        args = None
        if not (V.graph.cpp_wrapper or getattr(V.graph, "fx_wrapper", False)):
            args = _positional(node, wrapper)
        if args is None:
            writeline(ExternKernelAllocLine(wrapper, node))  # inductor's own line
            return
        wrapper.add_import_once(_IMPORT)
        writeline(
            f"{wrapper.declare}{node.get_name()} = "
            f"steel_graph_calls.{name}({', '.join(args)}){wrapper.ending}"
        )

    return codegen


def add(name, call):
    """Graphs call steel::<name> as `call` (this module's attribute `name`)."""
    setattr(sys.modules[__name__], name, call)
    if CUSTOM_EXTERN_KERNEL_CODEGEN is not None:
        CUSTOM_EXTERN_KERNEL_CODEGEN[f"torch.ops.steel.{name}.default"] = CustomCodegen(
            python=_codegen(name)
        )
