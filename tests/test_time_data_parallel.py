"""The data-parallel gradient reduce and parameter all-gather a Megatron step leaves exposed
(analysis/megatron/time_data_parallel.py): bytes over the link the group spans, what the overlaps
hide, and the flags read from a run's files."""

import dataclasses
import json

import pytest
from helpers import config, invoke

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import MegatronRun
from recompute_bench.analysis.megatron import time_data_parallel as tdp
from recompute_bench.analysis.megatron import time_model as tm
from recompute_bench.analysis.megatron.parameters import layer_parameter_groups, stage_parameter_groups
from recompute_bench.analysis.megatron.time_ops import ring_bytes
from recompute_bench.ingest.run_source import read_run

H100 = gpu_rates.datasheet_rates("h100")  # NVLink 450 GB/s, network 50 GB/s a GPU, one direction
RUN = MegatronRun("h100")


def megatron(**overrides):
    base = {"training__seq_length": 2048, "training__micro_batch_size": 1, "training__framework": "megatron"}
    return config("llama3-8b", **{**base, **overrides})


def step(cfg, rates=H100):
    params = [stage_parameter_groups(cfg, s) for s in range(cfg.parallel.pipeline_model_parallel_size)]
    return tm.step_time(cfg, RUN, rates, params)


def replace(cfg, **parallel):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def test_dp_2_within_nvlink_all_reduces_every_fp32_gradient_over_nvlink():
    """tp 4 x dp 2 = 8 ranks: one HGX board. Without the distributed optimizer DDP all-reduces the fp32
    grad buffer: each rank sends 2 x (2 - 1)/2 of it; nothing is gathered."""
    cfg = megatron(parallel__tensor_model_parallel_size=4, parallel__data_parallel_size=2,
                   training__global_batch_size=8)
    n = stage_parameter_groups(cfg, 0)["dense"]
    st = step(cfg)
    assert st.data_parallel["grad_reduce"] == pytest.approx(2 * 0.5 * n * 4 / H100.link_bytes_per_s)
    assert st.data_parallel["param_gather"] == 0.0
    assert st.by_class()["data_parallel_exposed"] == pytest.approx(st.data_parallel_seconds)
    one = replace(cfg, data_parallel_size=1)  # the same micro-batches on one data-parallel rank
    without = step(dataclasses.replace(one, training=dataclasses.replace(cfg.training, global_batch_size=4)))
    assert st.step_seconds == pytest.approx(without.step_seconds + st.data_parallel_seconds)


def test_dp_16_across_nodes_reduce_scatters_and_gathers_over_the_network():
    """dp 16 of consecutive ranks spans two boards: the ring runs at the network's rate. The distributed
    optimizer reduce-scatters the fp32 gradients and all-gathers the bf16 parameters, 15/16 of each."""
    cfg = megatron(parallel__data_parallel_size=16, parallel__use_distributed_optimizer=True,
                   training__global_batch_size=16)
    n = stage_parameter_groups(cfg, 0)["dense"]
    st = step(cfg)
    assert st.data_parallel["grad_reduce"] == pytest.approx(15 / 16 * n * 4 / H100.network_bytes_per_s)
    assert st.data_parallel["param_gather"] == pytest.approx(15 / 16 * n * 2 / H100.network_bytes_per_s)
    assert tdp.bucket_size(cfg) == 40_000_000 and tdp.bucket_size(replace(cfg, data_parallel_size=64)) == 64_000_000


def test_dp_1_prices_no_data_parallel_traffic():
    cfg = megatron(parallel__use_distributed_optimizer=True, parallel__overlap_grad_reduce=True)
    assert step(cfg).data_parallel == {"grad_reduce": 0.0, "param_gather": 0.0}
    assert step(cfg).by_class()["data_parallel_exposed"] == 0.0


