"""The fuzz tests import the oracles and tolerances of tests/gemm and tests/attn."""

import sys
from pathlib import Path

for _d in ("gemm", "attn"):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / _d))
