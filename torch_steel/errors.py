"""Exceptions shared by the backends."""


class PlanRefused(RuntimeError):
    """The Metal launch plan cannot serve this call; the message names the limit.

    The op layer catches it, warns once and falls back to reference math, unless strict mode
    (TORCH_STEEL_STRICT=1) is on.
    """


class SimulatorError(RuntimeError):
    """A kernel misbehaved in the Metal simulator (out-of-bounds access, race, divergent barrier,
    resource limit), or the simulator could not be built. The message names the kernel."""