def test_the_overlaps_leave_the_last_bucket_and_the_first_gather_exposed():
    """With one layer's parameters a bucket, the last bucket is the embedding alone (DDP fills buckets
    from the output layer back): its reduce-scatter and its gather are what the overlaps leave."""
    cfg = megatron(parallel__data_parallel_size=16, parallel__use_distributed_optimizer=True,
                   training__global_batch_size=16)
    layer = layer_parameter_groups(cfg, 0)["dense"]
    overlapped = replace(cfg, overlap_grad_reduce=True, overlap_param_gather=True, ddp_bucket_size=int(layer))
    embedding = cfg.vocab_rows * cfg.model.hidden_size
    traffic = tdp.stage_traffic(overlapped, H100, 0)
    assert traffic.reduce_tail == pytest.approx(15 / 16 * embedding * 4 / H100.network_bytes_per_s)
    assert traffic.gather_head == pytest.approx(15 / 16 * embedding * 2 / H100.network_bytes_per_s)
    plain, both = step(cfg), step(overlapped)
    assert both.data_parallel["grad_reduce"] < plain.data_parallel["grad_reduce"]
    assert both.data_parallel["param_gather"] < plain.data_parallel["param_gather"]
    assert both.data_parallel["grad_reduce"] >= traffic.reduce_tail  # the last bucket is never hidden
    assert both.data_parallel["param_gather"] >= traffic.gather_head
    # one bucket of everything (a bucket larger than the model): nothing to overlap
    whole = tdp.stage_traffic(replace(overlapped, ddp_bucket_size=10**12), H100, 0)
    assert whole.reduce_tail == pytest.approx(whole.reduce)


def test_the_reduce_that_outlasts_the_backward_window_stays_exposed():
    """Hand numbers through `data_parallel_seconds`: under overlap_grad_reduce a stage exposes
    max(its last bucket, all its buckets - its backward of one micro-batch); a later stage's part of
    the last micro-batch's backward ends before the first stage's, which leads it by that backward."""
    cfg = megatron(parallel__data_parallel_size=16, parallel__use_distributed_optimizer=True,
                   parallel__pipeline_model_parallel_size=2, training__global_batch_size=32)
    t0, t1 = (tdp.stage_traffic(cfg, H100, s) for s in (0, 1))
    forward, backward, none = [0.01, 0.01], [0.02, 0.02], [0.0, 0.0]
    plain = tdp.data_parallel_seconds(cfg, H100, forward, backward, none, none)
    assert plain["grad_reduce"] == pytest.approx(max(t0.reduce, t1.reduce - backward[0]))
    assert plain["param_gather"] == pytest.approx(max(t0.gather, t1.gather - forward[0]))
    on = replace(cfg, overlap_grad_reduce=True, overlap_param_gather=True)
    t0, t1 = (tdp.stage_traffic(on, H100, s) for s in (0, 1))
    assert t1.reduce_tail == pytest.approx(t1.reduce)  # pp rank 1 is not bucketed: one bucket, filled last
    short = [t0.reduce / 10] * 2  # a window far shorter than the reduce: most of it stays exposed
    assert tdp.data_parallel_seconds(on, H100, forward, short, none, none)["grad_reduce"] == \
        pytest.approx(max(t0.reduce - short[0], t1.reduce - short[0]))
    long = [10 * t0.reduce] * 2
    assert tdp.data_parallel_seconds(on, H100, forward, long, none, none)["grad_reduce"] == pytest.approx(t0.reduce_tail)


def test_gradients_reduced_in_bf16_send_half_the_bytes():
    cfg = megatron(parallel__data_parallel_size=16, parallel__use_distributed_optimizer=True,
                   training__global_batch_size=16)
    bf16 = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, grad_reduce_in_bf16=True))
    assert tdp.stage_traffic(bf16, H100, 0).reduce == pytest.approx(tdp.stage_traffic(cfg, H100, 0).reduce / 2)


