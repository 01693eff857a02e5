"""The time model against the two public measurements of recompute's cost in time, side by side.
The goal: each predicted relative throughput within 3 percentage points of the measured one
(`tests/test_time_model.py` holds it; `python bench/time_model_check.py` prints both tables).

- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 4: one layer of the 22B GPT (h 6144, 64 heads, s 2048, b 4, GeLU MLP 4h, LayerNorm,
  dropout 0.1) with tensor parallel 8 on A100, forward plus backward: no recompute 19.6 ms, full
  recompute 27.2 ms, selective (the core attention) 20.9 ms. Megatron's own layers then: local
  attention with the fused scale-mask-softmax kernel, no sequence parallel (that row is separate).
- The seeds' experiment table (seeds/003, Megatron Bridge's activation-recompute skill): Llama 3
  70B SFT in FP8 (current scaling) on 32 H100 (Bridge's LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1: tp 4,
  sequence parallel, pp 4, vp 5, micro-batch 1, global batch 32, seq 4096, distributed optimizer,
  Transformer Engine), TFLOP/s per GPU: [core_attn] ~704 (the baseline row), [mlp] 593.6,
  [mlp, core_attn] 586.8, [core_attn, layernorm] ~702. The issue reads them relative to no
  recompute at ~704; the table measured them against the [core_attn] row, so both readings are
  predicted (the run's "vs golden" column puts no recompute about 0.8% above [core_attn]).

The seeds' Config is the one `plan --from` reads from the Bridge config shipped as test data
(tests/test_plan_from.py holds them equal). Nothing here is fitted: the rates are the GPU table's
(`gpu_rates.achieved_rates`: the GPU table's datasheets and microbenchmarks). Absolute step time is
checked too: the seeds' four rows and Table 5's iterations of the 22B, 175B, 530B and 1T models
(`paper_table5_rows`), goal within 10%.
Pure Python.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from recompute_bench.analysis.gpu_rates import GpuRates, achieved_rates
from recompute_bench.analysis.megatron.gpu import MegatronRun
from recompute_bench.analysis.megatron.parameters import stage_parameter_groups
from recompute_bench.analysis.megatron.time_model import layer_seconds, step_time
from recompute_bench.config.schema import Config, RecomputeConfig
from recompute_bench.recompute.policy import LayerPolicy

GOAL_POINTS = 0.03
"""Each predicted relative throughput within 3 percentage points of the measured one."""

PAPER_TABLE4_MS = {"none": 19.6, "full": 27.2, "selective": 20.9}
PAPER_TABLE4_PASSES_MS = {"none": (7.7, 11.9), "full": (7.7, 19.5), "selective": (7.7, 13.2)}
"""Table 4's forward and backward milliseconds (the backward with what recompute re-runs in it)."""
PAPER_TABLE5_S = {"22B": {"full": 1.42, "sequence parallel + selective": 1.10},
                  "175B": {"full": 18.13, "sequence parallel + selective": 13.75},
                  "530B": {"full": 49.05, "sequence parallel + selective": 37.83},
                  "1T": {"full": 94.42, "sequence parallel + selective": 71.49}}
"""Table 5's iteration seconds by model: full recompute without sequence parallel, and sequence parallel
with selective recompute (the paper's "present work")."""
PAPER_TABLE3 = {"22B": ("gpt3-22b", 1, None, 4), "175B": ("gpt3-175b", 8, 3, 64), "530B": ("gpt3-530b", 35, 3, 280),
                "1T": ("gpt3-1t", 64, None, 512)}
"""Table 3's layouts (workload, pp, virtual stages, global batch; all tp 8, no data parallel, micro-batch
as the workload: 4 for 22B, 1 beside): 175B and 530B run the interleaved schedule with 3 model chunks
a stage (the paper's m = 3), 22B and 1T without it."""
PAPER_TABLE5_SOURCE = ("Korthikanti et al. 2022, Tables 3 and 5: 22B, 175B, 530B, 1T on 8, 64, 280, 512 A100 "
                       "(tp 8, no data parallel), iteration time")
GOAL_ABSOLUTE = 0.10
"""In-sample goal for absolute step time: within 10% of the measured one."""
PAPER_SOURCE = "Korthikanti et al. 2022, Table 4: 22B, tp 8, A100, one layer forward + backward"
SEEDS_TFLOPS = {"selective[core_attn]": 704.0, "selective[mlp]": 593.6, "selective[core_attn,mlp]": 586.8,
                "selective[core_attn,layernorm]": 702.0}
SEEDS_BASELINE = "selective[core_attn]"
SEEDS_SOURCE = "seeds/003: Llama 3 70B SFT FP8 (current scaling), 32 x H100, tp 4 +sp, pp 4, vp 5"


