"""Expert parallel (`--ep`) over 2 CPU ranks under torchrun with gloo, on tiny-moe (8 experts, top-2,
a shared expert, grouped GEMM; seq 32, fp32, one measured step): the same losses as one rank, the
experts split 4 + 4, per-rank activation bytes against the estimate, verify with the MoE recompute
modules, and Megatron's rules on ep as one line, exit 2. Two launches in all (~25 s)."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU, LOSS_RTOL, RANK_SETS, config, invoke, measure

from recompute_bench.analysis.harness.rank import record_estimate
from recompute_bench.config.schema import RecomputeConfig
from recompute_bench.launch.torchrun import Launch, check_launch, run_ranks, verify_over_ranks
from recompute_bench.models import spec_for
from recompute_bench.results.rows import key_fields

SLOW = pytest.mark.slow  # launches ranks: `make test-all`; the pure logic here runs in the fast lane


@SLOW
def test_expert_parallel_over_two_ranks_matches_one_rank(tmp_path):
    launch = Launch(nproc_per_node=2)
    cfg = check_launch(config("tiny-moe", sets=RANK_SETS, parallel__expert_model_parallel_size=2), launch, "cpu")
    record = run_ranks(cfg, launch, name="ep", pieces=tmp_path / "pieces", log_path=tmp_path / "ep.log", timeout_s=180)
    assert record["status"] == "ok", record["failure"]
    single = measure(config("tiny-moe", sets=RANK_SETS))

    # The record carries ep in its config and in the golden key.
    assert record["config"]["parallel"]["expert_model_parallel_size"] == 2
    assert key_fields(record)["expert_model_parallel_size"] == "2"
    # The whole model's parameters, though each rank holds 4 of the 8 experts of each layer.
    assert record["metrics"]["num_parameters"] == single["metrics"]["num_parameters"]

    # Same weights and tokens: the global batch's losses, first step and after one update. Only the
    # order in which an expert's gradient sums the two micro-batches' rows differs (one grouped
    # matmul over both ranks' rows against two micro-batches summed): fp32 rounding, 1e-6 relative.
    for rank in record["ranks"]:
        assert rank["losses"] == pytest.approx(single["ranks"][0]["losses"], rel=LOSS_RTOL)

    # Rows each rank's experts received: summed over the ranks, every token's k copies (2 layers x
    # 64 tokens x top-2 per rank), however the router spread them.
    local_experts, moe_layers = 4, 2
    rows = [r["tokens_per_expert_mean"] * local_experts * moe_layers for r in record["ranks"]]
    assert sum(rows) == 2 * moe_layers * 64 * 2

    # Activation bytes: over the ranks, exactly one rank's own (whole-model) bytes plus the
    # dispatch's two sort indices per routed row, as the spec counts them; per rank they move by
    # the bytes kept per routed row x (rows received - uniform share), within 2% of the uniform
    # estimate on this routing.
    acts = [r["activation_bytes"] for r in record["ranks"]]
    estimate = record["metrics"]["estimated_activation_bytes"]
    no_ep = record_estimate(config("tiny-moe", sets=RANK_SETS, parallel__data_parallel_size=2), "cpu")
    assert sum(acts) / 2 == single["metrics"]["activation_bytes"] + estimate - no_ep["estimated_activation_bytes"]
    saved = spec_for(cfg.model).layer_saved_bytes(cfg, [], "cpu")  # every layer of tiny-moe is a MoE layer
    per_row = sum(v for k, v in saved.items() if k.startswith(("experts.linear", "experts.silu", "experts.activation",
                                                               "experts.permuted", "dispatch."))) / (64 * 2)
    assert acts[0] - acts[1] == (rows[0] - rows[1]) * per_row
    for a in acts:
        assert a == pytest.approx(estimate, rel=0.02)


@SLOW
def test_verify_over_two_ranks_with_expert_parallel_is_exact(tmp_path):
    launch = Launch(nproc_per_node=2)
    cfg = check_launch(config("tiny-moe", sets=["training.seq_length=32"], parallel__expert_model_parallel_size=2),
                       launch, "cpu")
    settings = [RecomputeConfig("selective", mods) for mods in
                (["moe"], ["moe_act"], ["shared_experts"], ["moe", "moe_act", "shared_experts"])]
    result = verify_over_ranks(cfg, settings, ["sdpa"], launch, work=tmp_path, timeout_s=180)
    # Each MoE recompute module under ep (moe re-runs the all-to-all in backward): bitwise, dropout on.
    assert [(o["setting"], o["loss_diff"], o["max_grad_diff"]) for o in result["outcomes"]] == [
        (s.label, 0.0, 0.0) for s in settings]
    # The experts gathered from both ranks against one rank running both micro-batches: fp32
    # rounding of the expert gradients' sums (measured 0 for the loss, 3.5e-10 for a gradient).
    [single] = result["single_rank"]
    assert single["loss_diff"] <= 1e-6 and single["max_grad_diff"] <= 1e-6


@pytest.mark.parametrize("args, words", [
    (["-w", "tiny", "--nproc-per-node", "2", "--ep", "2"], "needs a mixture-of-experts model"),
    (["-w", "tiny-moe", "--nproc-per-node", "2", "--ep", "3"], "num_moe_experts 8 is not divisible by expert_model_parallel_size 3"),
    (["-w", "tiny-moe", "--ep", "2"], "must divide the data-parallel size 1"),
    (["-w", "tiny-moe", "--nproc-per-node", "2", "--ep", "4"], "must divide the data-parallel size 2"),
    (["-w", "tiny-moe", "--nproc-per-node", "2", "--ep", "0"], "must be a positive integer"),
    (["-w", "tiny-moe", "--nproc-per-node", "2", "-ep", "2", "--data-parallel", "fsdp"], "expert parallel with FSDP"),
])
def test_bad_expert_parallel_sizes_are_one_line_exit_2(tmp_path, args, words):
    result = invoke("run", "--device", "cpu", "--results", str(tmp_path / "r.jsonl"), *args)
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r.jsonl").exists()


def test_estimate_divides_the_routed_experts_by_ep():
    one, two = (config("tiny-moe", parallel__data_parallel_size=2, parallel__expert_model_parallel_size=ep)
                for ep in (1, 2))
    spec = spec_for(one.model)
    expert_weights = 8 * 3 * 64 * 64  # per MoE layer: 8 experts of SwiGLU fc1 (2 x 64 x 64) and fc2 (64 x 64)
    assert spec.layer_parameters(one)["sharded"] - spec.layer_parameters(two)["sharded"] == expert_weights / 2
    result = invoke("estimate", "-w", "tiny-moe", "--ep", "2")
    assert result.exit_code == 2 and "must divide the data-parallel size 1" in result.output


class _LiveBytes:
    """The bytes of the CPU storages that ops create while it is on, and their most at once (a
    storage counts until it is freed): what a build allocates, measured in this process."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        live, self.peak, self.now = {}, 0, 0

        def note(t):
            import weakref
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                return
            storage = t.untyped_storage()
            if storage._cdata in live:
                return
            live[storage._cdata] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)

            def freed(key=storage._cdata):
                self.now -= live.pop(key, 0)
            weakref.finalize(storage, freed)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    note(t)
                return out

        self.mode = Mode()


