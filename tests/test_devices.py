"""Which device a process measures on, proven without a GPU: `torch.cuda` and NVML replaced by fakes
that remember what was asked of them. `cuda:N` becomes the current device and every timing event is
recorded on its stream; more ranks than GPUs is bad input found before launch; the CPU tests stay on
the CPU on a machine that has a GPU; `run --no-save` leaves no scratch behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from helpers import CPU, FAST, config, invoke, measure
from recompute_bench.launch import devices
from recompute_bench.launch.process import worker_env
from recompute_bench.measure import point
from recompute_bench.measure.point import pick_device
from recompute_bench.measure.timing import timed

SETS = [a for s in FAST for a in ("--set", s)]


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as a machine with GPUs shows it, for what device selection and timing call: each
    event recorded is 2 ms after the one before (`clock`); `waits` lists the host's waits for the
    device (a synchronize, an event's or the whole device's) and reads of an event's time."""
    state = types.SimpleNamespace(current=0, set=[], streams=[], clock=0.0, waits=[])

    def stream(device=None):
        index = torch.device(device).index if device is not None else None
        return f"stream of cuda:{state.current if index is None else index}"

    class Event:
        def __init__(self, enable_timing=False):
            self.stream = None

        def record(self, stream_=None):
            self.stream = stream_ if stream_ is not None else stream()  # torch: the current device's stream
            state.streams.append(self.stream)
            self.ms, state.clock = state.clock, state.clock + 2.0

        def synchronize(self):
            state.waits.append("event.synchronize")

        def elapsed_time(self, other):
            state.waits.append("elapsed_time")
            return other.ms - self.ms

    def set_device(device):
        state.current = torch.device(device).index
        state.set.append(state.current)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.current)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_stream", stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: state.waits.append("cuda.synchronize"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # the workspaces' size
    return state


def test_cuda_n_becomes_the_current_device(fake_cuda):
    assert pick_device("cuda:1") == torch.device("cuda", 1) and fake_cuda.current == 1
    assert pick_device("cuda") == torch.device("cuda", 1)  # "cuda" is the current GPU, named by its index
    assert pick_device(None) == torch.device("cuda", 1)
    assert pick_device("cpu") == CPU


def test_run_point_on_cuda_n_makes_it_current_before_anything_runs(fake_cuda, monkeypatch):
    seen = []

    def measured(cfg, device, *_):
        seen.append((device, fake_cuda.current))
        raise KeyboardInterrupt  # stop here: what ran so far is what this test is about

    monkeypatch.setattr(point, "_measure", measured)
    with pytest.raises(KeyboardInterrupt):
        point.run_point(config(), device=torch.device("cuda", 1))
    assert seen == [(torch.device("cuda", 1), 1)]


def test_a_step_on_cuda_n_is_timed_on_its_stream(fake_cuda):
    # The current device is still 0 (nothing set it): the events must say which stream they time.
    assert timed(torch.device("cuda", 1), lambda: None) == 2e-3
    assert fake_cuda.streams == ["stream of cuda:1", "stream of cuda:1"]


def test_the_profilers_spans_are_timed_on_the_devices_stream(fake_cuda):
    from recompute_bench.measure.profile import _Spans

    spans = _Spans(torch.device("cuda", 1))
    layer = torch.nn.Linear(2, 2)
    handles = spans.hook("layer", layer)
    layer(torch.ones(1, 2))
    for h in handles:
        h.remove()
    assert fake_cuda.streams == ["stream of cuda:1", "stream of cuda:1"] and spans.take() == {"layer": 2e-3}


def test_a_pipeline_step_times_its_actions_by_events_and_waits_for_nothing_inside(fake_cuda):
    # The schedule runs three actions (forward, backward, loss) between the step's own marks. Each
    # is bracketed by events on cuda:1's stream; nothing waits for the device inside the step (a
    # synchronize per action serialised the pipeline and biased the bubble); the times are read
    # once the step is over: 3 actions of 2 ms in a schedule span of 14 ms.
    from recompute_bench.measure.pipeline_step import PipelineStepper

    stepper = object.__new__(PipelineStepper)

    class Schedule:
        def step(self, *args, target=None, losses=None, return_outputs=True):
            for _ in range(3):
                with stepper._timed():
                    pass
            losses.append(torch.tensor(1.0))

    stepper.__dict__.update(
        layout=types.SimpleNamespace(first=True, last=True, sum_tied_embedding=lambda model: None),
        schedule=Schedule(), device=torch.device("cuda", 1), batches=torch.zeros(1, 1, 5, dtype=torch.long),
        optimizer=types.SimpleNamespace(step=lambda: None), model=torch.nn.Linear(1, 1), fault=None,
        step_index=0, phase="setup", probe=None, spans=[], _actions=[])
    stepper.step()
    assert fake_cuda.waits == [] and fake_cuda.streams == ["stream of cuda:1"] * 8
    fields = stepper.fields([0.020])
    assert fields["compute_times_s"] == [pytest.approx(0.006)] and fields["schedule_times_s"] == [pytest.approx(0.014)]
    assert fields["bubble_fraction"] == pytest.approx(1 - 6 / 14)
    assert "cuda.synchronize" not in fake_cuda.waits


