"""The analytical model against measurement (saved-tensor probe, FlopCounterMode, parameter count),
against the paper's Table 2, Eq. 7/8 and Table 5, and the `estimate` / `plan` commands."""

import contextlib
import dataclasses
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import config, invoke
from recompute_bench.analysis import memory as E
from recompute_bench.analysis import flops
from recompute_bench.spec.config import RecomputeConfig
from recompute_bench.measure.point import DTYPES, SavedTensorProbe, synthetic_batches
from recompute_bench.models.dense.layers import build_model
from recompute_bench.recompute.apply import apply_recompute, recomputed_layers
from recompute_bench.measure.verify import all_settings

MiB, GiB = 2**20, 2**30
# Shrunken layers of the presets: a few layers, small hidden size and sequence, one micro-batch per step.
SHRUNK = {
    "tiny": {"training.global_batch_size": 2},
    "llama3-8b": {"model.num_layers": 3, "model.hidden_size": 64, "model.num_attention_heads": 8,
                  "model.num_query_groups": 2, "model.ffn_hidden_size": 160, "model.vocab_size": 256,
                  "training.seq_length": 32, "training.micro_batch_size": 2, "training.global_batch_size": 2},
    "gpt3-175b": {"model.num_layers": 3, "model.hidden_size": 64, "model.num_attention_heads": 4,
                  "model.ffn_hidden_size": 256, "model.vocab_size": 512, "model.max_position_embeddings": 64,
                  "training.seq_length": 32, "training.micro_batch_size": 2, "training.global_batch_size": 2},
}
PAPER_PRESETS = ["gpt3-22b", "gpt3-175b", "gpt3-530b", "gpt3-1t"]


def shrunk(workload, **overrides):
    return config(workload, **{k.replace(".", "__"): v for k, v in {**SHRUNK[workload], **overrides}.items()})


def measure(cfg, count_flops=False, backward=False):
    """One probe step as `run` takes it (first micro-batch of the step's token tensor): (activation
    bytes, bytes per layer, FLOPs of forward + backward, bytes saved during backward, i.e. by full
    recompute's re-run forward)."""
    model = apply_recompute(build_model(cfg.model, cfg.training.seed, "cpu", DTYPES[cfg.training.precision]),
                            cfg.recompute).train()
    tokens = synthetic_batches(cfg, torch.device("cpu"))[0]
    probe = SavedTensorProbe(model)
    again: dict[int, torch.UntypedStorage] = {}  # held, so every storage saved in backward is counted

    def keep(t):
        if t.untyped_storage()._cdata not in probe.excluded:
            again.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
        return t

    torch.manual_seed(0)
    with FlopCounterMode(display=False) if count_flops else contextlib.nullcontext() as counter:
        with probe.watch():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        total, layers = probe.bytes()
        if backward or count_flops:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss.backward()
    recomputed = sum(s.nbytes() for s in again.values())
    return total, layers / cfg.model.num_layers, counter.get_total_flops() if count_flops else None, recomputed


def every_setting(workload, backend, dropout):
    """The shrunken workload in fp32 (fast on a CPU): no recompute and every setting `verify` checks."""
    base = shrunk(workload, **{"model.attention_backend": backend, "model.attention_dropout": dropout,
                               "model.hidden_dropout": dropout, "training.precision": "fp32"})
    return [dataclasses.replace(base, recompute=r) for r in [RecomputeConfig()] + all_settings(base.model.num_layers)]


def _error(estimate, measured):
    return abs(estimate - measured) / measured


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout-off", "dropout-on"])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("workload", list(SHRUNK))
def test_every_setting_activation_bytes_match_the_probe(workload, backend, dropout):
    for cfg in every_setting(workload, backend, dropout):
        r = cfg.recompute
        total, per_layer, _, _ = measure(cfg)
        est = E.activation_bytes(cfg, "cpu")
        assert _error(est["activation_bytes"], total) <= 0.02, (r.label, est, total)
        assert _error(est["activation_bytes_per_layer"], per_layer) <= 0.02, (r.label, est, per_layer)


# FLOPs do not depend on dropout, except that on a CPU it decides which kernel sdpa runs.
@pytest.mark.parametrize("backend,dropout", [("math", 0.1), ("sdpa", 0.1), ("sdpa", 0.0)],
                         ids=["math", "sdpa-math-fallback", "sdpa-cpu-flash"])
