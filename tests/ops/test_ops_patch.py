"""Steel as F.scaled_dot_product_attention's provider at the dispatcher (torch_steel.patching):
the torch.nn.attention registry, patch()/unpatch(), every caller, and what stays PyTorch's.

MPS is what steel intercepts by default; these tests run the same machinery on the CPU keys
(patch(devices=CPU)) with the "reference" and "sim" backends.
"""

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn import attention
from torch.nn.functional import scaled_dot_product_attention as sdpa_taken_before

import torch_steel
from torch_steel import backends, patching
from torch_steel.errors import PlanRefused

CPU = ("mps", "cpu")


def pytorch_sdpa(*args, **kwargs):
    """PyTorch's own F.sdpa, whatever provider is active."""
    return patching._pytorch_sdpa(*args, **kwargs)


def _sim_or_skip():
    ok, why = backends.sim_status()
    if not ok:
        pytest.skip(why)


@pytest.fixture(params=["reference", "sim"])
def steel_backend(request):
    """Each backend that serves CPU tensors with steel (sim: the simulator falls back to
    reference math with its warning while the attention kernels do not exist)."""
    if request.param == "sim":
        _sim_or_skip()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", backends.FallbackWarning)
        with torch_steel.backend(request.param):
            yield request.param


def test_registered_on_import_active_only_when_asked():
    assert "steel" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() is None
    assert not torch_steel.is_patched()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::scaled_dot_product_attention", "AutogradMPS"
    )


def test_patch_round_trip_registers_and_removes_the_kernels():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    torch_steel.patch()
    torch_steel.patch()  # idempotent
    assert torch_steel.is_patched() and attention.current_flash_attention_impl() == "steel"
    assert patching.active_devices() == ("mps",)
    for key in ("MPS", "AutogradMPS"):
        assert has("aten::scaled_dot_product_attention", key)
    torch_steel.unpatch()
    assert not torch_steel.is_patched() and attention.current_flash_attention_impl() is None
    assert not has("aten::scaled_dot_product_attention", "AutogradMPS")
    torch_steel.unpatch()  # no-op when not active
    assert patching.active_devices() == ()


def test_patch_round_trip_restores_tracing_hooks():
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    tag = torch.compiler.config.cache_key_tag
    with torch_steel.patch(devices=CPU):
        assert sdpa.py_kernels[cia] is patching._steel_kernel
        assert torch.compiler.config.cache_key_tag == f"{tag}|torch_steel:mps,cpu"
    assert cia not in sdpa.py_kernels
    assert torch.compiler.config.cache_key_tag == tag


def test_patch_context_manager_restores_previous_state():
    with torch_steel.patch():
        assert torch_steel.is_patched()
        with torch_steel.patch(devices=CPU):
            assert patching.active_devices() == CPU
        assert patching.active_devices() == ("mps",)  # the inner block restored the outer's
    assert not torch_steel.is_patched()


def test_cpu_is_not_intercepted_unless_asked(steel_calls):
    q = torch.randn(1, 2, 4, 8)
    with torch_steel.backend("reference"), torch_steel.patch():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert steel_calls == []
    torch.testing.assert_close(out, pytorch_sdpa(q, q, q, is_causal=True))


def test_activate_through_torch_registry(steel_calls, monkeypatch):
    monkeypatch.setenv("TORCH_STEEL_PATCH_DEVICES", "mps,cpu")
    q = torch.randn(1, 2, 4, 8)
    attention.activate_flash_attention_impl("steel")
    try:
        assert torch_steel.is_patched()
        with torch_steel.backend("reference"):
            out = F.scaled_dot_product_attention(q, q, q)
        assert steel_calls == ["forward"]
    finally:
        attention.restore_flash_attention_impl()
    assert not torch_steel.is_patched()
    with torch_steel.backend("reference"):
        F.scaled_dot_product_attention(q, q, q)
    assert steel_calls == ["forward"]
    torch.testing.assert_close(out, pytorch_sdpa(q, q, q), atol=1e-6, rtol=1e-5)


def test_bad_patch_devices_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="devices"):
        torch_steel.patch(devices=("cuda",))
    monkeypatch.setenv("TORCH_STEEL_PATCH_DEVICES", "gpu")
    with pytest.raises(ValueError, match="TORCH_STEEL_PATCH_DEVICES"):
        torch_steel.patch()
    assert not torch_steel.is_patched()