# ----- more ranks than GPUs --------------------------------------------------------------------------
@pytest.fixture
def one_gpu(monkeypatch):
    """NVML as a machine with one H100 shows it, and a torch built with CUDA; no CUDA_VISIBLE_DEVICES."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 1

    def handle(index):
        if index >= 1:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return index

    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(devices, "torch_build", lambda: ("2.13.0", "12.8"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    devices_seen = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: devices_seen.append("a CUDA context"))
    return devices_seen


@pytest.mark.parametrize("args, words", [
    (["--nproc-per-node", "2"], "--nproc-per-node 2 needs one GPU per rank and this node shows 1; pass --nproc-per-node 1"),
    (["--device", "cuda:1"], "this machine shows 1 GPU(s), cuda:0 to cuda:0; pass --device cuda:0"),
])
def test_more_ranks_than_gpus_is_one_line_exit_2_before_launch(tmp_path, one_gpu, args, words):
    for command in ("run", "sweep"):
        result = invoke(command, *args, "--results" if command == "run" else "--results-dir", str(tmp_path / command), *SETS)
        assert result.exit_code == 2 and words in " ".join(result.stderr.split()), result.output
        assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / command).exists()  # nothing launched, nothing written
    assert one_gpu == []  # the check asked NVML, not CUDA


def test_cuda_visible_devices_counts_as_cuda_does(one_gpu, monkeypatch):
    assert devices.visible_gpu_count() == 1
    for value, count in (("0", 1), ("0,1", 1), ("1,0", 0), ("", 0), ("-1", 0)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert devices.visible_gpu_count() == count, value


# ----- the CPU tests stay on the CPU -----------------------------------------------------------------
@pytest.mark.slow
def test_cpu_tests_measure_on_the_cpu_where_torch_sees_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and worker_env("p")["CUDA_VISIBLE_DEVICES"] == ""
    # a process this test starts finds no GPU, whatever the machine has
    code = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], env=worker_env("p"), capture_output=True, text=True).stdout
    assert out.split() == ["False", "0"]
    assert devices.default_device_type() == "cpu"
    assert measure(config(sets=FAST))["env"]["device"] == "cpu"
    result = invoke("run", "--no-save", "--json", *SETS)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["env"]["device"] == "cpu"


@pytest.mark.slow
def test_run_no_save_leaves_no_scratch_in_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("run", "--nproc-per-node", "2", "--no-save", *SETS, "--set", "model.hidden_dropout=0",
                    "--set", "model.attention_dropout=0")
    assert result.exit_code == 0, result.output
    assert list(tmp_path.iterdir()) == []


# ----- verify on CUDA ------------------------------------------------------------------------------
def test_verify_on_cuda_runs_torchs_deterministic_kernels_and_says_so(monkeypatch):
    from recompute_bench.measure import verify as verify_module
    from recompute_bench.config.schema import RecomputeConfig

    seen = []

    def loss_and_grads(cfg, recompute, tokens, device):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                     os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return torch.zeros(()), {"w": torch.ones(2)}

    monkeypatch.setattr(verify_module, "loss_and_grads", loss_and_grads)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        full = RecomputeConfig("full", method="uniform", num_layers=1)
        outcomes = verify_module.verify(config(), [full], ["sdpa"], torch.device("cuda", 0))
        # not warn-only: only then does torch run flash's deterministic backward (attention_backward.cu)
        assert seen == [(True, False, ":4096:8")] * 2 and outcomes[0].exact
        assert not torch.are_deterministic_algorithms_enabled()  # restored
        seen.clear()
        verify_module.verify(config(), [full], ["sdpa"], CPU)
        assert [s[:2] for s in seen] == [(False, False)] * 2  # a CPU's fp32 kernels need nothing
    finally:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    assert "torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8" in verify_module.determinism("cuda")


def test_verify_output_says_how_equal_bits_are_made(tmp_path):
    result = invoke("verify", "--seq-length", "16", "--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1", "--attention-backend", "math", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["determinism"] == "cpu: its fp32 kernels are deterministic"
    assert "its fp32 kernels are deterministic" in " ".join(result.stderr.split())


# ----- the peak MFU divides by, and DDP's buffers ------------------------------------------------------
def test_the_record_says_which_peak_its_mfu_divides_by(monkeypatch):
    record = measure(config(sets=FAST), peak_tflops=100.0)
    m = record["metrics"]
    assert (m["peak_source"], m["peak_tflops"]) == ("--peak-tflops", 100.0)
    assert m["mfu"] == pytest.approx(m["model_flops_per_step"] / m["step_time_s"] / 100e12)
    monkeypatch.setattr(point, "device_name", lambda device: "NVIDIA H100 NVL")  # as CUDA names that card
    m = measure(config(sets=FAST))["metrics"]
    assert (m["peak_source"], m["peak_tflops"]) == ("H100 NVL bf16", 835.5)
    assert m["mfu"] == pytest.approx(m["model_flops_per_step"] / m["step_time_s"] / 835.5e12)
    m = measure(config(sets=FAST, training__precision="fp32"))["metrics"]
    assert (m["peak_source"], m["peak_tflops"]) == ("H100 NVL tf32", 417.5)


def test_rates_are_the_formulas_over_the_median_step_time(monkeypatch):
    # A fake timer: the three measured steps "take" 0.3, 0.5 and 0.2 s, so the median is 0.3 s and
    # every rate follows from it by hand: FLOPs / 0.3 s / 1 rank, over a 2 TFLOP/s peak.
    times = [0.3, 0.5, 0.2]

    def timed(device, fn, barrier=lambda: None):
        fn()
        return times.pop(0)

    monkeypatch.setattr(point, "timed", timed)
    cfg = config(sets=["training.warmup_steps=0", "training.measured_steps=3"])
    m = measure(cfg, peak_tflops=2.0)["metrics"]
    assert m["step_times_s"] == [0.3, 0.5, 0.2] and m["step_time_s"] == 0.3
    assert m["tflops_per_gpu"] == pytest.approx(m["model_flops_per_step"] / 0.3 / 1e12)
    assert m["tokens_per_s_per_gpu"] == pytest.approx(cfg.training.global_batch_size * cfg.training.seq_length / 0.3)
    assert m["mfu"] == pytest.approx(m["model_flops_per_step"] / 0.3 / 2e12)
    assert m["hfu"] == pytest.approx(m["hardware_flops_per_step"] / 0.3 / 2e12)
    assert m["hfu"] > m["mfu"]  # the hardware count adds what the model formula leaves out (the full causal square on CPU)


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def nccl_like_group():
    """A one-rank gloo group mapped, as an NCCL group is, for CUDA tensors only."""
    import torch.distributed as dist
    dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("layout_kind", ["pipeline", "context parallel"])
def test_world_flops_summed_over_ranks_are_summed_on_the_ranks_device(nccl_like_group, monkeypatch, layout_kind):
    # Every pipeline point on CUDA used to end in "No backend type associated with device type cpu"
    # right after its probe step: the FLOPs were all-reduced as a CPU tensor; a context-parallel
    # point (its ranks' FLOPs differ too) had the same sum. Here CUDA tensors are torch's fake
    # tensors (shapes and devices, no data), so the sum itself cannot be read.
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
    from recompute_bench.measure.data_parallel import DataParallel
    from recompute_bench.measure.pipeline import PipelineParallel

    # their meshes need CUDA; world_flops needs only the device (and, data parallel, its context)
    layout = object.__new__(PipelineParallel if layout_kind == "pipeline" else DataParallel)
    layout.device_type = "cuda"
    layout.context = object()
    seen = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device.type) or real(t, *a, **k))
    with FakeTensorMode(), pytest.raises(DataDependentOutputException):  # the collective went through
        layout.world_flops(10**12)
    assert seen == ["cuda"]


def test_bucketed_grads_reduce_each_bucket_once_as_its_last_gradient_arrives(one_rank_group, monkeypatch):
    # Megatron's overlap (measure.data_parallel.BucketedGrads): a micro-batch under no_sync only
    # accumulates; on the one that synchronises, each bucket's all-reduce starts as soon as its
    # parameters' gradients are in, while the backward still runs, once per bucket; the buffer ends
    # as the sum over the micro-batches times 1/dp (a one-rank group adds nothing to it).
    import copy

    import torch.distributed as dist
    from recompute_bench.measure.data_parallel import BucketedGrads

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                              torch.nn.Linear(4, 4))
    alone = copy.deepcopy(net)
    params = list(net.parameters())  # w0 b0 w1 b1 w2 b2: buckets of 20 parameters in backward order
    grads = BucketedGrads(params[::-1], [dist.group.WORLD] * len(params), dp_size=2, bucket_parameters=20)
    assert [b[0] for b in grads.buckets] == [slice(0, 20), slice(20, 40), slice(40, 60)]
    events = []
    names = {id(p): n for n, p in net.named_parameters()}
    for p in params:  # after MainGrads' own hook: the gradient is in the main gradient by then
        p.register_post_accumulate_grad_hook(lambda p: events.append(f"in {names[id(p)]}"))
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: events.append(f"reduce {t.numel()}") or real(t, *a, **k))
    batches = torch.randn(2, 3, 4)
    with grads.no_sync():
        net(batches[0]).square().sum().backward()
    assert not any(e.startswith("reduce") for e in events)  # accumulated, not reduced
    events.clear()
    net(batches[1]).square().sum().backward()
    grads.finish()
    assert [e for e in events if e.startswith("reduce")] == ["reduce 20"] * 3
    assert events.index("reduce 20") < events.index("in 0.weight")  # the first bucket went while layer 0 ran backward
    for x in batches:
        alone(x).square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), alone.parameters()):
        assert torch.allclose(p.main_grad, q.grad / 2), name


def test_allocator_retries_and_ooms_are_the_measured_windows(fake_cuda, monkeypatch):
    # The point runs its steps on the CPU while torch.cuda is a fake allocator whose counters grow
    # from the process's start: each step retries one allocation, the probe step also meets one OOM.
    # The record's counts are the measured window's, as its peaks are; not the build's, probe's and
    # warm-up's added in.
    from recompute_bench.measure.layout import SingleRank
    from recompute_bench.measure.point import _measure
    from recompute_bench.measure.step import Stepper, synthetic_batches

    counters = {"num_alloc_retries": 0, "num_ooms": 0}

    class CountingStepper(Stepper):
        def step(self, probe=None):
            counters["num_alloc_retries"] += 1
            counters["num_ooms"] += self.step_index == 0
            return super().step(probe)

    class OnTheCpu(SingleRank):
        def build(self, cfg, device, dtype=None):
            return super().build(cfg, CPU, dtype)

        def batches(self, cfg, device):
            return synthetic_batches(cfg, CPU)

        def stepper(self, cfg, model, optimizer, batches):
            return CountingStepper(cfg, model, optimizer, batches)

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(counters))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda device=None: counters.update(
        num_alloc_retries=0, num_ooms=0))
    cfg = config(sets=["training.warmup_steps=2", "training.measured_steps=3"])
    _, rank = _measure(cfg, torch.device("cuda", 0), None, OnTheCpu(), lambda *_: None, {})
    assert rank["status"] == "ok", rank["failure"]
    assert len(rank["step_times_s"]) == 3
    assert (rank["alloc_retries"], rank["num_ooms"]) == (3, 0)  # the 3 measured steps' retries, no OOM among them


def test_the_runs_peak_is_the_larger_of_before_and_during_the_measured_window(monkeypatch):
    # A fake allocator: the build and warm-up peak at 5 / 8 bytes (allocated / reserved); the window
    # starts from a reset and peaks at 3 / 2. The window's figures are its own, the run's the larger.
    from recompute_bench.measure import memory

    peaks = {"allocated": 5, "reserved": 8}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peaks["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peaks["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peaks.update(allocated=0, reserved=0))
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda device=None: None)
    gpu = torch.device("cuda", 0)
    run_peak = memory.open_window(gpu)
    assert (run_peak["peak_allocated_bytes"], run_peak["peak_reserved_bytes"]) == (5, 8) and peaks == {"allocated": 0, "reserved": 0}
    peaks.update(allocated=3, reserved=2)
    window = memory.close_window(gpu, run_peak)
    assert (window["peak_allocated_bytes"], window["peak_reserved_bytes"]) == (3, 2)
    assert (window["run_peak_allocated_bytes"], window["run_peak_reserved_bytes"]) == (5, 8)
    # A CPU measures none of it: None, never zero, and no run peak.
    assert memory.close_window(CPU, memory.open_window(CPU)) == {
        "peak_allocated_bytes": None, "peak_reserved_bytes": None, "alloc_retries": None, "num_ooms": None}
    assert memory.current(CPU) == {}