@pytest.mark.parametrize("workload", list(SHRUNK))
def test_every_setting_hardware_flops_match_the_flop_counter(workload, backend, dropout):
    for cfg in every_setting(workload, backend, dropout):
        r = cfg.recompute
        _, _, measured_flops, _ = measure(cfg, count_flops=True)
        hardware = flops.hardware_flops_per_step(cfg)
        if E.attention_kernel(cfg, "cpu") == "fused":
            # torch's CPU flash kernel has no FlopCounterMode formula: the count misses exactly its
            # forward and backward (3x the forward) and its recompute, which the estimate includes.
            L = cfg.model.num_layers
            rerun = recomputed_layers(r, L) + (L if "core_attn" in r.modules else 0)
            blind = (3 * L + rerun) * flops.layer_forward_flops(cfg).core_attn
            assert measured_flops == hardware - blind, r.label
        else:
            assert _error(hardware, measured_flops) <= 0.01, (r.label, hardware, measured_flops)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_the_model_is_exact_term_by_term(precision, micro_batch):
    # b = 1 keeps views of the fused QKV output where b > 1 copies q, k, v; fp32 has no upcast in
    # sdpa's math fallback: each case names different storages, and every one adds up to the byte.
    for workload in ("llama3-8b", "gpt3-175b"):
        for backend, dropout in (("sdpa", 0.0), ("sdpa", 0.1), ("math", 0.1)):
            cfg = shrunk(workload, **{"training.precision": precision, "training.micro_batch_size": micro_batch,
                                      "training.global_batch_size": micro_batch, "model.attention_backend": backend,
                                      "model.attention_dropout": dropout, "model.hidden_dropout": dropout})
            total, per_layer, _, _ = measure(cfg)
            assert E.activation_bytes(cfg, "cpu") == {"activation_bytes": total, "activation_bytes_per_layer": per_layer}


@pytest.mark.parametrize("method,n", [("uniform", 1), ("uniform", 2), ("block", 2)])
def test_full_recompute_rebuilds_a_whole_layer_per_recomputed_layer_in_backward(method, n):
    cfg = shrunk("gpt3-175b", **{"model.attention_backend": "math", "model.attention_dropout": 0.1,
                                 "model.hidden_dropout": 0.1})
    cfg = dataclasses.replace(cfg, recompute=RecomputeConfig("full", [], method, n))
    *_, recomputed = measure(cfg, backward=True)
    layers = cfg.model.num_layers if method == "uniform" else n
    assert recomputed == layers * E.layer_activation_bytes(cfg, (), "cpu")
    acts = E.stage_activations(cfg, "cpu")
    full, ckpt = E.layer_activation_bytes(cfg, (), "cpu"), E.checkpoint_input_bytes(cfg)
    if method == "uniform":  # 3 layers in chunks of n: the last chunk is rebuilt with the earlier inputs held
        chunks = [min(n, 3 - i) for i in range(0, 3, n)]
        assert acts.stored_bytes == len(chunks) * ckpt
        assert acts.peak_bytes == max(c * ckpt + size * full for c, size in enumerate(chunks))
    else:
        assert acts.stored_bytes == n * ckpt + (3 - n) * full
        assert acts.peak_bytes == acts.stored_bytes


@pytest.mark.parametrize("workload", list(SHRUNK))
def test_parameter_count_matches_the_built_model(workload):
    cfg = shrunk(workload)
    model = build_model(cfg.model, cfg.training.seed)
    assert E.stage_parameters(cfg, 0) == sum(p.numel() for p in model.parameters())


def test_pipeline_stages_split_the_layers_and_keep_an_embedding_copy_when_tied():
    cfg = config("gpt3-175b", parallel__pipeline_model_parallel_size=2)
    one = config("gpt3-175b")
    vocab = cfg.model.vocab_size * cfg.model.hidden_size
    assert E.stage_parameters(cfg, 0) + E.stage_parameters(cfg, 1) == E.stage_parameters(one, 0) + vocab


def test_optimizer_bytes_per_parameter_as_measure_holds_them_and_distributed():
    held = ("weights", "main_grads", "master_weights", "adam_moments")
    assert sum(E.optimizer_bytes_per_parameter(config())[k] for k in held) == 18
    dist = config("tiny", parallel__data_parallel_size=4, parallel__use_distributed_optimizer=True,
                  training__global_batch_size=8)
    assert sum(E.optimizer_bytes_per_parameter(dist)[k] for k in held) == 6 + 12 / 4  # Megatron's 6 + 12/dp
    assert sum(E.optimizer_bytes_per_parameter(config(training__precision="fp32"))[k] for k in held) == 16


