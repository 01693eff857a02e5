"""The interleaved schedule's pipeline sends with and without Megatron's overlap_p2p_comm: what a stage
sends per micro-batch (time_model.pipeline_send_ops), Megatron's rule for turning it off, and the field
read from Megatron-LM arguments and Bridge configs and written back in each framework's flags."""

import dataclasses
import json
import re

import pytest
from helpers import config, invoke

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import MegatronRun, time_checks
from recompute_bench.analysis.megatron import time_model as tm
from recompute_bench.analysis.megatron.flags import layout_pasteable
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.ingest.megatron_argv import read_argv
from recompute_bench.ingest.run_source import read_run

H100 = gpu_rates.datasheet_rates("h100")  # network 50 GB/s a GPU, one direction
RUN = MegatronRun("h100")
SEED_YAML = "tests/data/seed/LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.yaml"
ONE = 2048 // 8 * 1 * 8192 * 2  # one activation: s x b x h / t (sequence parallel), 16-bit


def interleaved(overlap, pp=4, vp=5):
    return config("llama3-70b", training__framework="megatron", parallel__tensor_model_parallel_size=8,
                  parallel__sequence_parallel=True, parallel__pipeline_model_parallel_size=pp,
                  parallel__virtual_pipeline_model_parallel_size=vp, parallel__overlap_p2p_comm=overlap,
                  training__seq_length=2048, training__global_batch_size=16)


def chain_sends(p, vp, stage):
    """Sends a stage makes per micro-batch, counted on the virtual pipeline: chunk c of stage s is
    virtual stage c x p + s; every virtual stage but the last sends its output onward, every one but
    the first its input gradient back."""
    last = p * vp - 1
    return sum((c * p + stage < last) + (c * p + stage > 0) for c in range(vp))


def sent(cfg, stage):
    return sum(op.bytes for op in tm.pipeline_send_ops(cfg, stage))


def test_without_overlap_each_chunk_sends_its_output_and_its_input_gradient_every_micro_batch():
    cfg = interleaved(False)
    assert [sent(cfg, s) for s in range(4)] == [9 * ONE, 10 * ONE, 10 * ONE, 9 * ONE]
    assert [sent(cfg, s) // ONE for s in range(4)] == [chain_sends(4, 5, s) for s in range(4)]
    (op,) = tm.pipeline_send_ops(cfg, 1)
    assert (op.kind, op.group, op.stride) == ("comm", 2, 8)  # the next stage is 8 ranks (a board) away
    assert op.seconds(H100) == 10 * ONE / (400e9 / 8)  # the DGX H100 NIC, one direction
    st = tm.step_time(cfg, RUN, H100)
    pacing = sum(tm.op_times(tm.pipeline_send_ops(cfg, st.pacing_stage), H100).values())
    assert st.by_class()["pipeline_p2p"] == pytest.approx(cfg.num_microbatches * pacing)
    # 1F1B is the same count at one chunk: one send to each neighbour
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, virtual_pipeline_model_parallel_size=None))
    assert [sent(plain, s) // ONE for s in range(4)] == [chain_sends(4, 1, s) for s in range(4)] == [1, 2, 2, 1]


@pytest.mark.parametrize("overlap", [None, True])
def test_with_overlap_on_or_at_megatron_s_default_the_interleaved_sends_cost_nothing(overlap):
    cfg = interleaved(overlap)
    assert cfg.parallel.p2p_overlapped
    assert not any(tm.pipeline_send_ops(cfg, s) for s in range(4))
    on, off = tm.step_time(cfg, RUN, H100), tm.step_time(interleaved(False), RUN, H100)
    assert on.by_class()["pipeline_p2p"] == 0.0 < off.by_class()["pipeline_p2p"]
    assert on.step_seconds < off.step_seconds


def test_1f1b_blocks_whatever_overlap_p2p_comm_says():
    """validate_args forces overlap_p2p_comm False without virtual stages."""
    on = dataclasses.replace(interleaved(True), parallel=dataclasses.replace(
        interleaved(True).parallel, virtual_pipeline_model_parallel_size=None))
    assert not on.parallel.p2p_overlapped
    assert [sent(on, s) for s in range(4)] == [ONE, 2 * ONE, 2 * ONE, ONE]


def test_megatron_s_rule_refuses_the_interleaved_schedule_without_overlap_on_two_stages():
    base = ["estimate", "-w", "llama3-8b", "--framework", "megatron", "--tp", "8", "--gpu", "h100",
            "--global-batch-size", "16", "--set", "parallel.virtual_pipeline_model_parallel_size=2"]
    result = invoke(*base, "--pp", "2", "--set", "parallel.overlap_p2p_comm=false")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: the interleaved schedule without overlap_p2p_comm needs pipeline_model_parallel_size "
                     "over 2 (Megatron's rule), got 2; pass --pipeline-model-parallel-size 3 or more, or drop "
                     "--set parallel.overlap_p2p_comm=false"]
    assert invoke(*base, "--pp", "2").exit_code == 0  # with overlap (the default) two stages interleave
    assert invoke(*base, "--pp", "4", "--set", "parallel.overlap_p2p_comm=false").exit_code == 0
    other = invoke("estimate", "-w", "llama3-8b", "--set", "parallel.overlap_p2p_comm=false")
    assert other.exit_code == 2 and "parallel.overlap_p2p_comm is a Megatron argument" in other.output