def test_fp8_param_gather_gathers_the_fp8_layers_linear_weights_in_one_byte():
    from recompute_bench.analysis.megatron.layer import layer_linear_weights
    cfg = megatron(parallel__data_parallel_size=16, parallel__use_distributed_optimizer=True,
                   training__global_batch_size=16, training__precision="fp8", training__fp8_recipe="tensorwise")
    fp8 = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, fp8_param_gather=True))
    linear = cfg.model.num_layers * sum(r * c for r, c in layer_linear_weights(cfg, 0).values())
    saved = tdp.stage_traffic(cfg, H100, 0).gather - tdp.stage_traffic(fp8, H100, 0).gather
    assert saved == pytest.approx(15 / 16 * linear * (2 - 1) / H100.network_bytes_per_s)


def test_the_layout_search_prices_the_data_parallel_traffic():
    """Each layout the search ranks is priced with its data-parallel reduce and gather, so a layout
    with more data parallel pays for its traffic; the search's flags carry the overlaps where set."""
    from recompute_bench.analysis.megatron.layouts import candidate_layouts, layout_label, search_layouts
    from recompute_bench.config.schema import RecomputeConfig, with_setting
    cfg = config("tiny", training__framework="megatron", model__num_layers=8, model__hidden_size=256,
                 model__num_attention_heads=8, model__ffn_hidden_size=1024, model__max_position_embeddings=1024,
                 training__seq_length=1024, training__global_batch_size=16, training__micro_batch_size=1,
                 parallel__use_distributed_optimizer=True, parallel__overlap_grad_reduce=True)
    result = search_layouts(cfg, RUN, H100, 16, 80 * 2**30, 0.0, 0.0, top=6)
    layouts = {layout_label(c): c for c in candidate_layouts(cfg, 16, set(), H100)[0]}
    priced = 0
    for row in result["layouts"]:
        st = step(with_setting(layouts[row["layout_label"]], RecomputeConfig(**row["recompute"])))
        assert row["step_seconds"] == pytest.approx(st.step_seconds)
        priced += st.data_parallel_seconds > 0
        assert "--overlap-grad-reduce" in row["flags"]["megatron_lm"]
    assert priced  # the fastest layouts at 16 GPUs run data parallel, and pay for it


# ----- the flags, read and printed -------------------------------------------------------------

SEED_YAML = "tests/data/seed/LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.yaml"


def test_the_seeds_bridge_config_runs_with_the_overlaps_bridge_sets_at_setup():
    """The dump says ddp.overlap_grad_reduce: false, but the run's distributed optimizer and
    comm_overlap section hand both overlaps and 128 Mi-element buckets to DDP at dp 2
    (CommOverlapConfig.setup); the origin names why."""
    source = read_run(SEED_YAML, gpus=32, strict=False)
    p = source.config.parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.ddp_bucket_size) == (True, True, 128 * 1024 * 1024)
    assert "CommOverlapConfig.setup sets overlap_grad_reduce True" in source.origins["parallel.overlap_grad_reduce"]


def test_a_bridge_config_s_comm_overlap_values_win_and_without_it_the_ddp_section_s(tmp_path):
    text = open(SEED_YAML).read()
    stated = tmp_path / "stated.yaml"
    stated.write_text(text.replace("  overlap_grad_reduce: null\n", "  overlap_grad_reduce: false\n")
                      .replace("  overlap_param_gather: null\n", "  overlap_param_gather: false\n")
                      .replace("  bucket_size: null\n  data_parallel_size: null",
                               "  bucket_size: 50000000\n  data_parallel_size: null"))
    p = read_run(stated, gpus=32, strict=False).config.parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.ddp_bucket_size) == (False, False, 50_000_000)
    no_dist = tmp_path / "ddp.yaml"
    no_dist.write_text(text.replace("  use_distributed_optimizer: true\n  use_megatron_fsdp",
                                    "  use_distributed_optimizer: false\n  use_megatron_fsdp")
                       .replace("  overlap_grad_reduce: false\n  overlap_param_gather: false",
                                "  overlap_grad_reduce: true\n  overlap_param_gather: false"))
    p = read_run(no_dist, gpus=32, strict=False).config.parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.ddp_bucket_size) == (True, False, None)