def test_first_stage_holds_p_microbatches_and_the_interleave_factor():
    cfg = config("llama3-70b", parallel__tensor_model_parallel_size=8, parallel__pipeline_model_parallel_size=4)
    assert [E.microbatches_in_flight(cfg, i) for i in range(4)] == [4, 3, 2, 1]
    vpp = config("gpt3-175b", parallel__pipeline_model_parallel_size=8, parallel__virtual_pipeline_model_parallel_size=3)
    assert E.microbatches_in_flight(vpp, 0) == pytest.approx(8 * (1 + 7 / 24))
    rank = E.rank_memory(cfg, 0)
    stored = E.stage_activations(cfg).stored_bytes
    assert rank.items["activations of the other in-flight micro-batches"] == 3 * stored


# ----- the paper ------------------------------------------------------------------------------

@pytest.mark.parametrize("workload", PAPER_PRESETS)
def test_table_2_exactly_for_the_paper_presets(workload):
    for sp in (False, True):
        cfg = config(workload, model__attention_backend="math", parallel__tensor_model_parallel_size=8,
                     parallel__sequence_parallel=sp)
        s, b, h, a, t = cfg.training.seq_length, cfg.training.micro_batch_size, cfg.model.hidden_size, cfg.model.num_attention_heads, 8
        sbh = s * b * h
        table = {
            "none": sbh / t * (34 + 5 * a * s / h) if sp else sbh * (10 + 24 / t + 5 * a * s / (h * t)),
            "selective": 34 * sbh / t if sp else sbh * (10 + 24 / t),
            "full": 2 * sbh,
        }
        exactly = lambda x: pytest.approx(x, rel=1e-14, abs=0)  # noqa: E731 (float rounding only)
        for recompute, expected in table.items():
            assert E.paper_layer_bytes(s, b, h, a, t, sp, recompute) == exactly(expected)
        assert E.paper_layer_bytes(s, b, h, a, 1, False, "none") == exactly(sbh * (34 + 5 * a * s / h))
        # The layer built here is the paper's plus the two norms' statistics, exactly.
        assert not E.paper_layer_differences(cfg)
        stats = E.built_minus_paper_bytes(cfg)
        assert stats == 2 * 2 * 4 * s * b / (t if sp else 1)  # 2 norms x (mean, rstd) x fp32
        assert E.layer_activation_bytes(cfg) - stats == exactly(table["none"])
        assert E.layer_activation_bytes(cfg, ["core_attn"]) - stats == exactly(table["selective"])
        if not sp:  # full recompute keeps the layer input; the paper does not shard it
            assert E.checkpoint_input_bytes(cfg) == table["full"]


def test_megatron_derived_per_layer_and_first_stage_totals():
    # anchor §D.1: 34sbh/t per layer and first-stage totals (t = 8, SP + selective recompute)
    per_layer = {"gpt3-22b": 204.0, "gpt3-175b": 102.0, "gpt3-530b": 170.0, "gpt3-1t": 212.5}
    layout = {"gpt3-22b": (1, None), "gpt3-175b": (8, 3), "gpt3-530b": (35, 3), "gpt3-1t": (64, None)}
    totals = {"gpt3-22b": 9.79, "gpt3-175b": 12.38, "gpt3-530b": 23.30, "gpt3-1t": 26.95}
    for workload, mib in per_layer.items():
        p, vpp = layout[workload]
        cfg = config(workload, parallel__tensor_model_parallel_size=8, parallel__sequence_parallel=True,
                     parallel__pipeline_model_parallel_size=p, parallel__virtual_pipeline_model_parallel_size=vpp)
        m, tr = cfg.model, cfg.training
        assert E.paper_layer_bytes(tr.seq_length, tr.micro_batch_size, m.hidden_size, m.num_attention_heads, 8, True,
                                   "selective") == mib * MiB
        assert round(E.paper_first_stage_bytes(cfg, "selective") / GiB, 2) == totals[workload]


