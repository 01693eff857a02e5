"""What a measurement holds, reads and moves, measured on CPU: the probe lets go of the micro-batch
it counted, the optimizer holds the bytes per parameter the estimate states, a step reads nothing
back to the host, fp32 on CUDA runs on TF32 and says so, offload moves exactly the activations,
and the sweep parent runs without torch while its workers die with it."""

from __future__ import annotations

import copy
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path

import pytest
import torch
from helpers import config, held_bytes, held_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from recompute_bench.analysis.flops import peak
from recompute_bench.analysis.harness.rank import optimizer_bytes_per_parameter
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.optimizer import make_optimizer
from recompute_bench.measure.point import run_point
from recompute_bench.measure.probe import SavedTensorProbe
from recompute_bench.measure.step import Stepper, synthetic_batches
from recompute_bench.models.dense.layers import build_model
from recompute_bench.recompute.apply import apply_recompute

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
NO_DROPOUT = ["model.hidden_dropout=0", "model.attention_dropout=0"]


def _storage_keys(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


# ----- 1. the probe holds nothing after the forward ----------------------------------------------
def test_the_probe_step_leaves_no_saved_storage_alive(monkeypatch):
    cfg = config(training__precision="fp32")
    model = apply_recompute(build_model(cfg.model, 1, CPU, torch.float32), cfg.recompute).train()
    batches = synthetic_batches(cfg, CPU)
    optimizer = make_optimizer(model, "fp32")
    stepper = Stepper(cfg, model, optimizer, batches)
    seen: list[weakref.ref] = []
    pack = SavedTensorProbe._pack

    def spy(self, t):
        seen.append(weakref.ref(t.untyped_storage()))  # torch keeps one Python object per live storage
        return pack(self, t)

    monkeypatch.setattr(SavedTensorProbe, "_pack", spy)
    probe = SavedTensorProbe(model)
    stepper.step(probe)
    gc.collect()

    # What outlives the step for its own reasons: weights, their gradients, optimizer state and the
    # token batch (the embedding saves a view of it).
    owned = _storage_keys([*model.parameters(), *model.buffers(), batches])
    owned |= _storage_keys(held_tensors(model, optimizer))
    alive = {s._cdata: s.nbytes() for s in (ref() for ref in seen) if s is not None}
    leaked = sum(n for key, n in alive.items() if key not in owned)
    assert probe.bytes()[0] > 1 << 20 and len(seen) > 50  # it counted a real micro-batch
    assert leaked == 0, f"{leaked} bytes saved for backward are still alive after the step"


def test_the_probe_reads_sizes_at_the_end_of_the_forward():
    cfg = config(training__precision="fp32", sets=NO_DROPOUT)
    model = build_model(cfg.model, 1, CPU, torch.float32).train()
    tokens = synthetic_batches(cfg, CPU)[0]
    probe = SavedTensorProbe(model)
    with probe.watch():
        loss = model(tokens[:, :-1], tokens[:, 1:])
    at_forward_end = probe.bytes()
    loss.backward()
    assert at_forward_end[0] > 0 and probe.bytes() == at_forward_end  # backward freed them; the count stays


# ----- 2. optimizer memory -----------------------------------------------------------------------
@pytest.mark.parametrize("precision, by_hand", [
    ("bf16", 2 + 4 + 4 + 8),  # 16-bit weights, fp32 main gradients, fp32 master weights, fp32 moments
    ("fp32", 4 + 4 + 8),      # weights, gradients, moments
])
def test_the_optimizer_holds_the_bytes_per_parameter_the_estimate_states(precision, by_hand):
    cfg = config(training__precision=precision, training__seq_length=32)
    model = build_model(cfg.model, 1, CPU, DTYPES[precision]).train()
    optimizer = make_optimizer(model, precision)
    batches = synthetic_batches(cfg, CPU)
    for step in range(2):
        for tokens in batches:
            (model(tokens[:, :-1], tokens[:, 1:]) / len(batches)).backward()
        if step == 0:  # Adam creates its state in the first step
            optimizer.step()
            model.zero_grad(set_to_none=True)
    # After the second step's backward, before its update: the most the optimizer ever holds.
    n = sum(p.numel() for p in model.parameters())
    held_per_parameter = held_bytes(model, optimizer) / n
    estimate = optimizer_bytes_per_parameter(cfg)
    assert held_per_parameter == by_hand
    assert held_per_parameter == sum(h.per_parameter for h in estimate)


def test_mixed_precision_accumulates_micro_batches_in_fp32_and_steps_adam():
    cfg = config(sets=NO_DROPOUT, training__seq_length=32, training__micro_batch_size=1, training__global_batch_size=4)
    model = build_model(cfg.model, 1, CPU, torch.bfloat16).train()
    reference = copy.deepcopy(model)
    start = [p.detach().float().clone() for p in model.parameters()]
    optimizer = make_optimizer(model, "bf16")
    batches = synthetic_batches(cfg, CPU)
    fp32_sum = [torch.zeros_like(p, dtype=torch.float32) for p in reference.parameters()]
    bf16_sum = [torch.zeros_like(p) for p in reference.parameters()]
    for tokens in batches:
        (model(tokens[:, :-1], tokens[:, 1:]) / len(batches)).backward()
        (reference(tokens[:, :-1], tokens[:, 1:]) / len(batches)).backward()
        for p, f, b in zip(reference.parameters(), fp32_sum, bf16_sum):
            f += p.grad.float()
            b += p.grad
            p.grad = None

    params = list(model.parameters())
    assert all(p.grad is None for p in params)  # no 16-bit gradient is kept
    # Tolerance 0: the same bf16 gradients summed in fp32 in the same order.
    assert all(torch.equal(p.main_grad, f) for p, f in zip(params, fp32_sum))
    # ... and that is a different number from a bf16 accumulation here, so the check can fail.
    assert any(not torch.equal(b.float(), f) for b, f in zip(bf16_sum, fp32_sum))

    optimizer.step()
    masters = [m.detach().clone().requires_grad_() for m in start]
    for m, f in zip(masters, fp32_sum):
        m.grad = f
    torch.optim.Adam(masters, lr=1e-4, foreach=False).step()
    # The fused kernel and torch's reference loop may round differently: 1e-6 relative (a few fp32
    # ulps) is far below an update of lr = 1e-4.
    for got, want in zip(optimizer.master_params, masters):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-9)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, optimizer.master_params))
    assert all(not p.main_grad.any() for p in params)  # zeroed for the next step


