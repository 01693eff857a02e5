"""The fused CUDA paths and `--compile` on a GPU (docs/speed.md). Skipped without one."""

import pytest
import torch

from recompute_bench.backends.pytorch import RMSNorm, _RMSNormFunction
from recompute_bench.launch.compiler import compile_problem
from test_compile import SETTINGS, _step  # noqa: F401  (the CPU test's model and settings)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_cuda_rmsnorm_is_torchs_fused_kernel_and_saves_what_the_cpu_path_saves():
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(256, 1e-5).cuda().to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y = norm(x)
    assert any("_fused_rms_norm" in e.key for e in prof.key_averages())
    ref_saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: ref_saved.append(t.nbytes) or t, lambda t: t):
        ref = _RMSNormFunction.apply(x, norm.weight, 1e-5)
    assert sorted(saved) == sorted(ref_saved)  # the estimate's terms hold for both paths
    torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1e-2)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, norm.weight), g)
    rx, rw = torch.autograd.grad(ref, (x, norm.weight), g)
    torch.testing.assert_close(gx, rx, rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=3e-2, atol=0.5)


@pytest.mark.skipif(compile_problem("cuda") is not None, reason=str(compile_problem("cuda")))
def test_compiled_layers_on_cuda_give_the_eager_loss():
    for name, sets in SETTINGS.items():
        eager = _step([*sets, "training.seq_length=32"], False, device="cuda")
        comp = _step([*sets, "training.seq_length=32"], True, device="cuda")
        assert comp[0] == pytest.approx(eager[0], rel=1e-4), name