ARGV = ("--num-layers 8 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
        "--tokenizer-type NullTokenizer --vocab-size 1000 --bf16 --pipeline-model-parallel-size 4 --global-batch-size 8")


def test_megatron_lm_s_no_overlap_p2p_communication_turns_it_off_where_it_interleaves():
    vp = " --num-virtual-stages-per-pipeline-rank 2"
    off = config_from_megatron(read_argv((ARGV + vp + " --no-overlap-p2p-communication").split()), world_size=4)
    assert off.parallel.overlap_p2p_comm is False and not off.parallel.p2p_overlapped
    default = config_from_megatron(read_argv((ARGV + vp).split()), world_size=4)
    assert default.parallel.overlap_p2p_comm is None and default.parallel.p2p_overlapped
    # a log's argument dump after validate_args says overlap_p2p_comm False
    dump = config_from_megatron({**read_argv((ARGV + vp).split()), "overlap_p2p_comm": "False"}, world_size=4)
    assert dump.parallel.overlap_p2p_comm is False
    # 1F1B: validate_args forces it False, which is what 1F1B does anyway: the field stays unset
    plain = config_from_megatron(read_argv((ARGV + " --no-overlap-p2p-communication").split()), world_size=4)
    assert plain.parallel.overlap_p2p_comm is None


def test_a_bridge_config_s_comm_overlap_setup_turns_it_on_for_virtual_stages_unless_it_says_otherwise(tmp_path):
    seeds = read_run(SEED_YAML, gpus=32, strict=False)
    assert seeds.config.parallel.overlap_p2p_comm is None  # vp 5, comm_overlap.overlap_p2p_comm null: on
    assert seeds.config.parallel == time_checks.seeds_config().parallel
    text = open(SEED_YAML).read()
    stated = tmp_path / "stated.yaml"
    stated.write_text(text.replace("  overlap_p2p_comm: null\n", "  overlap_p2p_comm: false\n"))
    source = read_run(stated, gpus=32, strict=False)
    assert source.config.parallel.overlap_p2p_comm is False
    assert "comm_overlap.overlap_p2p_comm: false" in source.origins["parallel.overlap_p2p_comm"]
    # no comm_overlap section: the model's field, ModelParallelConfig's default False
    bare = tmp_path / "bare.yaml"
    bare.write_text(re.sub(r"\ncomm_overlap:\n(?:  .*\n)+", "\n", text))
    assert "\ncomm_overlap:" not in bare.read_text()
    assert read_run(bare, gpus=32, strict=False).config.parallel.overlap_p2p_comm is False


def test_the_layout_flags_turn_it_off_in_each_framework_s_words_only_where_it_is_off():
    flags = layout_pasteable(interleaved(False))
    assert flags["megatron_lm"][-1] == "--no-overlap-p2p-communication"
    assert flags["bridge"][-2:] == ["cfg.comm_overlap.overlap_p2p_comm = False", "cfg.comm_overlap.batch_p2p_comm = True"]
    assert flags["bridge_perf_script"][-2:] == ["comm_overlap.overlap_p2p_comm=false", "comm_overlap.batch_p2p_comm=true"]
    assert flags["nemo2"][-2:] == ["recipe.model.config.overlap_p2p_comm = False",
                                   "recipe.model.config.batch_p2p_comm = True"]
    for overlap in (None, True):
        assert not any("p2p" in line for lines in layout_pasteable(interleaved(overlap)).values() for line in lines)