def test_the_expert_parallel_build_allocates_only_this_ranks_experts(monkeypatch):
    # Rank 0 of ep 2 (torch's fake process group for its peer: the build needs no collective). The
    # build slices the experts on the meta device, so the rank allocates its 4 experts of 8 and one
    # whole parameter at a time while initialising it (mixtral-8x7b's experts are 93 GB in bf16;
    # built whole and sliced after, they were allocated on every rank first). The values are the
    # single-rank build's rows.
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from recompute_bench.measure.data_parallel import DataParallel
    from recompute_bench.measure.layout import SingleRank

    sets = ["training.precision=fp32", "model.hidden_size=256", "model.moe_ffn_hidden_size=512", "model.ffn_hidden_size=512"]
    cfg = config("tiny-moe", sets=sets, parallel__expert_model_parallel_size=2, parallel__data_parallel_size=2)
    whole = {n: p for n, p in SingleRank().build(cfg, CPU).named_parameters()}
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        layout = DataParallel("ddp", cfg, "cpu")
        live = _LiveBytes()
        with live.mode:
            model = layout.build(cfg, CPU)
        mine = dict(model.named_parameters())
        experts = {n for n, p in mine.items() if any(p is e for e in layout.experts)}
        assert experts and all(mine[n].shape[0] == 4 == whole[n].shape[0] // 2 for n in experts)
        assert all(torch.equal(p, whole[n][:4] if n in experts else whole[n]) for n, p in mine.items())
        local = sum(p.nbytes for p in mine.values())
        largest = max(p.nbytes for p in whole.values())
        assert local < 0.6 * sum(p.nbytes for p in whole.values())
        assert live.peak <= local + largest + 2**20, (live.peak, local, largest)  # plus buffers (RoPE tables)
    finally:
        dist.destroy_process_group()
