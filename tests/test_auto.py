"""Per-layer policies: their analysis against the closed forms and the probe, the `plan --auto`
solver against exhaustive search and against measured uniform settings, and the policy file."""

import dataclasses
import itertools
import json

import pytest
import torch
from helpers import config, invoke, probe, probe_step, shrunk

from recompute_bench.analysis import flops
from recompute_bench.analysis.allowance import device_bytes_needed
from recompute_bench.analysis.checkpoint import checkpoint_input_bytes
from recompute_bench.analysis.harness import auto
from recompute_bench.analysis.harness.layer import layer_activation_bytes
from recompute_bench.analysis.harness.profile_costs import ProfileCosts
from recompute_bench.analysis.harness.rank import peak_rank_memory, rank_memory, stage_memories
from recompute_bench.analysis.harness.stage import (StageActivations, activation_bytes, policy_activations,
                                                    stage_activations)
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.models import kind_config, spec_for
from recompute_bench.recompute.policy import LayerPolicy, layer_policies, megatron_flags, megatron_setting, parse_entry
from recompute_bench.recompute.policy_file import check, read_policy
from recompute_bench.recompute.settings import all_settings
from recompute_bench.results.rows import key_fields, point_id
from recompute_bench.workload import resolved

WORKLOADS = ["tiny", "llama3-8b"]  # tiny: GPT, 4 layers; llama3-8b shrunk to 3 layers (RMSNorm, SwiGLU, GQA, RoPE)
FAST = ["--set", "training.warmup_steps=0", "--set", "training.measured_steps=1"]


def fp32(workload, dropout=0.1):
    return shrunk(workload, **{"model.attention_backend": "math", "model.attention_dropout": dropout,
                               "model.hidden_dropout": dropout, "training.precision": "fp32"})


def running(cfg, policies):
    return dataclasses.replace(cfg, recompute=RecomputeConfig(layer_policy=[p.entry for p in policies]))


def outside_layers(cfg):
    """Activation bytes `run` measures outside the layers (tokens, embedding, loss)."""
    return activation_bytes(cfg, "cpu")["activation_bytes"] - stage_activations(cfg, "cpu").stored_bytes


def every_policy(cfg):
    """Every per-layer mix: each layer none, a selective subset or full, and every way to split the
    runs of full layers into chunks."""
    targets = spec_for(cfg.model).recompute_targets
    subsets = [LayerPolicy(modules=frozenset(c)) for n in range(len(targets) + 1) for c in itertools.combinations(targets, n)]
    return mixes([[*subsets, "full"]] * cfg.model.num_layers)


def mixes(per_layer):
    """Every policy taking one of each layer's choices ("full": checkpointed whole), with every way
    to split the runs of full layers into chunks."""
    for kinds in itertools.product(*per_layer):
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
        closed, general = stage_activations(c, "cpu"), policy_activations(c, layer_policies(r, n), "cpu")
        assert (closed.stored_bytes, closed.peak_bytes) == (general.stored_bytes, general.peak_bytes), r.label
        as_policy = running(cfg, layer_policies(r, n))
        assert flops.hardware_flops_per_step(as_policy, "cpu") == flops.hardware_flops_per_step(c, "cpu"), r.label
        assert peak_rank_memory(as_policy, "cpu").peak_allocated_bytes == peak_rank_memory(c, "cpu").peak_allocated_bytes


def test_the_solver_reads_each_stage_s_whole_rank_peak_as_the_rank_model_computes_it():
    for cfg in (config("llama3-8b", model__num_layers=8), config("llama3-70b", parallel__tensor_model_parallel_size=8,
                                                                 parallel__sequence_parallel=True,
                                                                 parallel__pipeline_model_parallel_size=4)):
        peaks = auto.stage_peaks(cfg, "cuda")
        assert len(peaks) == cfg.parallel.pipeline_model_parallel_size
        layers = cfg.model.num_layers // cfg.parallel.pipeline_model_parallel_size
        for stored, top in ((0, 0), (1e9, 1e9), (3e9, 9e9), (2e10, 2e10)):
            acts = StageActivations(layers, stored, top)
            for stage, peak in enumerate(peaks):
                assert peak(acts) == pytest.approx(rank_memory(cfg, stage, "cuda", acts).peak_allocated_bytes, rel=1e-12)