def test_the_layout_search_keeps_it_off_refuses_two_interleaved_stages_and_prints_the_flag():
    result = invoke("plan", "--framework", "megatron", "--search-layouts", "--gpu", "h100", "-w", "tiny",
                    "--set", "model.num_layers=16", "--global-batch-size", "16", "--gpus", "8", "--tp", "2",
                    "--set", "parallel.overlap_p2p_comm=false", "--memory-gb", "80", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    flags = {row["layout_label"]: row["flags"]["megatron_lm"] for row in report["layouts"]}
    assert "--no-overlap-p2p-communication" in flags["tp2 pp4 vp2 cp1 dp1 mbs2"]
    assert not any("--no-overlap-p2p-communication" in lm for label, lm in flags.items() if "vp" not in label)
    refused = {r["reason"]: r["layouts"] for r in report["refused"]}
    assert refused["the interleaved schedule without overlap_p2p_comm needs pipeline_model_parallel_size over 2 "
                   "(Megatron's rule), got 2"] > 0


def test_table_5_s_interleaved_runs_block_on_their_sends_as_2022_megatron_lm_did():
    assert [time_checks.paper_config(m).parallel.overlap_p2p_comm for m in time_checks.PAPER_TABLE3] == \
        [None, False, False, None]
    cfg = time_checks.paper_config("175B")  # pp 8, 3 chunks a stage, tp 8 without sequence parallel
    one = 2048 * 1 * 12288 * 2
    # 2022's scatter-gather: each rank sends an eighth of the activation and gathers what it receives whole
    for stage, sends in ((0, 5), (1, 6), (7, 5)):
        send, gather = tm.pipeline_send_ops(cfg, stage)
        assert send.bytes == sends * one / 8 and (send.group, send.stride) == (2, 8)
        assert (gather.collective, gather.group, gather.stride) == ("all_gather", 8, 1)
        assert gather.bytes == sends * 7 / 8 * one  # a ring all-gather sends 7 of the 8 shards
    st = tm.step_time(cfg, MegatronRun("a100"), gpu_rates.achieved_rates("a100"))
    pacing = sum(tm.op_times(tm.pipeline_send_ops(cfg, st.pacing_stage), gpu_rates.achieved_rates("a100")).values())
    assert st.by_class()["pipeline_p2p"] == pytest.approx(64 * pacing) and pacing > 0


def test_scatter_gather_splits_a_send_over_the_tensor_parallel_ranks_only_without_sequence_parallel():
    """Megatron-LM's p2p_communication.py before Megatron Core's pipeline: split_tensor_into_1d_equal_chunks
    before the send, gather_split_1d_tensor after the receive, skipped under sequence parallel."""
    plain = config("llama3-70b", training__framework="megatron", parallel__tensor_model_parallel_size=8,
                   parallel__pipeline_model_parallel_size=4, training__seq_length=2048, training__global_batch_size=16)
    split = dataclasses.replace(plain, parallel=dataclasses.replace(plain.parallel, scatter_gather_tensors_in_pipeline=True))
    whole = 2048 * 8192 * 2
    assert [op.bytes for op in tm.pipeline_send_ops(plain, 1)] == [2 * whole]  # today's Megatron: every rank, whole
    send, gather = tm.pipeline_send_ops(split, 1)
    assert send.bytes == 2 * whole / 8 and gather.bytes == 2 * whole * 7 / 8
    times = tm.op_times(tm.pipeline_send_ops(split, 1), H100)
    assert sum(times.values()) < tm.op_times(tm.pipeline_send_ops(plain, 1), H100)["pipeline.send_recv"] / 4
    sp = dataclasses.replace(split, parallel=dataclasses.replace(split.parallel, sequence_parallel=True))
    assert [op.bytes for op in tm.pipeline_send_ops(sp, 1)] == [2 * whole / 8]  # the shard itself, no gather
