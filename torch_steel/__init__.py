"""torch-steel: flash attention and steel GEMM Metal kernels for PyTorch on Apple GPUs.

Importing this package registers the ops torch.ops.steel.* (see torch_steel.ops), "steel" as
an attention provider in torch.nn.attention's registry, inactive until
torch.nn.attention.activate_flash_attention_impl("steel") or torch_steel.patch()
(see torch_steel.patching), and serves torch.nn.attention.varlen.varlen_attn on MPS (see
torch_steel.varlen).
"""

from . import kv, ops, varlen
from .backends import BACKENDS, FallbackWarning, backend, current_backend
from .errors import PlanRefused, SimulatorError
from .kv import QuantizedKV
from .ops import gemm, linear, sdpa, sdpa_varlen
from .patching import is_patched, patch, unpatch

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "FallbackWarning",
    "PlanRefused",
    "QuantizedKV",
    "SimulatorError",
    "backend",
    "current_backend",
    "gemm",
    "is_patched",
    "kv",
    "linear",
    "ops",
    "patch",
    "sdpa",
    "sdpa_varlen",
    "unpatch",
    "varlen",
]