MIXED = {"tiny": ["selective[layernorm,mlp]", "full:0", "full:0", "none"],
         "llama3-8b": ["full:0", "selective[core_attn,layernorm]", "selective[mlp]"]}


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout-off", "dropout-on"])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_a_mixed_policy_s_bytes_and_flops_are_what_the_probe_and_the_flop_counter_measure(workload, dropout):
    base = fp32(workload, dropout)
    cfg = dataclasses.replace(base, recompute=RecomputeConfig(layer_policy=MIXED[workload]))
    total, per_layer, measured_flops, _ = probe_step(cfg, count_flops=True)
    est = activation_bytes(cfg, "cpu")
    assert est["activation_bytes"] == total
    assert est["activation_bytes_per_layer"] == per_layer
    assert flops.hardware_flops_per_step(cfg, "cpu") == measured_flops


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_solver_is_optimal_against_exhaustive_search_over_every_per_layer_mix(workload):
    cfg = fp32(workload)
    policies = list(every_policy(cfg))
    acts = [policy_activations(cfg, p, "cpu") for p in policies]
    costs = [cost(cfg, p) for p in policies]
    peak, = auto.stage_peaks(dataclasses.replace(cfg, recompute=RecomputeConfig()), "cpu")
    lo, hi = min(peak(a) for a in acts), max(peak(a) for a in acts)
    for fraction in (0.0, 0.2, 0.45, 0.7, 1.0):
        budget = lo + fraction * (hi - lo)
        fits = [peak(a) <= budget for a in acts]
        best = min(c for c, f in zip(costs, fits) if f)
        solved = auto.solve(cfg, cfg.model.num_layers, lambda a: peak(a) <= budget, "cpu")
        assert peak(policy_activations(cfg, solved, "cpu")) <= budget
        assert cost(cfg, solved) == best, (fraction, [p.entry for p in solved])
    assert auto.solve(cfg, cfg.model.num_layers, lambda a: peak(a) < lo, "cpu") is None


