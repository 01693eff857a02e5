"""The interleaved schedule's pipeline sends with and without Megatron's overlap_p2p_comm: what a stage
sends per micro-batch (time_model.pipeline_send_ops) and Megatron's rule for turning it off."""

import dataclasses

import pytest
from helpers import config, invoke

from recompute_bench.analysis import gpu_rates
from recompute_bench.analysis.megatron import MegatronRun, time_checks
from recompute_bench.analysis.megatron import time_model as tm

H100 = gpu_rates.datasheet_rates("h100")  # network 50 GB/s a GPU, one direction
RUN = MegatronRun("h100")
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


def test_table_5_s_interleaved_runs_block_on_their_sends_as_2022_megatron_lm_did():
    assert [time_checks.paper_config(m).parallel.overlap_p2p_comm for m in time_checks.PAPER_TABLE3] == \
        [None, False, False, None]
    cfg = time_checks.paper_config("175B")  # pp 8, 3 chunks a stage, tp 8 without sequence parallel
    one = 2048 * 1 * 12288 * 2
    assert [sent(cfg, s) for s in (0, 1, 7)] == [5 * one, 6 * one, 5 * one]
    st = tm.step_time(cfg, MegatronRun("a100"), gpu_rates.achieved_rates("a100"))
    pacing = sum(tm.op_times(tm.pipeline_send_ops(cfg, st.pacing_stage), gpu_rates.achieved_rates("a100")).values())
    assert st.by_class()["pipeline_p2p"] == pytest.approx(64 * pacing) and pacing > 0