# ----- 3. no host reads inside a step ------------------------------------------------------------
class _HostReads(TorchDispatchMode):
    """Counts `aten._local_scalar_dense`, the op behind .item(), float() and bool() of a tensor: on
    CUDA each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_training_step_reads_nothing_back_to_the_host(precision):
    cfg = config(sets=NO_DROPOUT, training__precision=precision, training__seq_length=32,
                 training__micro_batch_size=1, training__global_batch_size=3)
    model = build_model(cfg.model, 1, CPU, DTYPES[precision]).train()
    batches = synthetic_batches(cfg, CPU)
    stepper = Stepper(cfg, model, make_optimizer(model, precision), batches)
    stepper.step()  # Adam's state exists from here on
    with torch.no_grad():
        expected = torch.stack([model(t[:, :-1], t[:, 1:]).float() for t in batches]).mean()
    with _HostReads() as reads:
        loss = stepper.step()
    assert reads.count == 0
    assert loss.dim() == 0 and loss.device == CPU
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)  # the mean over micro-batches, read once


# ----- 5. fp32 on CUDA runs on TF32 --------------------------------------------------------------
def test_fp32_on_cuda_uses_tf32_and_its_peak_and_the_record_says_so():
    from recompute_bench.measure.point import float32_matmul_precision
    from recompute_bench.measure.telemetry import uses_tf32

    assert uses_tf32("cuda", "fp32") and not uses_tf32("cuda", "bf16") and not uses_tf32("cpu", "fp32")
    before = torch.get_float32_matmul_precision()
    # The setting is process state, settable without a GPU; the context restores it.
    with float32_matmul_precision(torch.device("cuda"), "fp32") as tf32:
        assert tf32 and torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before
    with float32_matmul_precision(CPU, "fp32") as tf32:
        assert not tf32 and torch.get_float32_matmul_precision() == before
    # MFU divides by the dense TF32 tensor-core peak (datasheets: H100 SXM 989 TFLOP/s with
    # sparsity, A100 312 with sparsity; half without).
    assert peak("NVIDIA H100 80GB HBM3", "fp32") == ("H100 SXM tf32", 494.5e12)
    assert peak("NVIDIA A100-SXM4-80GB", "fp32") == ("A100 SXM tf32", 156e12)
    record = run_point(config(training__precision="fp32", training__seq_length=32,
                              sets=["training.warmup_steps=0", "training.measured_steps=1"]), device=CPU)
    assert record["status"] == "ok" and record["env"]["tf32"] is False


# ----- 7. offload --------------------------------------------------------------------------------
def _offload_run(offload: int, cfg):
    model = apply_recompute(build_model(cfg.model, 1), RecomputeConfig(activation_offload_layers=offload)).train()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 129), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)  # dropout masks
    return model, tokens


def test_offload_moves_the_layer_activations_and_no_parameter_and_changes_no_bit():
    cfg = config()  # dropout on
    base, tokens = _offload_run(0, cfg)
    probe = SavedTensorProbe(base)
    with probe.watch():
        loss0 = base(tokens[:, :-1], tokens[:, 1:])
    loss0.backward()
    layer_bytes = probe.bytes()[1] // cfg.model.num_layers  # four identical layers sharing no storage

    # The layers do save storages of parameters (the linears' weights): what offload must leave.
    params = _storage_keys([*base.parameters(), *base.buffers()])
    saved_params = set()

    def pack(t):
        if t.untyped_storage()._cdata in params:
            saved_params.add(t.untyped_storage()._cdata)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        base.layers[0](base.word_embeddings(tokens[:, :-1]) + base.position_embeddings.weight[:128])
    assert len(saved_params) >= 4

    model, _ = _offload_run(2, cfg)
    loss2 = model(tokens[:, :-1], tokens[:, 1:])
    loss2.backward()
    offloader = model.activation_offloader
    assert [offloader.packed_bytes(i) for i in range(2)] == [layer_bytes, layer_bytes]
    assert torch.equal(loss0, loss2)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(base.parameters(), model.parameters()))


def test_offloaded_layers_are_back_before_their_backward_starts():
    cfg = config()
    model, tokens = _offload_run(2, cfg)
    offloader = model.activation_offloader
    back_at_start = {}

    def record(index):
        def at_backward_start(_grad):
            back_at_start.setdefault(index, offloader.is_back(index))

        def hook(_module, _args, out):
            out.register_hook(at_backward_start)
        return hook

    for i in (0, 1):
        model.layers[i].register_forward_hook(record(i))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    # Layer 1 came back when layer 2's backward started, layer 0 during layer 1's backward.
    assert back_at_start == {1: True, 0: True}


# ----- 8. the sweep parent without torch, workers that die with it -------------------------------
# Finding torch (to read its version file) is allowed; running it is not.
BLOCK_TORCH = textwrap.dedent("""
    import importlib.machinery, sys
    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name != "torch" and not name.startswith("torch."):
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = self
            return spec
        def create_module(self, spec):
            return None
        def exec_module(self, module):
            raise ImportError("the sweep parent must not import torch")
    sys.meta_path.insert(0, NoTorch())