CALLERS = {
    "F.sdpa": lambda *a, **k: F.scaled_dot_product_attention(*a, **k),
    "taken before patch": lambda *a, **k: sdpa_taken_before(*a, **k),
    "C++ binding": lambda *a, **k: torch._C._nn.scaled_dot_product_attention(*a, **k),
    "aten op": lambda *a, **k: torch.ops.aten.scaled_dot_product_attention(*a, **k),
}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_every_caller_and_mode_is_served(caller, mode, steel_backend, steel_calls):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = torch.rand(5, 7) > 0.3
    context = {
        "grad": torch.enable_grad,
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
    }[mode]
    with torch_steel.patch(devices=CPU), context():
        out = CALLERS[caller](q, k, v, mask, enable_gqa=True, scale=0.2)
    assert steel_calls == ["forward"]
    expected = pytorch_sdpa(q, k, v, mask, enable_gqa=True, scale=0.2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


CASES = {
    "causal": dict(is_causal=True),
    "bool mask": dict(attn_mask="bool"),
    "float mask": dict(attn_mask="float"),
    "gqa": dict(enable_gqa=True, kv_heads=2),
    "scale, Ev != E": dict(scale=0.3, ev=6),
    "broadcast batch": dict(broadcast=True),
}


def _case(case):
    c = dict(CASES[case])
    kvh, ev = c.pop("kv_heads", 4), c.pop("ev", 8)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    kb = 1 if c.pop("broadcast", False) else 2
    k = torch.randn(kb, kvh, 7, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kb, kvh, 7, ev, dtype=torch.float64, requires_grad=True)
    if c.get("attn_mask") == "bool":
        c["attn_mask"] = torch.rand(5, 7) > 0.3
    elif c.get("attn_mask") == "float":
        c["attn_mask"] = torch.randn(4, 5, 7, dtype=torch.float64, requires_grad=True)
    return (q, k, v), c


def _grads(fn, inputs, kwargs):
    out = fn(*inputs, **kwargs)
    leaves = [*inputs] + [t for t in kwargs.values() if torch.is_tensor(t) and t.requires_grad]
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return out, grads


@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_pytorch(case, steel_backend, steel_calls):
    inputs, kwargs = _case(case)
    with torch_steel.patch(devices=CPU):
        out, grads = _grads(F.scaled_dot_product_attention, inputs, kwargs)
    assert steel_calls == ["forward", "backward"]
    expected, expected_grads = _grads(pytorch_sdpa, inputs, kwargs)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def _no_fastpath(monkeypatch):
    # nn.MultiheadAttention's fused fast path is limited to cpu, cuda and privateuse1 (never MPS);
    # on CPU it bypasses F.sdpa, so it is off here as it is on MPS.
    monkeypatch.setattr(torch.backends.mha, "get_fastpath_enabled", lambda: False)


@pytest.mark.parametrize("train", [True, False])
def test_multihead_attention(train, steel_calls, monkeypatch):
    _no_fastpath(monkeypatch)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64).train(train)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.rand(6, 6) > 0.8  # True = not allowed, nn.MultiheadAttention's convention

    def run():
        mha.zero_grad()
        out, _ = mha(x, x, x, attn_mask=mask, need_weights=False)
        out.sum().backward()
        return out, [p.grad.clone() for p in mha.parameters()]

    expected, expected_grads = run()
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        got, grads = run()
    assert steel_calls == ["forward", "backward"]
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("train", [True, False])
def test_transformer_layers(train, steel_calls, monkeypatch):
    _no_fastpath(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Transformer(
        16, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, dropout=0.0,
        batch_first=True, dtype=torch.float64,
    ).train(train)  # fmt: skip
    src = torch.randn(2, 6, 16, dtype=torch.float64)
    tgt = torch.randn(2, 5, 16, dtype=torch.float64)
    tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)

    def run():
        model.zero_grad()
        out = model(src, tgt, tgt_mask=tgt_mask, tgt_is_causal=True)
        out.sum().backward()
        return out, [p.grad.clone() for p in model.parameters()]

    expected, expected_grads = run()
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        got, grads = run()
    # Encoder self-attention, decoder self-attention and cross-attention.
    assert steel_calls.count("forward") == 3 and steel_calls.count("backward") == 3
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_compiled_fullgraph_runs_steel(mask, steel_backend, steel_calls):
    torch._dynamo.reset()
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    k = torch.randn(1, 2, 8, 16, requires_grad=True)
    mask = {None: None, "bool": torch.rand(8, 8) > 0.3, "float": torch.randn(8, 8)}[mask]

    def f(q, k):
        return F.scaled_dot_product_attention(q, k, k, mask, is_causal=mask is None).sin()

    with torch_steel.patch(devices=CPU):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        out = compiled(q, k)
        out.sum().backward()
    assert steel_calls == ["forward", "backward"]
    grads = (q.grad, k.grad)
    q.grad = k.grad = None
    expected = f(q, k)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads, (q.grad, k.grad), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_aten_op_with_a_causal_bias_object(steel_calls):
    """Called as the aten op, a CausalBias reaches the kernel itself: steel takes its meaning."""
    from torch.nn.attention.bias import causal_lower_right

    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    bias = causal_lower_right(3, 5)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        out = torch.ops.aten.scaled_dot_product_attention(q, k, k, bias)
    assert steel_calls == ["forward"]
    expected = pytorch_sdpa(q, k, k, bias._materialize())
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_torch_func_transforms_run_pytorchs_kernel(steel_calls):
    q = torch.randn(1, 2, 4, 8)

    def loss(x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True).square().sum()

    expected = torch.func.grad(loss)(q)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        got = torch.func.grad(loss)(q)
        batched = torch.vmap(lambda x: F.scaled_dot_product_attention(x, x, x))(q[None])
    assert steel_calls == []
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(batched[0], pytorch_sdpa(q, q, q))