def test_plan_prices_the_seeds_data_parallel_traffic_and_the_search_prints_the_ddp_flags():
    from recompute_bench.analysis.megatron.time_checks import seeds_config
    result = invoke("plan", "--from", SEED_YAML, "--gpus", "32", "--memory-gb", "80", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["recommended"] == "none"  # the recipe's own setting fits
    # at dp 2 within a board, both overlapped: the last bucket (stage 0's embedding, 128256 x 8192 / tp 4
    # in bf16 gradients) reduce-scattered, and its gather, each NCCL's collective of its size over NVLink
    embedding = 128256 * 8192 / 4
    h100 = gpu_rates.achieved_rates("h100")
    priced = sum(h100.comm_seconds(ring_bytes(kind, 2 * embedding, 2), 2, 4, "ring", kind)
                 for kind in ("reduce_scatter", "all_gather"))
    assert priced == pytest.approx(sum(h100.collective_seconds(embedding, 2, kind) for kind in ("reduce_scatter", "all_gather")))
    assert priced > 2 * 0.5 * embedding * 2 / h100.link_bytes_per_s  # below the plateau's rate at this size
    assert report["time_parts"]["by_class"]["data_parallel_exposed"] == pytest.approx(priced)
    assert step(seeds_config(), gpu_rates.achieved_rates("h100")).data_parallel_seconds == \
        pytest.approx(report["time_parts"]["by_class"]["data_parallel_exposed"])
    row = report["settings"][0]
    assert row["step_parts"]["data_parallel_exposed"] > 0
    search = invoke("plan", "--framework", "megatron", "--search-layouts", "--gpu", "h100", "-w", "tiny",
                    "--set", "model.num_layers=8", "--global-batch-size", "16", "--gpus", "8", "--tp", "2",
                    "--use-distributed-optimizer", "--set", "parallel.overlap_grad_reduce=true",
                    "--set", "parallel.ddp_bucket_size=1000000", "--memory-gb", "80", "--json")
    assert search.exit_code == 0, search.output
    lm = json.loads(search.stdout)["layouts"][0]["flags"]["megatron_lm"]
    assert "--overlap-grad-reduce" in lm and lm[lm.index("--ddp-bucket-size") + 1] == "1000000"
    assert "--overlap-param-gather" not in lm  # only what is set


def test_megatron_lm_s_arguments_set_the_overlaps_and_the_bucket():
    from recompute_bench.ingest.megatron_args import config_from_megatron
    args = {"--num-layers": 4, "--hidden-size": 256, "--num-attention-heads": 8, "--seq-length": 512,
            "--max-position-embeddings": 512, "--tokenizer-type": "NullTokenizer", "--vocab-size": 1000, "--bf16": True,
            "--use-distributed-optimizer": True}
    p = config_from_megatron(args, world_size=2).parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.ddp_bucket_size) == (False, False, None)  # Megatron's defaults
    p = config_from_megatron({**args, "--overlap-grad-reduce": True, "--overlap-param-gather": True,
                              "--ddp-bucket-size": 50_000_000}, world_size=2).parallel
    assert (p.overlap_grad_reduce, p.overlap_param_gather, p.ddp_bucket_size) == (True, True, 50_000_000)


@pytest.mark.parametrize("sets,words", [
    (["--set", "parallel.overlap_param_gather=true", "--set", "parallel.overlap_grad_reduce=true"],
     "pass --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--set", "parallel.overlap_param_gather=true"], "needs overlap_grad_reduce"),
    (["--set", "parallel.ddp_bucket_size=0"], "ddp_bucket_size must be a positive number"),
])
def test_megatron_s_rules_for_the_overlaps_refuse_in_one_line(sets, words):
    result = invoke("estimate", "-w", "llama3-8b", "--framework", "megatron", "--dp", "2", "--gpu", "h100", *sets)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.output