""")


def _run_without_torch(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)}
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_sweep_parent_launches_a_worker_and_names_the_gpu_without_torch(tmp_path):
    done = _run_without_torch("""
        import json, sys
        from pathlib import Path
        from recompute_bench.launch import process
        from recompute_bench.launch.devices import visible_gpu_name
        from recompute_bench.measure.telemetry import host_environment
        from recompute_bench.cli.common import this_gpu
        from recompute_bench.workload import resolve
        cfg, _ = resolve("tiny", gpu="cpu")
        env = host_environment("cpu", visible_gpu_name())
        # A worker that writes a record: the parent's side of a point that went well.
        process.WORKER_COMMAND = [sys.executable, "-c", "import json, sys; out = sys.argv[sys.argv.index('--out') + 1]; "
                                  "json.load(sys.stdin); open(out, 'w').write(json.dumps({'status': 'ok'}))"]
        record = process.run_isolated(cfg, name="p", out_path=Path("p.json"), log_path=Path("p.log"), timeout_s=60)
        print(json.dumps([record["status"], this_gpu(), env["torch_version"], "torch" in sys.modules]))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    status, gpu, torch_version, imported = json.loads(done.stdout)
    assert (status, gpu, torch_version, imported) == ("ok", "cpu", torch.__version__, False)


