"""Per-layer policies: their analysis against the closed forms and the probe, the `plan --auto`
solver against exhaustive search and against measured uniform settings, and the policy file."""

import dataclasses
import itertools
import json

import pytest

from conftest import config, invoke
from test_estimate import measure, shrunk
from recompute_bench.analysis import auto
from recompute_bench.analysis import flops
from recompute_bench.analysis import memory as E
from recompute_bench.models import spec_for
from recompute_bench.recompute.policy import LayerPolicy, layer_policies
from recompute_bench.recompute.settings import all_settings
from recompute_bench.results.records import key_fields, point_id
from recompute_bench.spec.config import RecomputeConfig

WORKLOADS = ["tiny", "llama3-8b"]  # tiny: GPT, 4 layers; llama3-8b shrunk to 3 layers (RMSNorm, SwiGLU, GQA, RoPE)
FAST = ["--set", "training.warmup_steps=0", "--set", "training.measured_steps=1"]


def fp32(workload, dropout=0.1):
    return shrunk(workload, **{"model.attention_backend": "math", "model.attention_dropout": dropout,
                               "model.hidden_dropout": dropout, "training.precision": "fp32"})


def running(cfg, policies):
    return dataclasses.replace(cfg, recompute=RecomputeConfig(layer_policy=[p.entry for p in policies]))


def outside_layers(cfg):
    """Activation bytes `run` measures outside the layers (tokens, embedding, loss)."""
    return E.activation_bytes(cfg, "cpu")["activation_bytes"] - E.stage_activations(cfg, "cpu").stored_bytes


def every_policy(cfg):
    """Every per-layer mix: each layer none, a selective subset or full, and every way to split the
    runs of full layers into chunks."""
    targets = spec_for(cfg.model).recompute_targets
    subsets = [LayerPolicy(modules=frozenset(c)) for n in range(len(targets) + 1) for c in itertools.combinations(targets, n)]
    for kinds in itertools.product([*subsets, "full"], repeat=cfg.model.num_layers):
        # a full layer after a full layer either continues its chunk or starts the next one
        joints = [i for i in range(1, len(kinds)) if kinds[i] == kinds[i - 1] == "full"]
        for new in itertools.product([False, True], repeat=len(joints)):
            starts = {i for i, s in zip(joints, new) if s}
            out, chunk = [], -1
            for i, k in enumerate(kinds):
                if k != "full":
                    out.append(k)
                    continue
                if i not in joints or i in starts:
                    chunk += 1
                out.append(LayerPolicy(chunk=chunk))
            yield out


def cost(cfg, policies):
    return (flops.policy_recompute_flops(cfg, policies, None, "cpu"), sum(len(p.modules) for p in policies)
            + sum((len(spec_for(cfg.model).recompute_targets) + 1) for p in policies if p.chunk is not None))


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_policy_analysis_equals_the_closed_forms_of_every_megatron_setting(workload):
    cfg = fp32(workload)
    n = cfg.model.num_layers
    for r in [RecomputeConfig(), RecomputeConfig(activation_offload_layers=2)] + all_settings(n):
        c = dataclasses.replace(cfg, recompute=r)
        closed, general = E.stage_activations(c, "cpu"), E.policy_activations(c, layer_policies(r, n), "cpu")
        assert (closed.stored_bytes, closed.peak_bytes) == (general.stored_bytes, general.peak_bytes), r.label
        as_policy = running(cfg, layer_policies(r, n))
        assert flops.hardware_flops_per_step(as_policy, "cpu") == flops.hardware_flops_per_step(c, "cpu"), r.label
        assert E.peak_rank_memory(as_policy, "cpu").peak_allocated_bytes == E.peak_rank_memory(c, "cpu").peak_allocated_bytes


def test_the_solver_reads_the_whole_rank_peak_as_the_rank_model_computes_it():
    for cfg in (config("llama3-8b", model__num_layers=8), config("llama3-70b", parallel__tensor_model_parallel_size=8,
                                                                 parallel__sequence_parallel=True,
                                                                 parallel__pipeline_model_parallel_size=4)):
        peak = auto.rank_peak(cfg, "cuda")
        layers = cfg.model.num_layers // cfg.parallel.pipeline_model_parallel_size
        for stored, top in ((0, 0), (1e9, 1e9), (3e9, 9e9), (2e10, 2e10)):
            acts = E.StageActivations(layers, stored, top)
            assert peak(acts) == pytest.approx(E.peak_rank_memory(cfg, "cuda", acts).peak_allocated_bytes, rel=1e-12)