def paper_config(model: str = "22B") -> Config:
    """A model of Table 3 laid out as the paper ran it (tp 8, its pp, virtual stages and global batch),
    with Megatron's local layers and attention of the time, in fp16, and the interleaved schedule's
    sends blocking between chunks as they did then (no overlap_p2p_comm), each split over the tensor-parallel
    ranks without sequence parallel (scatter_gather_tensors_in_pipeline, Megatron-LM's default then)."""
    from recompute_bench.workload import resolve

    workload, pp, vp, global_batch = PAPER_TABLE3[model]
    overrides = {"training.framework": "megatron", "model.transformer_impl": "local",
                 "model.attention_backend": "local", "training.precision": "fp16",
                 "parallel.tensor_model_parallel_size": 8, "parallel.pipeline_model_parallel_size": pp,
                 "training.global_batch_size": global_batch,
                 # on by default from Megatron-LM 72e4230 (2021-02-16, "Turn scatter-gather optimization on by
                 # default") until Megatron Core's pipeline (2023); sequence parallel turns it off (2725dc0, 2022-07)
                 "parallel.scatter_gather_tensors_in_pipeline": True}
    if vp:
        # 2022 Megatron-LM's interleaved schedule blocked on its sends between chunks: p2p overlap came
        # a year after the paper (May 2022), as --overlap-p2p-communication in Megatron-LM f9283c5a8a
        # (2023-05-31, "Add option to overlap p2p communication"), made the default in 4eeff55d1f (2023-10-12)
        overrides["parallel.virtual_pipeline_model_parallel_size"] = vp
        overrides["parallel.overlap_p2p_comm"] = False
    cfg, _ = resolve(workload, overrides=overrides, gpu="cpu")
    return cfg


def seeds_config() -> Config:
    """The seeds' run: Bridge's Llama 3 70B SFT H100 FP8-CS preset (its recipe's seq 4096, 32 GPUs),
    every value as its ConfigContainer (tests/data/seed/LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1.yaml)
    states it: FP8 current scaling with FP8 weights, TE's fused cross-entropy, TE's CUDA graphs of
    the MLP, tensor-parallel communication overlap, the output layer's deferred weight gradient,
    the unpadded vocabulary, and the data-parallel overlaps and buckets Bridge's
    CommOverlapConfig.setup turns on at dp 2 (`ingest.bridge_config._data_parallel_overlap`)."""
    from recompute_bench.workload import resolve

    cfg, _ = resolve("llama3-70b", overrides={
        "training.framework": "megatron", "training.seq_length": 4096, "training.micro_batch_size": 1,
        "training.global_batch_size": 32, "parallel.tensor_model_parallel_size": 4, "parallel.sequence_parallel": True,
        "parallel.pipeline_model_parallel_size": 4, "parallel.virtual_pipeline_model_parallel_size": 5,
        "parallel.data_parallel_size": 2, "parallel.use_distributed_optimizer": True, "parallel.tp_comm_overlap": True,
        "parallel.overlap_grad_reduce": True, "parallel.overlap_param_gather": True, "parallel.ddp_bucket_size": 2**27,
        "training.precision": "fp8", "training.fp8_recipe": "tensorwise", "training.fp8_param_gather": True,
        "training.grad_reduce_in_bf16": True, "training.defer_embedding_wgrad_compute": True,
        "training.wgrad_deferral_limit": 22, "training.cuda_graph_impl": "transformer_engine",
        "training.cuda_graph_modules": ["mlp"], "model.cross_entropy_loss_fusion": True,
        "model.cross_entropy_fusion_impl": "te", "model.make_vocab_size_divisible_by": 1,
        "model.max_position_embeddings": 4096, "recompute.granularity": "none", "recompute.modules": []}, gpu="cpu")
    return cfg


def paper_rows(rates: GpuRates | None = None) -> list[dict[str, Any]]:
    """Table 4's settings: measured and predicted per-layer milliseconds and relative throughput."""
    cfg, run = paper_config(), MegatronRun("a100")
    rates = rates or achieved_rates("a100")
    policies = {"none": LayerPolicy(), "full": LayerPolicy(chunk=0), "selective": LayerPolicy(modules=frozenset({"core_attn"}))}
    times = {name: layer_seconds(cfg, run, rates, policy) for name, policy in policies.items()}
    total = {name: sum(t.values()) for name, t in times.items()}
    return [{"setting": name, "measured_ms": PAPER_TABLE4_MS[name], "predicted_ms": 1e3 * total[name],
             "predicted_forward_ms": 1e3 * times[name]["forward"],
             "predicted_backward_ms": 1e3 * (times[name]["backward"] + times[name]["recompute"]),
             "measured_forward_ms": PAPER_TABLE4_PASSES_MS[name][0], "measured_backward_ms": PAPER_TABLE4_PASSES_MS[name][1],
             "measured_relative": PAPER_TABLE4_MS["none"] / PAPER_TABLE4_MS[name],
             "predicted_relative": total["none"] / total[name]} for name in policies]