def test_paper_flops_reproduce_table_5_and_show_the_selective_inconsistency():
    # Table 5: iteration time with selective recompute + SP, A100 312 TFLOP/s; MFU (Eq. 7) and HFU (Eq. 8)
    table5 = {"gpt3-22b": (1.10, 8, 41.5, 43.7), "gpt3-175b": (13.75, 64, 51.4, 52.8),
              "gpt3-530b": (37.83, 280, 56.0, 57.0), "gpt3-1t": (71.49, 512, 56.3, 57.0)}
    for workload, (seconds, gpus, mfu, hfu) in table5.items():
        cfg = config(workload)
        f = E.paper_flops_per_step(cfg, "selective")
        tolerance = 0.25 if workload == "gpt3-22b" else 0.05  # the paper's own 22B row is 0.2 pt off its formulas
        assert abs(100 * f["model_flops_per_step"] / (seconds * gpus * 312e12) - mfu) <= tolerance
        assert abs(100 * f["hardware_flops_per_step"] / (seconds * gpus * 312e12) - hfu) <= tolerance
        B, L, s, h = cfg.training.global_batch_size, cfg.model.num_layers, cfg.training.seq_length, cfg.model.hidden_size
        # Eq. 8 adds 12Bs^2h per layer; the text's recompute of QK^T and times V adds 4Bs^2h, as flops.py does
        assert f["hardware_flops_per_step"] - f["model_flops_per_step"] == pytest.approx(12 * B * s * s * h * L)
        assert f["hardware_flops_per_step_from_text"] - f["model_flops_per_step"] == pytest.approx(4 * B * s * s * h * L)
        selective = dataclasses.replace(cfg, recompute=RecomputeConfig("selective", ["core_attn"]))
        assert flops.hardware_flops_per_step(selective) - flops.hardware_flops_per_step(cfg) == 4 * B * s * s * h * L


# ----- the commands -------------------------------------------------------------------------------

def test_estimate_commands_of_the_issue():
    result = invoke("estimate", "--workload", "llama3-70b", "--tp", "8", "--sequence-parallel", "--pp", "4",
                    "--micro-batch-size", "1", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    labels = [s["label"] for s in report["settings"]]
    assert "none" in labels and "selective[core_attn,mlp,layernorm]" in labels and "full uniform 1" in labels
    assert report["setting"]["peak_stage"] == 0 and report["microbatches_in_flight"] == 4
    assert "whole-rank peak" in result.stderr and "Table 2" in result.stderr

    result = invoke("estimate", "--workload", "gpt3-175b", "--tp", "8", "--attention-backend", "math", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["recompute"]: r for r in json.loads(result.stdout)["paper"]["rows"]}
    assert rows["selective"]["paper_bytes"] == 2048 * 12288 * (10 + 24 / 8)
    assert "the paper's layer" in result.stderr


def test_plan_recommends_the_fastest_setting_that_fits():
    result = invoke("plan", "--workload", "llama3-70b", "--tp", "8", "--pp", "4", "--memory-gb", "80", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    fits = plan["fits"]
    assert fits and all(r["device_bytes_needed"] <= 80 * GiB for r in fits)
    assert [r["hardware_flops_per_step"] for r in fits] == sorted(r["hardware_flops_per_step"] for r in fits)
    assert plan["recommended"] == fits[0]["label"] and "recommended" in result.stderr
    assert "none" not in [r["label"] for r in fits]  # no recompute does not fit 80 GiB there


def test_plan_says_when_nothing_fits_and_what_would():
    result = invoke("plan", "--workload", "llama3-70b", "--tp", "8", "--pp", "4", "--memory-gb", "40", "--json")
    assert result.exit_code == 1
    plan = json.loads(result.stdout)
    assert not plan["fits"] and "nothing fits" in result.stderr
    changes = {r["change"]: r for r in plan["would_fit"]}
    assert changes["--pp 8"]["fits"]
    assert any(c.startswith("offload") for c in changes)


@pytest.mark.parametrize("argv,needle", [
    (["plan", "-w", "tiny"], "--memory-gb"),
    (["plan", "-w", "tiny", "--memory-gb", "-1"], "--memory-gb"),
    (["estimate", "-w", "tiny", "--device", "tpu"], "--device"),
    (["estimate", "-w", "tiny", "--allowance-fraction", "-0.5"], "allowance"),
    (["estimate", "-w", "nope"], "unknown workload"),
    (["plan", "-w", "tiny", "--memory-gb", "80", "--tp", "3"], "must divide"),
])
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    result = invoke(*argv)
    assert result.exit_code == 2
    assert needle in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_run_records_carry_the_estimate_beside_the_measurement():
    result = invoke("run", "-w", "tiny", "--set", "training.warmup_steps=0", "--set", "training.measured_steps=1",
                    "--no-save", "--json", "--attention-backend", "math")
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["metrics"]
    assert m["estimated_activation_bytes"] == m["activation_bytes"]
    assert m["estimated_activation_bytes_per_layer"] == m["activation_bytes_per_layer"]
    assert m["estimated_hardware_flops_per_step"] == m["measured_flops_per_step"]
    assert m["estimated_peak_allocated_bytes"] > m["activation_bytes"]
    assert "estimated activation bytes (error)" in result.stderr and "(+0.00%)" in result.stderr
