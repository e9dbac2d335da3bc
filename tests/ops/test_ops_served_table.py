"""The docs' table of what steel serves and what stays PyTorch's, row by row, measured.

Each row of the table under `<!-- served-table -->` in docs/integration.md has a scenario here,
run on CPU tensors with the CPU keys intercepted and the "reference" backend (the stand-in for
MPS that the other integration tests use); a scenario says who served the call. The table and
the scenarios must list the same rows and agree."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left
from torch.nn.functional import scaled_dot_product_attention as sdpa_taken_before

import torch_steel
from torch_steel import patching
from torch_steel.errors import PlanRefused

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"
CPU = ("mps", "cpu")


def _table():
    text = DOC.read_text()
    start = text.index("<!-- served-table -->")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("call", "---"):
            continue
        rows[cells[0]] = cells[1]
    return rows


def _qkv(grad=False):
    return tuple(torch.randn(1, 2, 4, 8, requires_grad=grad) for _ in range(3))


def f_sdpa():
    q, k, v = _qkv(grad=True)
    F.scaled_dot_product_attention(q, k, v).sum().backward()


def taken_before():
    sdpa_taken_before(*_qkv())


def cpp():
    torch._C._nn.scaled_dot_product_attention(*_qkv())


def no_grad_inference():
    with torch.no_grad():
        F.scaled_dot_product_attention(*_qkv())
    with torch.inference_mode():
        F.scaled_dot_product_attention(*_qkv())


def autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.scaled_dot_product_attention(*_qkv()).dtype == torch.bfloat16


def compiled():
    torch._dynamo.reset()
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), fullgraph=True,
                      backend="aot_eager")  # fmt: skip
    f(_qkv()[0])
    torch._dynamo.reset()


def compiled_dropout():
    torch._dynamo.reset()
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.3),
                      fullgraph=True, backend="aot_eager")  # fmt: skip
    f(_qkv()[0])
    torch._dynamo.reset()


def functorch():
    q = _qkv()[0]
    torch.func.grad(lambda x: F.scaled_dot_product_attention(x, x, x).sum())(q)
    torch.vmap(lambda x: F.scaled_dot_product_attention(x, x, x))(q[None])


def forward_ad():
    import torch.autograd.forward_ad as fwAD

    q = _qkv()[0]
    with fwAD.dual_level(), pytest.raises(NotImplementedError):  # as without steel, on CPU
        F.scaled_dot_product_attention(*(fwAD.make_dual(q, torch.ones_like(q)),) * 3)


def mha_no_weights(monkeypatch):
    monkeypatch.setattr(torch.backends.mha, "get_fastpath_enabled", lambda: False)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 4, 8)
    mha(x, x, x, need_weights=False)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    layer(x)


def _varlen(**kwargs):
    from torch.nn.attention.varlen import varlen_attn

    q = torch.randn(7, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return varlen_attn(q, q, q, cu, cu, 4, 4, **kwargs), q


def varlen_attn():
    out, q = _varlen(window_size=(-1, 0))
    out.sum().backward()


def varlen_attn_options():
    from torch.nn.attention.varlen import varlen_attn

    with torch.no_grad():
        _varlen(num_splits=2)
        q = torch.randn(2, 2, 8)
        pool = torch.randn(3, 4, 2, 8)
        table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
        used = torch.tensor([6, 3], dtype=torch.int32)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)
        varlen_attn(q, pool, pool, cu, None, 1, 6, block_table=table, seqused_k=used)


def mha_weights():
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 4, 8)
    mha(x, x, x)


def mha_fastpath():
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 4, 8)
    with torch.inference_mode():
        mha(x, x, x, need_weights=False)


def causal_bias():
    q, k, v = _qkv()
    F.scaled_dot_product_attention(q, k, v, causal_upper_left(4, 4))
    F.scaled_dot_product_attention(q[:, :, :3], k, v, causal_lower_right(3, 4))


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 1


def hf_sdpa():
    pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sdpa_attention_forward(_Module(), *_qkv(), None, scaling=0.3)


def hf_steel():
    pytest.importorskip("transformers")
    import torch_steel.hf

    torch_steel.hf.varlen_attention_forward(_Module(), *_qkv(), None)


def hf_eager():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import eager_attention_forward

    eager_attention_forward(_Module(), *_qkv(), None, scaling=0.3)


def nested():
    nt = torch.nested.nested_tensor(
        [torch.randn(3, 2, 8), torch.randn(5, 2, 8)], layout=torch.jagged
    ).transpose(1, 2)
    F.scaled_dot_product_attention(nt, nt, nt)


def invalid():
    q = torch.randn(1, 2, 3, 4)
    for call in (
        lambda: F.scaled_dot_product_attention(q, torch.randn(1, 2, 3, 5), q),
        lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=1.5),
    ):
        with pytest.raises(RuntimeError):
            call()


def refused(monkeypatch):
    def refuse(*args, **kwargs):
        raise PlanRefused("steel::sdpa: refused")

    monkeypatch.setattr(patching.ops, "sdpa", refuse)
    F.scaled_dot_product_attention(*_qkv())


SCENARIOS = {
    "`F.scaled_dot_product_attention`, forward and backward": f_sdpa,
    "a reference to it taken before `patch()`": taken_before,
    "C++ `at::scaled_dot_product_attention`": cpp,
    "under `no_grad` / `inference_mode`": no_grad_inference,
    "under `torch.autocast`": autocast,
    "`torch.compile(fullgraph=True)` graphs": compiled,
    "`nn.MultiheadAttention(need_weights=False)`, Transformer layers": mha_no_weights,
    "a `causal_upper_left` / `causal_lower_right` mask": causal_bias,
    'Hugging Face `attn_implementation="sdpa"`, diffusers\' attention processors': hf_sdpa,
    'Hugging Face `attn_implementation="steel"` (`torch_steel.hf`)': hf_steel,
    "`torch.nn.attention.varlen.varlen_attn`, forward and backward": varlen_attn,
    "`varlen_attn` with `seqused_k`, `block_table` or `num_splits > 1`": varlen_attn_options,
    "`nn.MultiheadAttention` with `need_weights=True` (its default)": mha_weights,
    'Hugging Face `attn_implementation="eager"`': hf_eager,
    "nested (jagged) tensors": nested,
    "invalid arguments, `dropout_p` outside [0, 1]": invalid,
    "a Metal plan that refuses, or no Metal extension": refused,
    "inside `torch.func` transforms (`grad`, `vmap`, `jvp`, ...)": functorch,
    "forward-mode AD (dual tensors)": forward_ad,
    "`dropout_p > 0` inside a `torch.compile` graph": compiled_dropout,
    'CPU tensors, unless `patch(devices=("mps", "cpu"))`': "default devices",
    "`nn.MultiheadAttention` fused fast path (CPU inference)": mha_fastpath,
}


def test_table_and_scenarios_list_the_same_rows():
    assert list(_table()) == list(SCENARIOS)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap over PyTorch's kernel
@pytest.mark.parametrize("row", list(SCENARIOS))
def test_row_is_true(row, steel_calls, monkeypatch):
    expected = _table()[row]
    scenario = SCENARIOS[row]
    devices = CPU
    if scenario == "default devices":
        devices, scenario = None, f_sdpa
    with torch_steel.backend("reference"), torch_steel.patch(devices=devices):
        if "monkeypatch" in scenario.__code__.co_varnames[: scenario.__code__.co_argcount]:
            scenario(monkeypatch)
        else:
            scenario()
    served = "steel" if steel_calls else "PyTorch"
    assert re.match(r"\w+", expected).group(0) == served, steel_calls
    if row.startswith("`F.scaled_dot_product_attention`"):
        assert steel_calls == ["forward", "backward"]
    if row.startswith("`torch.nn.attention.varlen"):
        assert "varlen_forward" in steel_calls and "varlen_backward" in steel_calls