MIXED = {"tiny": ["selective[layernorm,mlp]", "full:0", "full:0", "none"],
         "llama3-8b": ["full:0", "selective[core_attn,layernorm]", "selective[mlp]"]}


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout-off", "dropout-on"])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_a_mixed_policy_s_bytes_and_flops_are_what_the_probe_and_the_flop_counter_measure(workload, dropout):
    base = fp32(workload, dropout)
    cfg = dataclasses.replace(base, recompute=RecomputeConfig(layer_policy=MIXED[workload]))
    total, per_layer, measured_flops, _ = measure(cfg, count_flops=True)
    est = E.activation_bytes(cfg, "cpu")
    assert est["activation_bytes"] == total
    assert est["activation_bytes_per_layer"] == per_layer
    assert flops.hardware_flops_per_step(cfg, "cpu") == measured_flops


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_solver_is_optimal_against_exhaustive_search_over_every_per_layer_mix(workload):
    cfg = fp32(workload)
    policies = list(every_policy(cfg))
    acts = [E.policy_activations(cfg, p, "cpu") for p in policies]
    costs = [cost(cfg, p) for p in policies]
    peak = auto.rank_peak(dataclasses.replace(cfg, recompute=RecomputeConfig()), "cpu")
    lo, hi = min(peak(a) for a in acts), max(peak(a) for a in acts)
    for fraction in (0.0, 0.2, 0.45, 0.7, 1.0):
        budget = lo + fraction * (hi - lo)
        fits = [peak(a) <= budget for a in acts]
        best = min(c for c, f in zip(costs, fits) if f)
        solved = auto.solve(cfg, cfg.model.num_layers, lambda a: peak(a) <= budget, "cpu")
        assert peak(E.policy_activations(cfg, solved, "cpu")) <= budget
        assert cost(cfg, solved) == best, (fraction, [p.entry for p in solved])
    assert auto.solve(cfg, cfg.model.num_layers, lambda a: peak(a) < lo, "cpu") is None


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_solver_s_policy_run_for_real_fits_and_recomputes_no_more_than_any_fitting_uniform_setting(workload):
    cfg = fp32(workload)
    n = cfg.model.num_layers
    uniform = []
    for r in [RecomputeConfig()] + all_settings(n):
        total, _, measured_flops, _ = measure(dataclasses.replace(cfg, recompute=r), count_flops=True)
        uniform.append((r.label, total, measured_flops))
    outside = outside_layers(cfg)
    mixed_seen = False
    inner = sorted({t for _, t, _ in uniform})[1:-1]  # budgets strictly between the least and the most bytes
    for budget in [inner[len(inner) // 3], inner[2 * len(inner) // 3], (uniform[0][1] + uniform[1][1]) / 2]:
        solved = auto.solve(cfg, n, lambda a: outside + a.stored_bytes <= budget, "cpu")
        total, _, measured_flops, _ = measure(running(cfg, solved), count_flops=True)
        assert total <= budget
        fitting = [f for _, t, f in uniform if t <= budget]
        assert fitting and measured_flops <= min(fitting), (budget, [p.entry for p in solved])
        mixed_seen |= len({p.entry for p in solved}) > 1
    assert mixed_seen  # the budgets do make the solver mix choices, so the test can tell it from a uniform one


def test_plan_auto_writes_a_policy_that_run_measures_and_verify_proves(tmp_path):
    path = tmp_path / "tiny.toml"
    result = invoke("plan", "--auto", "-w", "tiny", "--device", "cpu", "--allowance-gb", "0", "--allowance-fraction", "0",
                    "--memory-gb", "0.0105", "--output", str(path), "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["predicted"]["device_bytes_needed"] <= 0.0105 * 2**30
    assert plan["uniform"] is not None and plan["predicted"]["hardware_flops_per_step"] <= plan["uniform"]["hardware_flops_per_step"]
    assert "uniform_setting" in path.read_text()
    run = invoke("run", "-w", "tiny", "--policy", str(path), *FAST, "--no-save", "--json", "--attention-backend", "math")
    assert run.exit_code == 0, run.output
    record = json.loads(run.stdout)
    assert record["recompute"]["layer_policy"] == plan["policy"]
    m = record["metrics"]
    assert m["activation_bytes"] == m["estimated_activation_bytes"]
    assert m["measured_flops_per_step"] == m["estimated_hardware_flops_per_step"] == plan["predicted"]["hardware_flops_per_step"]
    # A uniform setting's record is as before (no layer_policy key) and keeps its key and identity;
    # the policy's record is another point.
    older = json.loads(invoke("run", "-w", "tiny", *FAST, "--no-save", "--json").stdout)
    assert "layer_policy" not in older["recompute"]
    explicit = {**older, "recompute": {**older["recompute"], "layer_policy": []}}
    assert key_fields(explicit) == key_fields(older) and point_id(explicit) == point_id(older)
    assert key_fields(record)["layer_policy"] == "+".join(plan["policy"])
    assert point_id(record) != point_id(older)


def test_verify_proves_a_policy_where_every_layer_differs(tmp_path):
    path = tmp_path / "mixed.toml"
    path.write_text('schema = "recompute-bench/policy/v1"\nworkload = "tiny"\nnum_layers = 4\n'
                    'layers = ["none", "selective[core_attn]", "selective[layernorm,mlp]", "full:0"]\n')
    result = invoke("verify", "-w", "tiny", "--policy", str(path))
    assert result.exit_code == 0, result.output
    assert "all 2 settings leave the loss and every gradient bitwise equal" in result.stderr


def test_plan_auto_says_when_nothing_fits_and_what_would(tmp_path):
    result = invoke("plan", "--auto", "-w", "llama3-8b", "--num-layers", "8", "--memory-gb", "20",
                    "--output", str(tmp_path / "p.toml"))
    assert result.exit_code == 1
    assert "nothing fits" in result.stderr and "what would fit" in result.stderr
    assert not (tmp_path / "p.toml").exists()


BAD = {
    "unknown module": ('layers = ["selective[attn]", "none", "none", "none"]', "unknown module 'attn'"),
    "wrong layer count": ('layers = ["none", "none"]', "lists 2 layers but tiny has 4"),
    "module the model lacks": ('layers = ["selective[moe]", "none", "none", "none"]', "has no moe"),
    "malformed entry": ('layers = ["half", "none", "none", "none"]', "is not none, offload"),
    "split chunk": ('layers = ["full:0", "none", "full:0", "none"]', "full:0 is split"),
    "malformed toml": ('layers = ["none", ', "is not valid TOML"),
}


@pytest.mark.parametrize("problem", list(BAD))
@pytest.mark.parametrize("command", ["run", "verify"])
def test_a_bad_policy_file_is_one_line_and_exit_2(tmp_path, command, problem):
    body, needle = BAD[problem]
    path = tmp_path / "bad.toml"
    path.write_text(f'schema = "recompute-bench/policy/v1"\nworkload = "tiny"\nnum_layers = 4\n{body}\n')
    result = invoke(command, "-w", "tiny", "--policy", str(path))
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_policy_and_recompute_flags_together_are_refused(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('schema = "recompute-bench/policy/v1"\nlayers = ["none", "none", "none", "none"]\n')
    result = invoke("run", "-w", "tiny", "--policy", str(path), "--recompute-granularity", "selective",
                    "--recompute-modules", "mlp")
    assert result.exit_code == 2 and "--policy replaces" in result.stderr


def test_the_solver_and_the_policy_file_import_no_torch():
    import subprocess
    import sys
    code = ("import sys, recompute_bench.analysis.auto, recompute_bench.recompute.policy_file; "
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_sweep_adds_the_auto_point_and_measures_it(tmp_path):
    result = invoke("sweep", "-w", "tiny", "--baseline", "--policy", "auto", "--memory-gb", "0.0105", "--no-golden",
                    "--results-dir", str(tmp_path), "--run-id", "auto", "--attention-backend", "math", *FAST)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "auto" / "results.jsonl").read_text().splitlines()]
    auto_record = next(r for r in records if r["point"]["name"] == "Auto")
    assert auto_record["status"] == "ok" and auto_record["recompute"]["layer_policy"]
    m = auto_record["metrics"]
    assert m["activation_bytes"] == m["estimated_activation_bytes"]
    assert m["measured_flops_per_step"] == m["estimated_hardware_flops_per_step"]
    assert m["estimated_peak_allocated_bytes"] <= 0.0105 * 2**30