def test_forward_mode_ad_is_not_silently_dropped(steel_calls):
    """steel's ops have no forward derivative: dual tensors go to PyTorch (whose CPU kernel
    refuses them too, where steel would have returned no tangent)."""
    import torch.autograd.forward_ad as fwAD

    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU), fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="forward AD"):
            F.scaled_dot_product_attention(dual, dual, dual)
    assert steel_calls == []


def test_cpu_calls_under_auto_run_pytorchs_kernel(steel_calls):
    q = torch.randn(1, 2, 4, 8)
    with torch_steel.patch(devices=CPU):
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert steel_calls == []
    torch.testing.assert_close(out, pytorch_sdpa(q, q, q, is_causal=True))


def test_calls_steel_cannot_serve_get_pytorchs_error(steel_calls):
    q = torch.randn(1, 2, 3, 4)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        with pytest.raises(RuntimeError):  # PyTorch's own error for mismatched head dims
            F.scaled_dot_product_attention(q, torch.randn(1, 2, 3, 5), q)
    assert steel_calls == []


def test_refused_metal_plan_runs_pytorchs_kernel(monkeypatch, steel_calls):
    """On MPS a call whose Metal plan refuses (or without the extension) runs PyTorch's own
    kernel, never reference math: shown on CPU by letting the intercepted op raise as the
    Metal path does under backends.refusals_raise."""
    q = torch.randn(1, 2, 4, 8)

    def refused(*args, **kwargs):
        assert getattr(backends._local, "refusals_raise", False)
        raise PlanRefused("steel::sdpa: no kernel for this yet")

    monkeypatch.setattr(patching.ops, "sdpa", refused)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        out = F.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(out, pytorch_sdpa(q, q, q))


def test_refused_plan_is_an_error_in_strict_mode(monkeypatch):
    def refused(*args, **kwargs):
        raise PlanRefused("steel::sdpa: no kernel for this yet")

    monkeypatch.setattr(patching.ops, "sdpa", refused)
    monkeypatch.setenv("TORCH_STEEL_STRICT", "1")
    q = torch.randn(1, 2, 4, 8)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        with pytest.raises(PlanRefused, match="no kernel"):
            F.scaled_dot_product_attention(q, q, q)