def paper_table5_rows(rates: GpuRates | None = None, models: tuple[str, ...] = tuple(PAPER_TABLE5_S)) -> list[dict[str, Any]]:
    """Table 5's iterations of each model: full recompute without sequence parallel, and sequence
    parallel with selective recompute ("present work"), measured and predicted seconds."""
    run = MegatronRun("a100")
    rates = rates or achieved_rates("a100")
    settings = {"full": (RecomputeConfig("full", [], "uniform", 1), False),
                "sequence parallel + selective": (RecomputeConfig("selective", ["core_attn"]), True)}
    out = []
    for model in models:
        cfg = paper_config(model)
        for name, (recompute, sp) in settings.items():
            c = dataclasses.replace(cfg, recompute=recompute,
                                    parallel=dataclasses.replace(cfg.parallel, sequence_parallel=sp))
            parameters = [stage_parameter_groups(c, s) for s in range(c.parallel.pipeline_model_parallel_size)]
            st = step_time(c, run, rates, parameters)
            measured = PAPER_TABLE5_S[model][name]
            out.append({"model": model, "setting": name, "measured_step_seconds": measured,
                        "predicted_step_seconds": st.step_seconds, "ratio": st.step_seconds / measured,
                        "by_class": st.by_class()})
    return out


def seeds_rows(rates: GpuRates | None = None) -> list[dict[str, Any]]:
    """The seeds' settings: measured TFLOP/s per GPU and, relative to the [core_attn] row it was
    measured against and to no recompute, predicted relative throughput; the predicted step and
    TFLOP/s, and the step the measured TFLOP/s makes of the model FLOPs per GPU
    (`analysis.flops.model_flops_per_step`: Megatron's formula as the product counts it)."""
    from recompute_bench.analysis.flops import model_flops_per_step

    cfg, run = seeds_config(), MegatronRun("h100")
    rates = rates or achieved_rates("h100")
    parameters = [stage_parameter_groups(cfg, s) for s in range(cfg.parallel.pipeline_model_parallel_size)]

    def step(modules: list[str]) -> float:
        r = RecomputeConfig("selective", modules) if modules else RecomputeConfig()
        return step_time(dataclasses.replace(cfg, recompute=r), run, rates, parameters).step_seconds

    none = step([])
    settings = {name: name[len("selective["):-1].split(",") for name in SEEDS_TFLOPS}
    steps = {name: step(mods) for name, mods in settings.items()}
    flops = model_flops_per_step(cfg) / cfg.parallel.world_size
    return [{"setting": name, "measured_tflops": SEEDS_TFLOPS[name],
             "measured_relative": SEEDS_TFLOPS[name] / SEEDS_TFLOPS[SEEDS_BASELINE],
             "predicted_relative_to_baseline": steps[SEEDS_BASELINE] / steps[name],
             "predicted_relative_to_none": none / steps[name],
             "predicted_step_seconds": steps[name], "predicted_tflops": flops / steps[name] / 1e12,
             "measured_step_seconds": flops / (SEEDS_TFLOPS[name] * 1e12)}
            for name in SEEDS_TFLOPS]


H200_SLICE_MM_SECONDS = 1.216 / 13
"""Our H200 run (shared/gpu-runs/2026-11-28-h200/profiles/prof-plain.txt): the plain PyTorch loop on the
llama3-8b slice (4 layers, seq 8192, micro-batch 1, bf16; fused qkv and gate/up weights) spent 1.216 s of
aten::mm self CUDA time over 13 steps, 663 calls: 51 a step, 17 GEMMs forward and each one's data and
weight gradient."""


def h200_gemm_row(rates: GpuRates | None = None) -> dict[str, Any]:
    """The GEMMs of our H200 run's llama3-8b slice step priced by `GpuRates.gemm_seconds` (the H200's
    measured 8192^3 rate in waves over its SMs) beside the time the profile measured: a check of the
    GEMM pricing at a real run's shapes on a GPU we measured, apart from the rate's own source."""
    rates = rates or achieved_rates("h200")
    tokens, h, f, vocab, kv = 8192, 4096, 14336, 128256, 1024
    linears = [(h, h + 2 * kv), (h, h), (h, 2 * f), (f, h)] * 4 + [(h, vocab)]  # (k, n) of each forward GEMM
    shapes = [s for k, n in linears for s in ((tokens, n, k), (tokens, k, n), (n, k, tokens))]
    flops = sum(2 * m * n * k for m, n, k in shapes)
    predicted = sum(rates.gemm_seconds(2 * m * n * k, "bf16", (m, n, k)) for m, n, k in shapes)
    return {"gemms": len(shapes), "flops": flops, "predicted_seconds": predicted, "measured_seconds": H200_SLICE_MM_SECONDS,
            "ratio": predicted / H200_SLICE_MM_SECONDS}