@pytest.mark.slow
@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_solver_s_policy_run_for_real_fits_and_recomputes_no_more_than_any_fitting_uniform_setting(workload):
    cfg = fp32(workload)
    n = cfg.model.num_layers
    uniform = []
    for r in [RecomputeConfig()] + all_settings(n):
        total, _, measured_flops, _ = probe_step(dataclasses.replace(cfg, recompute=r), count_flops=True)
        uniform.append((r.label, total, measured_flops))
    outside = outside_layers(cfg)
    mixed_seen = False
    inner = sorted({t for _, t, _ in uniform})[1:-1]  # budgets strictly between the least and the most bytes
    for budget in [inner[len(inner) // 3], inner[2 * len(inner) // 3], (uniform[0][1] + uniform[1][1]) / 2]:
        solved = auto.solve(cfg, n, lambda a: outside + a.stored_bytes <= budget, "cpu")
        total, _, measured_flops, _ = probe_step(running(cfg, solved), count_flops=True)
        assert total <= budget
        fitting = [f for _, t, f in uniform if t <= budget]
        assert fitting and measured_flops <= min(fitting), (budget, [p.entry for p in solved])
        mixed_seen |= len({p.entry for p in solved}) > 1
    assert mixed_seen  # the budgets do make the solver mix choices, so the test can tell it from a uniform one


@pytest.mark.slow
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
RUN_ONLY = {"offload on a CPU": ('layers = ["offload", "none", "selective[mlp]", "full:0"]', "write none for the policy's offload")}


@pytest.mark.parametrize("command,problem", [(c, p) for c in ("run", "verify") for p in BAD] + [("run", p) for p in RUN_ONLY])
def test_a_bad_policy_file_is_one_line_and_exit_2(tmp_path, command, problem):
    body, needle = {**BAD, **RUN_ONLY}[problem]
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
    code = ("import sys, recompute_bench.analysis.harness.auto, recompute_bench.recompute.policy_file; "
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
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


# ----- layers of two kinds: tiny-moe with a MoE layer every second layer (MoE, dense, MoE, dense) ------

def moe_freq2(**overrides):  # one micro-batch of 2 per step, as the probe runs
    return config("tiny-moe", model__num_layers=4, model__moe_layer_freq=2, training__global_batch_size=2, **overrides)


def kind_tables(cfg):
    """Per layer kind: bytes kept and recompute FLOPs of every selective subset of its targets, and
    of the whole layer (the reference the exhaustive search adds up, independent of the solver)."""
    targets = spec_for(cfg.model).recompute_targets
    kinds = {}
    for kind, index in (("moe", 0), ("dense", 1)):
        mods = [m for m in targets if (m != "mlp" if kind == "moe" else m not in ("moe", "moe_act", "shared_experts"))]
        c = kind_config(cfg, kind)
        subsets = [frozenset(x) for n in range(len(mods) + 1) for x in itertools.combinations(mods, n)]
        kinds[kind] = {s: (layer_activation_bytes(c, s, "cpu"),
                           flops.policy_recompute_flops(cfg, [LayerPolicy(modules=s)], None, "cpu", first=index))
                       for s in subsets}
        kinds[kind][None] = (layer_activation_bytes(c, (), "cpu"),
                             flops.policy_recompute_flops(cfg, [LayerPolicy(chunk=0)], None, "cpu", first=index))
    return kinds


def reference(cfg, tables, policy):
    """(stored, backward peak, recompute FLOPs, modules) of a per-layer policy from the tables."""
    kinds = ["moe" if cfg.model.is_moe_layer(i) else "dense" for i in range(len(policy))]
    ckpt = checkpoint_input_bytes(cfg)
    stored = peak = work = 0.0
    mods = 0
    i = 0
    while i < len(policy):
        p = policy[i]
        if p.chunk is None:
            nbytes, f = tables[kinds[i]][p.modules]
            stored, work, mods, i = stored + nbytes, work + f, mods + len(p.modules), i + 1
            continue
        j = i
        while j < len(policy) and policy[j].chunk == p.chunk:
            j += 1
        peak = max(peak, stored + sum(tables[kinds[k]][None][0] for k in range(i, j)))
        work += sum(tables[kinds[k]][None][1] for k in range(i, j))
        mods += (j - i) * (len(spec_for(cfg.model).recompute_targets) + 1)
        stored += ckpt
        i = j
    return stored, max(peak, stored), work, mods


def every_kind_policy(cfg, tables):
    """Every per-layer mix where each layer takes a choice its kind has (or full, chunked every way)."""
    kinds = ["moe" if cfg.model.is_moe_layer(i) else "dense" for i in range(cfg.model.num_layers)]
    per_layer = [[LayerPolicy(modules=s) for s in tables[k] if s is not None] + ["full"] for k in kinds]
    return mixes(per_layer)


def test_on_dense_and_moe_layers_the_solver_is_optimal_against_every_per_layer_mix():
    cfg = moe_freq2(training__precision="fp32")
    tables = kind_tables(cfg)
    policies = list(every_kind_policy(cfg, tables))
    refs = [reference(cfg, tables, p) for p in policies]
    for p, r in zip(policies[::997], refs[::997]):  # the reference adds up as the analysis does
        acts = policy_activations(cfg, p, "cpu")
        assert (acts.stored_bytes, acts.peak_bytes, flops.policy_recompute_flops(cfg, p, None, "cpu")) == r[:3]
    assert tables["moe"][frozenset()][0] != tables["dense"][frozenset()][0]  # the kinds do differ
    peak, = auto.stage_peaks(dataclasses.replace(cfg, recompute=RecomputeConfig()), "cpu")
    needs = [peak(StageActivations(4, r[0], r[1])) for r in refs]
    lo, hi = min(needs), max(needs)
    for fraction in (0.0, 0.15, 0.4, 0.7, 1.0):
        budget = lo + fraction * (hi - lo)
        best = min((r[2], r[3]) for r, n in zip(refs, needs) if n <= budget)
        solved = auto.solve(cfg, 4, lambda a: peak(a) <= budget, "cpu")
        got = reference(cfg, tables, solved)
        assert peak(StageActivations(4, got[0], got[1])) <= budget
        assert (got[2], got[3]) == best, (fraction, [p.entry for p in solved])
        for i, p in enumerate(solved):  # MoE modules on MoE layers only, mlp on dense layers only
            assert not p.modules & ({"mlp"} if i % 2 == 0 else {"moe", "moe_act", "shared_experts"})


def test_on_dense_and_moe_layers_the_policy_run_for_real_fits_and_beats_every_fitting_uniform_setting():
    cfg = moe_freq2()
    n = cfg.model.num_layers
    # Uniform settings by the analysis (exact to the byte and FLOP against the probe for every MoE
    # setting: test_moe.py); the best fitting one and the solver's policy are measured here.
    uniform = [(r, activation_bytes(c := dataclasses.replace(cfg, recompute=r), "cpu")["activation_bytes"],
                flops.hardware_flops_per_step(c, "cpu")) for r in [RecomputeConfig()] + all_settings(n)]
    outside = activation_bytes(cfg, "cpu")["activation_bytes"] - stage_activations(cfg, "cpu").stored_bytes
    sizes = sorted({t for _, t, _ in uniform})
    mixed_seen = False
    for budget in (sizes[len(sizes) // 3], sizes[2 * len(sizes) // 3]):
        solved = auto.solve(cfg, n, lambda a: outside + a.stored_bytes <= budget, "cpu")
        total, _, measured_flops, _ = probe(running(cfg, solved), torch.bfloat16)
        fitting = [(f, r) for r, t, f in uniform if t <= budget]
        best_flops, best = min(fitting, key=lambda x: x[0])
        _, _, _, uniform_flops = probe(dataclasses.replace(cfg, recompute=best), torch.bfloat16)
        assert total <= budget
        assert uniform_flops == best_flops and measured_flops <= uniform_flops, (budget, [p.entry for p in solved])
        mixed_seen |= len({p.entry for p in solved}) > 1
    assert mixed_seen


def test_a_policy_file_offers_moe_modules_on_moe_layers_only(tmp_path):
    path = tmp_path / "p.toml"
    for layers, needle in (('["selective[moe]", "selective[moe]", "none", "none"]', "layer 1 is a dense layer"),
                           ('["selective[mlp]", "none", "none", "none"]', "layer 0 is a moe layer")):
        path.write_text(f'schema = "recompute-bench/policy/v1"\nlayers = {layers}\n')
        result = invoke("run", "-w", "tiny-moe", "--num-layers", "4", "--set", "model.moe_layer_freq=2", "--policy", str(path))
        assert result.exit_code == 2 and needle in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1


# ----- measured costs (--profile) and offload as a choice -------------------------------------

def test_plan_auto_profile_measures_each_module_caches_it_and_prices_the_policy_by_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ("plan", "--auto", "-w", "tiny", "--device", "cpu", "--allowance-gb", "0", "--allowance-fraction", "0",
            "--memory-gb", "0.0105", "--profile", "--profile-steps", "2", "--output", "p.toml", "--json")
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert "measured on cpu" in first.stderr and "offload is not a choice on a CPU" in first.stderr
    [path] = (tmp_path / "results" / "profiles").glob("cpu-*.json")
    profile = json.loads(path.read_text())
    dense = profile["kinds"]["dense"]
    assert set(dense["seconds"]) == {"layer", "core_attn", "mlp", "layernorm"} and profile["host_link_bytes_per_s"] is None
    assert all(t > 0 for t in dense["seconds"].values())
    assert dense["seconds"]["layer"] > dense["seconds"]["core_attn"]  # the layer's forward contains its attention's
    assert dense["saved_bytes"] == dense["analytical_saved_bytes"]    # the probe, target by target
    plan = json.loads(first.stdout)
    assert plan["costs"] == "measured seconds" and plan["predicted"]["device_bytes_needed"] <= 0.0105 * 2**30
    costs = ProfileCosts(profile)
    policy = [parse_entry(e) for e in plan["policy"]]
    assert plan["predicted"]["recompute_cost"] == auto.policy_cost(config("tiny"), policy, costs, "cpu")
    assert plan["predicted"]["recompute_cost"] <= plan["uniform"]["recompute_cost"]
    again = invoke(*args)  # the second plan reads the cache: same costs, same policy
    assert again.exit_code == 0 and "read from" in again.stderr
    assert json.loads(again.stdout)["policy"] == plan["policy"]


def test_profile_and_offload_flags_are_refused_where_they_cannot_apply():
    for args, needle in ((["--profile"], "pass --device cpu"),                        # modelling CUDA, measuring a CPU
                         (["--device", "cpu", "--host-link-gbps", "25"], "add --profile"),
                         (["--device", "cpu", "--profile", "--tp", "2"], "--tp > 1")):
        result = invoke("plan", "--auto", "-w", "tiny", "--memory-gb", "1", *args)
        assert result.exit_code == 2 and needle in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1
    result = invoke("plan", "-w", "tiny", "--memory-gb", "1", "--profile")
    assert result.exit_code == 2 and "goes with plan --auto" in result.stderr


def cuda_profile(cfg, link_bytes_per_s):
    """A profile as a CUDA device would record it (this machine has none): every target's forward
    proportional to its FLOPs at 100 TFLOP/s, and the given host link."""
    rate, kinds = 100e12, {}
    for kind in ("dense",):
        c = kind_config(cfg, kind)
        seconds = {m: flops.policy_recompute_flops(c, [LayerPolicy(modules=frozenset([m]))], None, "cuda") / rate
                   for m in spec_for(cfg.model).recompute_targets}
        seconds["layer"] = flops.policy_recompute_flops(c, [LayerPolicy(chunk=0)], None, "cuda") / rate
        kinds[kind] = {"seconds": seconds}
    return {"device": "cuda", "kinds": kinds, "host_link_bytes_per_s": link_bytes_per_s}


def test_offload_is_a_choice_priced_by_host_link_time_not_hidden_by_compute():
    cfg = config("llama3-8b", model__num_layers=8, training__seq_length=8192)
    full = layer_activation_bytes(cfg, (), "cuda")
    fast, slow = ProfileCosts(cuda_profile(cfg, 1e15)), ProfileCosts(cuda_profile(cfg, 1e9))
    forward = fast.full("dense")
    assert fast.offload("dense", full) == 0.0  # the copies hide behind compute
    copy = full / 1e9
    assert slow.offload("dense", full) == pytest.approx((copy - forward) + (copy - 2 * forward))
    peak, = auto.stage_peaks(cfg, "cuda")
    budget = peak(stage_activations(dataclasses.replace(cfg, recompute=RecomputeConfig("full", [], "uniform", 1)), "cuda")) * 1.05

    def fits(a):
        return peak(a) <= budget

    with_link = auto.solve(cfg, 8, fits, "cuda", fast)
    without = auto.solve(cfg, 8, fits, "cuda", slow)
    assert any(p.offload for p in with_link) and not any(p.offload for p in without)
    for policy in (with_link, without):
        assert fits(policy_activations(cfg, policy, "cuda"))
    assert auto.policy_cost(cfg, with_link, fast, "cuda") < auto.policy_cost(cfg, without, slow, "cuda")
    # the chosen offload mix is a valid policy file for run --policy (CUDA) and its bytes are the analysis'
    entries = [p.entry for p in with_link]
    assert check(entries, cfg) == with_link


@pytest.mark.slow
def test_the_issue_s_first_example_plans_many_ranks_from_the_rank_model(tmp_path):
    base = ("plan", "--auto", "--workload", "llama3-70b", "--tp", "8", "--sequence-parallel", "--pp", "4", "--json")
    plans = {}
    for name, extra in (("80", ["--memory-gb", "80"]), ("60", ["--memory-gb", "60"]),
                        ("60 dist-opt", ["--memory-gb", "60", "--use-distributed-optimizer", "--dp", "8"])):
        result = invoke(*base, *extra, "--output", str(tmp_path / "p.toml"))
        assert result.exit_code == 0, result.output
        plans[name] = json.loads(result.stdout)
    for name, plan in plans.items():
        cfg = dataclasses.replace(config("llama3-70b", parallel__tensor_model_parallel_size=8, parallel__sequence_parallel=True,
                                         parallel__pipeline_model_parallel_size=4,
                                         parallel__data_parallel_size=8 if "dist" in name else 1,
                                         parallel__use_distributed_optimizer="dist" in name),
                                  recompute=RecomputeConfig(layer_policy=plan["policy"]))
        need = device_bytes_needed(peak_rank_memory(cfg, "cuda").peak_allocated_bytes)
        assert need == plan["predicted"]["device_bytes_needed"] <= float(name.split()[0]) * 2**30
        assert plan["predicted"]["recompute_cost"] <= plan["uniform"]["recompute_cost"]
    assert plans["80"]["predicted"]["recompute_overhead"] == 0  # 80 GiB holds every activation
    assert 0 < plans["60"]["predicted"]["recompute_overhead"] < plans["60"]["uniform"]["recompute_overhead"]
    assert plans["60 dist-opt"]["predicted"]["recompute_overhead"] == 0  # sharded Adam state frees the room


# ----- pipeline stages: a policy per stage (issue 18) ------------------------------------------------

PIPELINES = [("tiny", 2), ("tiny", 4), ("llama3-8b", 2)]  # llama3-8b with 4 layers: RMSNorm, SwiGLU, GQA


def piped(workload, pp):
    return config(workload, model__num_layers=4, parallel__pipeline_model_parallel_size=pp,
                  training__global_batch_size=8, training__micro_batch_size=1, training__precision="fp32")


@pytest.mark.parametrize("workload,pp", PIPELINES)
def test_plan_auto_solves_every_stage_against_exhaustive_search_of_that_stage(workload, pp):
    cfg = piped(workload, pp)
    n = cfg.model.num_layers // pp
    stage_policies = list(every_policy(resolved(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=n)))))
    # reference: each stage's whole-rank peak from the rank model with the candidate's activations
    needs = [[rank_memory(cfg, s, "cpu", policy_activations(cfg, p, "cpu", s * n)).peak_allocated_bytes
              for p in stage_policies] for s in range(pp)]
    costs = [[cost_from(cfg, p, s * n) for p in stage_policies] for s in range(pp)]
    lo = max(min(stage) for stage in needs)  # every stage has a policy that fits
    hi = max(max(stage) for stage in needs)
    differed = False
    for fraction in (0.0, 0.3, 0.6, 1.0):
        budget = lo + fraction * (hi - lo)
        result = auto.auto_plan(cfg, budget, "cpu", 0.0, 0.0)
        assert result["unfit_stages"] == []
        for s, row in enumerate(result["stages"]):
            best = min(c for c, need in zip(costs[s], needs[s]) if need <= budget)
            got = [parse_entry(e) for e in row["policy"]]
            assert cost_from(cfg, got, s * n) == best, (s, fraction, row["policy"])
            assert row["peak_allocated_bytes"] == rank_memory(cfg, s, "cpu", policy_activations(cfg, got, "cpu", s * n)).peak_allocated_bytes
            assert row["peak_allocated_bytes"] <= budget
        differed |= len({tuple(row["policy"]) for row in result["stages"]}) > 1
        # the whole plan as one config: the rank model's peak of every stage is the stage's row
        chosen = dataclasses.replace(cfg, recompute=RecomputeConfig(layer_policy=result["policy"]))
        assert [r.peak_allocated_bytes for r in stage_memories(chosen, "cpu")] == [row["peak_allocated_bytes"] for row in result["stages"]]
        # the best uniform setting: the least cost over Megatron's settings whose most loaded stage fits
        uniform = [(sum(cost_from(cfg, layer_policies(r, n), s * n)[0] for s in range(pp)), r.label)
                   for r in [RecomputeConfig()] + all_settings(n)
                   if peak_rank_memory(dataclasses.replace(cfg, recompute=r), "cpu").peak_allocated_bytes <= budget]
        if uniform:
            assert result["uniform"]["recompute_cost"] == min(uniform)[0]
            assert result["predicted"]["recompute_cost"] <= result["uniform"]["recompute_cost"]
        else:
            assert result["uniform"] is None
    assert differed  # some budget makes the stages choose differently, so the test tells per-stage from one policy
    assert auto.auto_plan(cfg, lo - 1, "cpu", 0.0, 0.0)["unfit_stages"]


def cost_from(cfg, policies, first):
    return (flops.policy_recompute_flops(cfg, policies, None, "cpu", first=first), sum(len(p.modules) for p in policies)
            + sum((len(spec_for(cfg.model).recompute_targets) + 1) for p in policies if p.chunk is not None))


def test_every_megatron_setting_is_read_back_from_its_layers_and_its_flags_are_megatron_s():
    from recompute_bench.ingest.megatron_args import megatron_overrides
    from recompute_bench.ingest.megatron_argv import normalize, read_argv
    cfg = config("llama3-8b", model__num_layers=6)
    targets = spec_for(cfg.model).recompute_targets
    shape = "--num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32".split()
    for r in [RecomputeConfig(), RecomputeConfig(activation_offload_layers=2)] + all_settings(6):
        got = megatron_setting(cfg.model, layer_policies(r, 6), targets)
        assert got is not None and layer_policies(got, 6) == layer_policies(r, 6), r.label
        parsed = megatron_overrides(normalize(read_argv(shape + megatron_flags(got))))["recompute"]
        assert RecomputeConfig(**parsed) == got, r.label
    mixed = [parse_entry(e) for e in ("full:0", "selective[mlp]", "none", "none", "none", "none")]
    assert megatron_setting(cfg.model, mixed, targets) is None


def test_megatron_runs_a_plan_only_where_every_stage_runs_one_setting():
    none, block = RecomputeConfig(), RecomputeConfig("full", [], "block", 2)
    uniform = {"label": "full block 2", "megatron_flags": megatron_flags(block)}
    same = auto.megatron_run([block, block], uniform)
    assert same["runs"] and same["flags"] == ["--recompute-granularity", "full", "--recompute-method", "block",
                                              "--recompute-num-layers", "2"]
    differ = auto.megatron_run([block, none], uniform)
    assert not differ["runs"] and differ["flags"] is None
    assert "one recompute setting to every pipeline stage" in differ["note"] and "stage 1 none" in differ["note"]
    assert "--recompute-num-layers 2" in differ["note"]  # what to run there instead
    mix = auto.megatron_run([None, none], None)
    assert not mix["runs"] and "stage 0 mixes choices" in mix["note"] and "no uniform setting fits" in mix["note"]


def test_plan_auto_with_pp_writes_a_section_per_stage_and_says_how_megatron_runs_it(tmp_path):
    path = tmp_path / "p.toml"
    base = ("plan", "--auto", "-w", "llama3-70b", "--tp", "8", "--pp", "4", "--sequence-parallel", "--output", str(path))
    result = invoke(*base, "--memory-gb", "60", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    cfg = config("llama3-70b", parallel__tensor_model_parallel_size=8, parallel__pipeline_model_parallel_size=4,
                 parallel__sequence_parallel=True)
    assert read_policy(path, cfg) == plan["policy"]
    assert path.read_text().count("[stage.") == 4 and "layers = [\n" in path.read_text()
    assert [s["microbatches_in_flight"] for s in plan["stages"]] == [4, 3, 2, 1]
    assert plan["stages"][0]["recompute_cost"] > plan["stages"][-1]["recompute_cost"]  # stage 0 holds 4 micro-batches
    assert plan["megatron"]["runs"] is False and plan["uniform"]["megatron_flags"]
    assert "Megatron cannot run this plan" in result.stderr and "per-stage policy" in result.stderr
    # plan without --auto recommends the same uniform setting and prints Megatron's flags for it
    uniform = invoke("plan", *base[2:-2], "--memory-gb", "60")
    assert uniform.exit_code == 0, uniform.output
    assert f"recommended: {plan['uniform']['label']}" in uniform.stderr
    assert "in Megatron-LM: " + " ".join(plan["uniform"]["megatron_flags"]) in uniform.stderr.replace("\n", "")
    roomy = invoke(*base, "--memory-gb", "80", "--json")
    assert roomy.exit_code == 0, roomy.output
    assert json.loads(roomy.stdout)["megatron"] == {"runs": True, "setting": "none", "flags": [],
                                                     "note": "Megatron runs this plan as none on every stage (no recompute flags)"}


def stage_file(tmp_path, sections, extra=""):
    path = tmp_path / "stages.toml"
    body = "".join(f'[stage.{s}]\nlayers = [{", ".join(chr(34) + e + chr(34) for e in layers)}]\n' for s, layers in sections.items())
    path.write_text(f'schema = "recompute-bench/policy/v1"\nworkload = "tiny"\n{extra}{body}')
    return path


def test_per_stage_sections_give_each_stage_its_policy_with_chunks_kept_apart(tmp_path):
    cfg = config("tiny", parallel__pipeline_model_parallel_size=2)
    path = stage_file(tmp_path, {0: ["full:0", "full:0"], 1: ["full:0", "selective[mlp]"]})
    assert read_policy(path, cfg) == ["full:0", "full:0", "full:1", "selective[mlp]"]
    flat = RecomputeConfig(layer_policy=read_policy(path, cfg))
    assert layer_policies(flat, 2, first=2) == [LayerPolicy(chunk=1), LayerPolicy(modules=frozenset({"mlp"}))]


BAD_STAGES = {
    "sections without --pp": ((), {0: ["none"] * 2, 1: ["none"] * 2}, "", "runs one pipeline stage; pass --pp 2"),
    "a stage that does not exist": (("--pp", "2"), {0: ["none"] * 2, 1: ["none"] * 2, 2: ["none"] * 2}, "",
                                    "section for stage 2, but --pp 2 has stages 0 to 1"),
    "a stage without a section": (("--pp", "2"), {0: ["none"] * 2}, "", "no section for stage 1"),
    "layers not in the stage": (("--pp", "2"), {0: ["none"] * 3, 1: ["none"]}, "",
                                "stage 0 lists 3 layers but stage 0 holds 2 (layers 0 to 1)"),
    "layers beside sections": (("--pp", "2"), {0: ["none"] * 2, 1: ["none"] * 2}, 'layers = ["none", "none", "none", "none"]\n',
                               "both `layers` and per-stage sections"),
    "a bad entry in a stage": (("--pp", "2"), {0: ["none"] * 2, 1: ["none", "half"]}, "", "stage 1, layer 3: 'half'"),
    "virtual stages": (("--pp", "2", "--set", "parallel.virtual_pipeline_model_parallel_size=2"),
                       {0: ["none"] * 2, 1: ["none"] * 2}, "", "do not go with virtual pipeline stages"),
}


@pytest.mark.parametrize("problem", BAD_STAGES)
def test_a_bad_per_stage_policy_file_is_one_line_and_exit_2(tmp_path, problem):
    flags, sections, extra, needle = BAD_STAGES[problem]
    path = stage_file(tmp_path, sections, extra)
    result = invoke("run", "-w", "tiny", "--nproc-per-node", "2" if flags else "1", *flags, "--policy", str(path))
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_run_with_pp_measures_each_stage_under_its_own_section(tmp_path):
    path = stage_file(tmp_path, {0: ["full:0", "full:0"], 1: ["selective[mlp]", "none"]})
    result = invoke("run", "-w", "tiny", "--nproc-per-node", "2", "--pp", "2", "--policy", str(path), *FAST,
                    "--no-save", "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["recompute"]["layer_policy"] == ["full:0", "full:0", "selective[mlp]", "none"]
    stages = record["pipeline"]["stages"]
    for s in stages:  # each stage's layers ran its own section: measured bytes equal the estimate
        assert s["activation_bytes"] == s["estimated_activation_bytes"]
        assert s["activation_peak_bytes"] == s["estimated_activation_peak_bytes"]
    assert stages[0]["activation_bytes"] < stages[1]["activation_bytes"]  # stage 0 keeps its chunk's input only


def test_with_dense_and_moe_stages_each_stage_chooses_from_its_own_kind_against_exhaustive_search():
    # moe_layer_freq 2 over 4 stages: stages of MoE and dense layers (one policy for all could not exist)
    cfg = config("tiny-moe", model__num_layers=4, model__moe_layer_freq=2, parallel__pipeline_model_parallel_size=4,
                 training__global_batch_size=8, training__micro_batch_size=1, training__precision="fp32")
    targets = spec_for(cfg.model).recompute_targets
    options = {}
    for s, kind in enumerate(("moe", "dense", "moe", "dense")):
        mods = [m for m in targets if (m != "mlp" if kind == "moe" else m not in ("moe", "moe_act", "shared_experts"))]
        options[s] = [[LayerPolicy(modules=frozenset(x))] for n in range(len(mods) + 1)
                      for x in itertools.combinations(mods, n)] + [[LayerPolicy(chunk=0)]]
    needs = {s: [rank_memory(cfg, s, "cpu", policy_activations(cfg, p, "cpu", s)).peak_allocated_bytes for p in options[s]]
             for s in options}
    lo, hi = max(min(n) for n in needs.values()), max(max(n) for n in needs.values())
    for fraction in (0.0, 0.5, 1.0):
        budget = lo + fraction * (hi - lo)
        result = auto.auto_plan(cfg, budget, "cpu", 0.0, 0.0)
        for s, row in enumerate(result["stages"]):
            best = min(cost_from(cfg, p, s) for p, n in zip(options[s], needs[s]) if n <= budget)
            got = [parse_entry(e) for e in row["policy"]]
            assert cost_from(cfg, got, s) == best and row["peak_allocated_bytes"] <= budget, (s, fraction, row["policy"])
            assert not got[0].modules & ({"mlp"} if s % 2 == 0 else {"moe", "moe_act", "shared_experts"})