def test_the_whole_sweep_parent_path_imports_no_torch(tmp_path):
    done = _run_without_torch("""
        from recompute_bench.launch import sweep
        from recompute_bench.launch.process import failed_record
        from recompute_bench.workload import resolve
        cfg, _ = resolve("tiny", gpu="cpu")
        record = failed_record(cfg, "error", {"rank": 0, "step": None, "phase": None, "message": "x"})
        assert record["metrics"]["model_flops_per_step"] > 0 and record["env"]["device"] == "cpu"
    """, tmp_path)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--memory-gb", "80"], ["sweep", "--dry-run"]])
def test_commands_that_measure_nothing_run_without_torch(tmp_path, command):
    # The analysis is pure Python, and a sweep plans (and checks its plan) in the parent.
    done = _run_without_torch(f"""
        from recompute_bench.cli import main
        try:
            main({command!r})
        except SystemExit as e:
            assert e.code in (0, None), e.code
    """, tmp_path)
    assert done.returncode == 0, done.stderr


def test_workers_are_started_without_preexec_fn_in_their_own_session(tmp_path, monkeypatch):
    from recompute_bench.launch import process
    seen = {}

    class Stop(Exception):
        pass

    def popen(command, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        process.run_isolated(config(), name="p", out_path=tmp_path / "p.json", log_path=tmp_path / "p.log", timeout_s=1)
    # preexec_fn runs Python between fork and exec, unsafe once the sweep has threads.
    assert seen.get("preexec_fn") is None and seen["start_new_session"] is True
    from recompute_bench.launch.worker import PARENT_PID_ENV
    assert seen["env"][PARENT_PID_ENV] == str(os.getpid())  # whom the worker watches


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_a_worker_dies_soon_after_its_parent_is_killed(tmp_path):
    # The "sweep" starts a worker as run_isolated does; the worker then waits for its config on a
    # pipe the test holds open, so nothing but its own parent watch can end it.
    parent_code = textwrap.dedent(f"""
        import subprocess
        from recompute_bench.launch.process import WORKER_COMMAND, worker_env
        worker = subprocess.Popen(WORKER_COMMAND + ["--out", {str(tmp_path / "w.json")!r}], env=worker_env("w"),
                                  start_new_session=True)
        print(worker.pid, flush=True)
        worker.wait()
    """)
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdin=read_end, stdout=subprocess.PIPE, env=env)
    os.close(read_end)
    worker = int(parent.stdout.readline())
    try:
        # Let the worker reach its wait: a second thread is its parent watch (an old worker never
        # starts one; a parent killed before the watch starts is caught by the worker's first check).
        deadline = time.monotonic() + 10
        while _threads(worker) < 2 and not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _gone(worker), "the worker ended before its parent was killed"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), "the worker outlived its parent"
    finally:
        os.close(write_end)
        if not _gone(worker):
            os.killpg(worker, signal.SIGKILL)


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0
