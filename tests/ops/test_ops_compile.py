"""torch.compile(fullgraph=True) traces the steel ops (fake impls) and matches eager."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import torch_steel


class Block(torch.nn.Module):
    """A small pre-norm attention + MLP block written with the steel ops."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.up = torch.nn.Linear(dim, 2 * dim)
        self.down = torch.nn.Linear(2 * dim, dim)
        self.sinks = torch.nn.Parameter(torch.zeros(heads))

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm(x)
        q = torch_steel.linear(h, self.q.weight, self.q.bias)
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)
        a = torch.ops.steel.sdpa(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=True,
            sinks=self.sinks,
            window=[4, 0],
        )
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, -1))
        up = torch_steel.linear(self.norm(x), self.up.weight, self.up.bias, activation="gelu")
        return x + torch_steel.gemm(up, self.down.weight.t(), bias=self.down.bias)


def test_compile_fullgraph_attention_block():
    torch._dynamo.reset()
    block = Block()
    x = torch.randn(2, 9, 32, requires_grad=True)
    eager = block(x)
    eager_grad = torch.autograd.grad(eager.square().sum(), x)[0]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    grad = torch.autograd.grad(out.square().sum(), x)[0]
    # Same float32 ops in the same order: identical up to reassociation in the fused graph.
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, eager_grad, atol=1e-4, rtol=1e-4)


def test_compile_inductor_with_patched_sdpa(steel_calls):
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    expected = attend(q, k, v)
    with torch_steel.backend("reference"), torch_steel.patch(devices=("mps", "cpu")):
        got = torch.compile(attend, fullgraph=True)(q, k, v)
    assert steel_calls == ["forward"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_compile_caches_keep_steel_and_pytorch_graphs_apart(steel_calls):
    """torch.compile's on-disk caches key a graph by the code that calls F.sdpa; the steel tag in
    torch.compiler.config.cache_key_tag keeps a graph traced with steel from serving a
    compilation without it (and the other way round)."""

    def attend(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).cos()

    q = torch.randn(1, 2, 8, 16)
    for active in (True, False, True):
        torch._dynamo.reset()
        steel_calls.clear()
        if active:
            with torch_steel.backend("reference"), torch_steel.patch(devices=("mps", "cpu")):
                torch.compile(attend, fullgraph=True)(q)
        else:
            torch.compile(attend, fullgraph=True)(q)
        assert steel_calls == (["forward"] if active else [])
    torch._dynamo.reset()


def test_compiled_graphs_call_the_prechecked_ops():
    """A graph of torch_steel.sdpa / gemm / linear calls the ops' prechecked twins (their
    checks run in the fake implementations when the graph is traced), with eager's results;
    bad input is still the checks' error, raised while tracing."""
    ops = []

    def record(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if str(n.target).startswith("steel."))
        return gm.forward

    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    a, w = torch.randn(3, 8), torch.randn(6, 8)

    def f(q, k, v, a, w):
        out = torch_steel.sdpa(q, k, v, enable_gqa=True, is_causal=True)
        return out, torch_steel.gemm(a, w.t(), activation="silu"), torch_steel.linear(a, w)

    torch._dynamo.reset()
    with torch_steel.backend("reference"):
        got = torch.compile(f, fullgraph=True, backend=record)(q, k, v, a, w)
        expected = f(q, k, v, a, w)
    assert ops == ["steel.sdpa_forward_prechecked.default"] + ["steel.gemm_prechecked.default"] * 2
    for g, e in zip(got, expected):  # the same ops on the same inputs: bitwise equal
        torch.testing.assert_close(g, e, atol=0, rtol=0)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="inner dims differ"):
        torch.compile(lambda a: torch_steel.gemm(a, a), fullgraph=True, backend="aot_eager")(a)
    with pytest.raises(Exception, match="query and key head dims differ"):
        bad = lambda q: torch_steel.sdpa(q, k[..., :4], v, enable_gqa=True)  # noqa: E731
        torch.compile(bad, fullgraph=True)(q)
    torch._dynamo.reset()


def _steel_calls(code):
    """The steel op calls in inductor's generated code: (direct, op name) per call, `direct`
    when it calls the op's implementation (torch_steel.inductor) instead of its overload."""
    calls = re.findall(r"= (steel_graph_calls\.|torch\.ops\.steel\.)(\w+?)(?:\.default)?\(", code)
    return [(how == "steel_graph_calls.", name) for how, name in calls]


# Graphs compiled afresh: one that inductor cached before torch_steel.inductor wrote steel's
# calls keeps the overloads' calls (the caches' keys do not see that hook).
_UNCACHED = (
    torch._inductor.config.patch(fx_graph_cache=False),
    torch._functorch.config.patch(enable_autograd_cache=False),
)


@_UNCACHED[0]
@_UNCACHED[1]
def test_inductor_graphs_call_the_ops_implementations():
    """Inductor writes each steel op of a graph, forward and backward, as a call of its
    implementation (torch_steel.inductor), with eager's results and gradients: the dispatcher's
    pass and the op's Autograd kernel (autograd is outside the graph) cost more per call than
    the whole eager call (issue 16)."""
    torch._dynamo.reset()
    block = Block()
    x = torch.randn(2, 9, 32, requires_grad=True)
    expected = block(x)
    expected_grad = torch.autograd.grad(expected.square().sum(), x)[0]
    compiled = torch.compile(block, fullgraph=True)

    def train_step():
        out = compiled(x)
        return out, torch.autograd.grad(out.square().sum(), x)[0]

    (out, grad), (forward, backward) = run_and_get_code(train_step)
    assert _steel_calls(forward) == [
        (True, "gemm_prechecked"),
        (True, "sdpa_forward_prechecked"),
        (True, "gemm_prechecked"),
        (True, "gemm_prechecked"),
    ]
    backward_calls = _steel_calls(backward)
    assert (True, "sdpa_backward") in backward_calls and (True, "gemm") in backward_calls
    assert all(direct for direct, _ in backward_calls)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # as the aot_eager test
    torch.testing.assert_close(grad, expected_grad, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


@_UNCACHED[0]
@_UNCACHED[1]
def test_inductor_graphs_keep_the_dispatcher_where_it_does_more():
    """A graph's direct call takes the dispatcher whenever it would do more than call the
    implementation: under the profiler, the steel ops of a compiled graph are its events, as
    PyTorch's own are."""
    torch._dynamo.reset()
    q, a = torch.randn(1, 2, 5, 8), torch.randn(3, 8)

    def f(q, a):
        return torch_steel.sdpa(q, q, q, is_causal=True), torch_steel.gemm(a, a.t())

    compiled = torch.compile(f, fullgraph=True)
    expected = f(q, a)
    compiled(q, a)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = compiled(q, a)
    names = {event.name for event in profile.events()}
    assert {"steel::sdpa_forward_prechecked", "steel::gemm_prechecked"} <= names
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-6)
    torch._dynamo.reset()


def test_compiled_code_sees_the_backend_of_its_thread():
    """torch.compile guards on the thread's backend state: code compiled outside any
    `with torch_steel.backend(...)` block recompiles inside one (torch_steel.backends)."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def shifted(x):
        return x + (1 if torch_steel.current_backend() == "reference" else 0)

    x = torch.zeros(1)
    assert shifted(x).item() == 0
    with torch_steel.backend("reference"):
        assert shifted(x).item() == 1
    assert shifted(x).item() == 0
    torch._dynamo.reset()
