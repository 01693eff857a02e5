"""What each layout's ranks hold for their parameters equals the estimate's bytes per parameter
times the rank's parameters, read back from the live objects on 4 gloo ranks (tiny, seq 32, two
micro-batches per rank): DDP in fp32 and bf16, DDP with expert parallel, FSDP2 in fp32 and bf16,
tensor parallel alone and tensor parallel x FSDP. DDP all-reduces each bucket once per step, inside
the backward; FSDP reduce-scatters once per unit per step (not once per micro-batch) and all-gathers
what the estimate says; the gradients the update reads equal one rank's over the same global batch."""

from __future__ import annotations

import json

import pytest

from helpers import rank_script

pytestmark = pytest.mark.slow  # launches ranks: `make test-all`

WORLD = 4
# No dropout (each rank draws its own masks), micro-batch 1, two micro-batches per data-parallel rank.
COMMON = ["model.hidden_dropout=0", "model.attention_dropout=0", "training.seq_length=32",
          "training.micro_batch_size=1"]


def _sets(precision: str, dp: int, fsdp: bool = False, *extra: str) -> list[str]:
    return [*COMMON, f"training.precision={precision}", f"training.global_batch_size={2 * dp}",
            f"parallel.data_parallel_size={dp}", f"parallel.use_distributed_optimizer={str(fsdp).lower()}", *extra]


LAYOUTS = {  # name -> (data parallel kind, workload, sets, DDP bucket parameters or None: Megatron's)
    "ddp fp32": ("ddp", "tiny", _sets("fp32", WORLD), None),
    "ddp fp32, 50k buckets": ("ddp", "tiny", _sets("fp32", WORLD), 50_000),
    "ddp bf16": ("ddp", "tiny", _sets("bf16", WORLD), None),
    "ddp bf16 ep 2": ("ddp", "tiny-moe", _sets("bf16", WORLD, False, "parallel.expert_model_parallel_size=2"), None),
    "fsdp fp32": ("fsdp", "tiny", _sets("fp32", WORLD, True), None),
    "fsdp bf16": ("fsdp", "tiny", _sets("bf16", WORLD, True), None),
    "tp 4 bf16": ("ddp", "tiny", _sets("bf16", 1, False, f"parallel.tensor_model_parallel_size={WORLD}",
                                       "parallel.sequence_parallel=true"), None),
    "tp 2 x fsdp 2 bf16": ("fsdp", "tiny", _sets("bf16", 2, True, "parallel.tensor_model_parallel_size=2",
                                                 "parallel.sequence_parallel=true"), None),
    # context parallel: gradients reduced (DDP) or sharded with the optimizer state (FSDP) over dp x cp
    "ddp 2 x cp 2 bf16": ("ddp", "tiny", _sets("bf16", 2, False, "parallel.context_parallel_size=2"), None),
    "fsdp 2 x cp 2 bf16": ("fsdp", "tiny", _sets("bf16", 2, True, "parallel.context_parallel_size=2"), None),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every layout on 4 ranks in one torchrun launch (optimizer_bytes_ranks.py): each rank's results."""
    return rank_script("optimizer_bytes_ranks.py", tmp_path_factory.mktemp("held"), json.dumps(LAYOUTS), nproc=WORLD,
                       timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_what_a_rank_holds_is_the_estimate(ranks, layout):
    for rank in ranks:
        r = rank[layout]
        held, params = r["held"], r["parameters"]
        assert r["num_microbatches"] == 2
        # The estimate's parameters of a rank are this rank's (its tensor-parallel and expert
        # shards), which FSDP shards further over dp.
        assert r["parameters_local"] * r["fsdp_shards"] == params
        # After the first micro-batch's backward (FSDP: its unsharded fp32 gradients kept, nothing
        # all-gathered left), and when the step begins (FSDP: the reduce-scattered shards instead).
        assert r["after_first_microbatch"] == sum(h["per_parameter"] for h in held if h["backward"]) * params
        assert r["at_step"] == sum(h["per_parameter"] for h in held if h["step"]) * params


def test_no_layout_keeps_a_16_bit_gradient_or_a_bucket_copy(ranks):
    # Megatron's scheme everywhere but FSDP: 18 bytes per parameter in bf16 (2 + 4 + 4 + 8), 16 in fp32.
    for name in ("ddp bf16", "ddp bf16 ep 2", "tp 4 bf16", "ddp 2 x cp 2 bf16"):
        r = ranks[0][name]
        assert r["at_step"] == r["after_first_microbatch"] == 18 * r["parameters_local"]
    assert ranks[0]["ddp fp32"]["at_step"] == 16 * ranks[0]["ddp fp32"]["parameters_local"]


def test_ddp_reduces_each_bucket_once_per_step_during_the_backward(ranks):
    for rank in ranks:
        # One bucket for tiny's 0.2 M parameters (Megatron's 40 M); with expert parallel a second one
        # for the experts, over the ranks that hold the same experts; 5 of 50 k parameters each.
        for name, buckets in (("ddp fp32", 1), ("ddp bf16", 1), ("ddp bf16 ep 2", 2), ("ddp fp32, 50k buckets", 5),
                              ("ddp 2 x cp 2 bf16", 1)):
            r = rank[name]
            assert r["buckets"] == r["all_reduce"] == buckets and r["reduce_scatter_single"] == 0
            # Every bucket's all-reduce started inside the last micro-batch's backward, none after it.
            assert r["buckets_started_in_backward"] == buckets


def test_fsdp_reduce_scatters_once_per_unit_per_step(ranks):
    for rank in ranks:
        # One reduce-scatter per unit (tiny's 4 layers and the root) per step, from the last
        # micro-batch's backward only: 5, not 2 x 5.
        # No gradient is all-reduced; under tensor parallel the only all-reduces are the
        # vocabulary-parallel cross-entropy's (max, target logit, sum of exponentials over the
        # tensor-parallel group) in each of the 2 micro-batches' forwards.
        for name, loss_all_reduces in (("fsdp fp32", 0), ("fsdp bf16", 0), ("tp 2 x fsdp 2 bf16", 3 * 2),
                                       ("fsdp 2 x cp 2 bf16", 0)):
            assert rank[name]["reduce_scatter_single"] == 4 + 1
            assert rank[name]["all_reduce"] == loss_all_reduces


@pytest.mark.parametrize("layout", ["fsdp fp32", "fsdp bf16", "tp 2 x fsdp 2 bf16", "fsdp 2 x cp 2 bf16"])
def test_fsdp_all_gathers_the_root_and_two_layers_in_backward(ranks, layout):
    # The most all-gathered weights alive in a backward: the root's (kept from forward) and two
    # layers' (the one in backward and the one prefetched), as the estimate counts them.
    for rank in ranks:
        r = rank[layout]
        modelled = r["fsdp_unsharded"]
        assert r["all_gathered_peak_in_backward"] == (modelled["FSDP: all-gathered weights outside the layers"]
                                                      + modelled["FSDP: all-gathered weights of two layers (in backward, prefetched)"])


@pytest.mark.parametrize("layout", ["ddp fp32", "ddp fp32, 50k buckets", "fsdp fp32"])
def test_the_update_reads_one_ranks_gradients(ranks, layout):
    r = ranks[0][layout]
    assert r["grad_names_match"]
    # fp32: the same micro-batch gradients, summed in another order (ranks, then the reduction).
    assert r["max_relative_grad_diff"] < 1e-5
