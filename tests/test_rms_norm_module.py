"""tpfuse.RMSNorm as a drop-in for torch.nn.RMSNorm; the custom ops under torch.compile,
torch.library.opcheck and CUDA graphs."""

import pytest
import torch

import tpfuse
from tpfuse.kernels.norm_dw import DwPlan
from tests.conftest import DEVICE
from tpfuse.reference import rel_err, rel_err_budget


def test_module_matches_torch_rmsnorm_and_shares_state_dict():
    torch_norm = torch.nn.RMSNorm(1000, eps=1e-6, device=DEVICE)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.randn(1000))
    ours = tpfuse.RMSNorm(1000, eps=1e-6, device=DEVICE)
    assert set(ours.state_dict()) == set(torch_norm.state_dict()) == {"weight"}
    ours.load_state_dict(torch_norm.state_dict())
    x = torch.randn(3, 5, 1000, device=DEVICE)
    assert rel_err(ours(x), torch_norm(x).double()) <= rel_err_budget(torch.float32)
    residual = torch.randn_like(x)
    y, r = ours(x, residual)
    assert torch.equal(r, x + residual) and torch.equal(y, ours(r))


def test_module_multi_dim_shape_and_no_affine():
    x = torch.randn(4, 6, 10, device=DEVICE)
    ours = tpfuse.RMSNorm((6, 10), device=DEVICE)
    ref = torch.nn.RMSNorm((6, 10), eps=1e-6, device=DEVICE)
    assert ours.weight.shape == (6, 10)
    assert rel_err(ours(x), ref(x)) <= rel_err_budget(torch.float32)
    plain = tpfuse.RMSNorm(10, elementwise_affine=False)
    assert plain.weight is None and list(plain.state_dict()) == []
    with pytest.raises(ValueError, match="normalized_shape"):
        ours(torch.randn(4, 10, device=DEVICE))


def test_module_with_weight_in_another_dtype_than_input():
    ours = tpfuse.RMSNorm(64, device=DEVICE, dtype=torch.bfloat16)
    ref = torch.nn.RMSNorm(64, eps=1e-6, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(8, 64, device=DEVICE)
    y = ours(x)
    assert y.dtype == torch.float32
    assert rel_err(y, ref(x)) <= rel_err_budget(torch.float32)


def test_module_gradients_flow_to_weight():
    ours = tpfuse.RMSNorm(64, device=DEVICE)
    ref = torch.nn.RMSNorm(64, eps=1e-6, device=DEVICE)
    x = torch.randn(8, 64, device=DEVICE)
    ours(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert rel_err(ours.weight.grad, ref.weight.grad) <= 2 * rel_err_budget(torch.float32)


@pytest.mark.smoke
def test_custom_ops_pass_opcheck():
    x = torch.randn(5, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(64, device=DEVICE, requires_grad=True)
    r = torch.randn(5, 64, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.tpfuse.rms_norm, (x, w, 1e-6, 0.0))
    torch.library.opcheck(torch.ops.tpfuse.add_rms_norm, (x, r, w, 1e-6, 1.0))
    torch.library.opcheck(torch.ops.tpfuse.add_rms_norm_, (x.detach(), r.detach().clone(), w.detach(), 1e-6, 0.0))
    dy = torch.randn(5, 64, device=DEVICE)
    torch.library.opcheck(torch.ops.tpfuse.rms_norm_backward, (dy, x.detach(), w.detach(), None, 1e-6, 0.0))


class _Tiny(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.proj = torch.nn.Linear(n, n)
        self.norm = tpfuse.RMSNorm(n)

    def forward(self, x, residual):
        y, residual = self.norm(self.proj(x), residual)
        return self.norm(y + residual)


def _compile_matches_eager(backend):
    torch._dynamo.reset()
    model = _Tiny(64).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(4, 64, device=DEVICE)
    residual = torch.randn(4, 64, device=DEVICE)
    out = compiled(x, residual)
    assert torch.equal(out, model(x, residual))
    out.sum().backward()
    assert model.norm.weight.grad is not None and model.norm.weight.grad.abs().sum() > 0


def test_torch_compile_fullgraph_traces_the_ops():
    # aot_eager traces forward and backward through the fake implementations with no
    # graph break, without needing a C++ compiler on CPU.
    _compile_matches_eager("aot_eager")


@pytest.mark.gpu
def test_torch_compile_inductor_fullgraph():
    _compile_matches_eager("inductor")


@pytest.mark.gpu
# dW combined by column programs, by the tree (300 rows: 75 partials), or by the separate launch
# after the chunked rows' backward (a cooperative launch, over words zeroed in the graph).
@pytest.mark.parametrize("m, n, combine", [(16, 4096, "columns"), (300, 1000, "tree"), (64, 20000, "launch")])
def test_cuda_graph_capture_and_replay(m, n, combine):
    assert DwPlan.from_shape(m, n, torch.bfloat16).combine == combine
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    xg = x.clone().requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    # Warm up eagerly (compiles kernels, allocates the dW counters) on a side stream.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            tpfuse.add_rms_norm(x, residual, w)
            tpfuse.rms_norm(xg, wg).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    graphs, outs = [], []
    for _ in range(2):  # two graphs sharing the counters, replayed alternately
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y, r = tpfuse.add_rms_norm(x, residual, w)
            dx, dw = torch.autograd.grad(tpfuse.rms_norm(xg, wg), (xg, wg), dy)
        graphs.append(graph)
        outs.append((y, r, dx, dw))
    for i in range(6):
        for t in (x, residual, dy):
            t.copy_(torch.randn_like(t))
        xg.data.copy_(torch.randn_like(xg))
        graphs[i % 2].replay()
        torch.cuda.synchronize()
        y, r, dx, dw = outs[i % 2]
        y_e, r_e = tpfuse.add_rms_norm(x, residual, w)
        dx_e, dw_e = torch.autograd.grad(tpfuse.rms_norm(xg, wg), (xg, wg), dy)
        assert torch.equal(y, y_e) and torch.equal(r, r_e)
        assert torch.equal(dx, dx_e) and torch.equal(dw, dw_e)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen on machines without CUDA")
def test_import_after_triton_without_cuda_fails_clearly_or_works_with_the_interpreter_set():
    import os
    import subprocess
    import sys

    code = "import triton, torch; import tpfuse; print(tpfuse.rms_norm(torch.ones(2, 8)).sum().item())"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    late = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert late.returncode != 0 and "Import tpfuse before triton" in late.stderr, late.stderr[-2000:]
    env["TRITON_INTERPRET"] = "1"
    ok = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and float(ok.stdout.split()[-1]) == pytest.approx(16.0, rel=1e-5), ok.stderr[-2000:]
