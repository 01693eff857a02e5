"""`plan --framework megatron --search-layouts`: the pruned search finds what pricing every setting of
every layout finds, it lists only layouts Megatron's rules accept, the sizes given stay fixed, the
flags carry the layout, and bad input (no GPU count, a budget under every layout's static memory, a
layout the rules refuse) gets one line and exit 2."""

import dataclasses
import json

from helpers import config, invoke

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import MegatronRun, stage_peaks
from recompute_bench.analysis.megatron.layouts import (candidate_layouts, price_every_layout, search_layouts,
                                                       static_bytes, static_key)
from recompute_bench.config.rules import validate
from recompute_bench.config.schema import with_setting

RUN = MegatronRun("h100")
H100 = gpu_rates.datasheet_rates("h100")
SEARCH = ["plan", "--framework", "megatron", "--search-layouts", "--gpu", "h100"]


def small():
    """A Llama-style model of 8 layers: small enough to price every setting of every layout."""
    return config("tiny", training__framework="megatron", model__num_layers=8, model__hidden_size=256,
                  model__num_attention_heads=8, model__ffn_hidden_size=1024, model__max_position_embeddings=1024,
                  training__seq_length=1024, training__global_batch_size=16, training__micro_batch_size=1)


def test_the_pruned_search_finds_what_pricing_everything_finds():
    cfg = small()
    layouts, _ = candidate_layouts(cfg, 8, set(), H100)
    none_peaks = sorted(max(s.peak_allocated_bytes for s in stage_peaks(c, RUN)) for c in layouts)
    budget = none_peaks[len(none_peaks) // 4]  # most layouts need recompute or offload to fit
    result = search_layouts(cfg, RUN, H100, 8, budget, 0.0, 0.0, top=4)
    assert result["searched"]["pruned"] > 0  # the bound skipped layouts
    found = [(round(r["step_seconds"], 12), r["layout_label"]) for r in result["layouts"]]
    assert found == price_every_layout(cfg, RUN, H100, 8, budget, 0.0, 0.0, 4)
    assert any(r["setting"] != "none" for r in result["layouts"])
    tflops = [r["tflops_per_gpu"] for r in result["layouts"]]
    assert tflops == sorted(tflops, reverse=True) and tflops[0] > 0


def test_only_layouts_megatron_accepts_with_sp_wherever_tp_runs():
    cfg = small()
    layouts, refused = candidate_layouts(cfg, 8, set(), H100)
    assert layouts and refused  # tp 8 does not divide the 4 heads
    for c in layouts:
        par = c.parallel
        validate(c)
        assert par.world_size == 8
        assert par.sequence_parallel == (par.tensor_model_parallel_size > 1)
        assert par.virtual_pipeline_model_parallel_size is None or par.pipeline_model_parallel_size > 1
        assert par.expert_model_parallel_size == 1  # a dense model
        assert cfg.training.seq_length % (2 * par.context_parallel_size) == 0
        assert par.use_distributed_optimizer
    moe = config("tiny-moe", training__framework="megatron", training__global_batch_size=16)
    eps = {c.parallel.expert_model_parallel_size for c in candidate_layouts(moe, 8, set(), H100)[0]}
    assert eps > {1} and all(moe.model.num_moe_experts % ep == 0 for ep in eps)


def test_static_memory_depends_on_neither_the_virtual_stages_nor_the_micro_batch():
    cfg = with_setting(small(), tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2,
                       sequence_parallel=True, use_distributed_optimizer=True)
    variants = [with_setting(cfg, virtual_pipeline_model_parallel_size=vp) for vp in (None, 2, 4)]
    variants.append(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, micro_batch_size=2)))
    assert len({static_key(c) for c in variants}) == 1
    assert len({static_bytes(c, RUN) for c in variants}) == 1


def test_the_cli_ranks_layouts_keeps_the_fixed_sizes_and_prints_their_flags():
    r = invoke(*SEARCH, "-w", "tiny", "--set", "model.num_layers=8", "--global-batch-size", "16", "--gpus", "8",
               "--tp", "2", "--memory-gb", "80", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["fixed"] == ["tensor_model_parallel_size"] and len(out["layouts"]) == 3
    for row in out["layouts"]:
        lay = row["layout"]
        assert lay["tensor_model_parallel_size"] == 2 and lay["sequence_parallel"]
        lm = row["flags"]["megatron_lm"]
        assert lm[:4] == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                          str(lay["pipeline_model_parallel_size"])]
        assert "-tp 2" in " ".join(row["flags"]["bridge_perf_script"])
        assert "recipe.trainer.strategy.tensor_model_parallel_size = 2" in row["flags"]["nemo2"]
    assert "best layouts that fit" in r.stderr and "Megatron-LM:" in r.stderr


def test_bad_input_gets_one_line_and_exit_2():
    no_gpus = invoke(*SEARCH, "-w", "llama3-70b", "--memory-gb", "80")
    assert no_gpus.exit_code == 2 and "--gpus" in no_gpus.stderr and len(no_gpus.stderr.strip().splitlines()) == 1
    small_budget = invoke(*SEARCH, "-w", "llama3-70b", "--gpus", "64", "--memory-gb", "10")
    assert small_budget.exit_code == 2 and "before any activation in every layout" in small_budget.stderr
    assert len(small_budget.stderr.strip().splitlines()) == 1
    refused = invoke(*SEARCH, "-w", "llama3-70b", "--gpus", "64", "--memory-gb", "80", "--tp", "3")
    assert refused.exit_code == 2 and "tensor_model_parallel_size 3" in refused.stderr
    harness = invoke("plan", "--search-layouts", "-w", "tiny", "--gpus", "8", "--memory-gb", "80")
    assert harness.exit_code == 2 and "--framework megatron" in harness.stderr
    too_many = invoke(*SEARCH, "-w", "tiny", "--gpus", "8", "--tp", "4", "--pp", "4", "--memory-gb", "80")
    assert too_many.exit_code == 2 and "no layout of 8 GPUs" in too_many.stderr