def test_refusals_raise_instead_of_reference_on_mps(monkeypatch):
    """backends.run on (pretended) MPS tensors: a refused plan or a missing extension raises
    PlanRefused under refusals_raise, falls back to reference math otherwise."""
    monkeypatch.setattr(backends, "_device_type", lambda tensors: "mps")
    monkeypatch.setattr(backends, "metal_status", lambda: (False, "no MPS device"))
    with backends.refusals_raise(), pytest.raises(PlanRefused, match="no MPS device"):
        backends.run("sdpa", [], {}, lambda: ["reference"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", backends.FallbackWarning)
        assert backends.run("sdpa", [], {}, lambda: ["reference"]) == ["reference"]


def test_learned_bias_trains_under_patch(steel_calls):
    q = torch.randn(1, 2, 3, 4)
    learned_bias = torch.randn(3, 3, requires_grad=True)
    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        F.scaled_dot_product_attention(q, q, q, learned_bias).sum().backward()
    assert steel_calls == ["forward", "backward"]
    expected = torch.zeros(3, 3, requires_grad=True)
    pytorch_sdpa(q, q, q, expected + learned_bias.detach()).sum().backward()
    torch.testing.assert_close(learned_bias.grad, expected.grad, atol=1e-5, rtol=1e-5)


def test_patch_is_thread_safe():
    barrier = threading.Barrier(8)

    def flip():
        barrier.wait()
        for _ in range(50):
            torch_steel.patch()
            torch_steel.unpatch()

    threads = [threading.Thread(target=flip) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not torch_steel.is_patched()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::scaled_dot_product_attention", "AutogradMPS"
    )
    torch_steel.patch()
    assert torch_steel.is_patched()


# ----------------------------------------------------------------------------- varlen_attn


def _varlen_inputs(dtype=torch.float64):
    q = torch.randn(7, 4, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(9, 2, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(9, 2, 8, dtype=dtype, requires_grad=True)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    return (q, k, v), cu_q, cu_k


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0)])
def test_varlen_attn_runs_steel(window, steel_backend, steel_calls):
    """torch.nn.attention.varlen.varlen_attn (flash-attn conventions: causal and windows
    aligned bottom-right per sequence) on steel::sdpa_varlen, forward and backward, against
    F.sdpa per sequence with the same mask."""
    from torch.nn.attention.varlen import varlen_attn

    (q, k, v), cu_q, cu_k = _varlen_inputs()
    with torch_steel.patch(devices=CPU):
        aux = torch.nn.attention.varlen.AuxRequest(lse=True)
        out, lse = varlen_attn(
            q, k, v, cu_q, cu_k, 4, 5, window_size=window, enable_gqa=True, return_aux=aux
        )
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert steel_calls == ["varlen_forward", "varlen_backward"]
    assert lse.shape == (4, 7)
    expected = []
    for (q0, q1), (k0, k1) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        L, S = qs.shape[1], ks.shape[1]
        i = torch.arange(L)[:, None] + S - L
        j = torch.arange(S)[None]
        keep = torch.ones(L, S, dtype=torch.bool)
        if window[0] >= 0:
            keep &= j >= i - window[0]
        if window[1] >= 0:
            keep &= j <= i + window[1]
        expected.append(pytorch_sdpa(qs, ks, vs, keep, enable_gqa=True).transpose(0, 1))
    expected = torch.cat(expected)
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want)


def test_varlen_attn_num_splits_goes_to_the_decode_route(steel_calls):
    """num_splits (and a KV cache) take torch_steel.varlen's kernel under patch() too, with the
    same results as without it."""
    from torch.nn.attention.varlen import varlen_attn

    (q, k, v), cu_q, cu_k = _varlen_inputs()
    with torch_steel.backend("reference"):
        with torch.no_grad(), torch_steel.patch(devices=CPU):
            out = varlen_attn(q, k, v, cu_q, cu_k, 4, 5, enable_gqa=True, num_splits=2)
        with torch.no_grad():
            expected = varlen_attn(q, k, v, cu_q, cu_k, 4, 5, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert steel_calls == ["varlen_forward", "varlen_forward"]


def test_varlen_attn_compiles(steel_calls):
    from torch.nn.attention.varlen import varlen_attn

    torch._dynamo.reset()
    (q, k, v), cu_q, cu_k = _varlen_inputs(torch.float32)

    def f(q, k, v):
        return varlen_attn(q, k, v, cu_q, cu_k, 4, 5, window_size=(-1, 0), enable_gqa=True)

    with torch_steel.backend("reference"), torch_steel.patch(devices=CPU):
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
        expected = f(q, k, v)
    assert "varlen_forward" in steel_calls
    torch.testing.assert_close(out, expected)
    torch._dynamo.reset()
