"""Framework megatron's multi-token prediction (analysis/megatron/mtp.py): where Megatron builds the
MTP layers, the parameters and saved tensors each adds, and Megatron's goldens with --mtp-num-layers."""

import json
from pathlib import Path

import pytest

from recompute_bench.analysis.megatron import MegatronRun, mtp, stage_peak
from recompute_bench.analysis.megatron.fp8 import layer_runs_fp8
from recompute_bench.analysis.megatron.layer import layer_bytes, layer_linear_weights
from recompute_bench.analysis.megatron.outside import logits
from recompute_bench.analysis.megatron.parameters import layer_parameter_groups, stage_parameter_groups
from recompute_bench.analysis.megatron.stage import chunk_bytes
from recompute_bench.ingest.megatron_args import config_from_megatron
from recompute_bench.config.schema import BadInput
from recompute_bench.config.pipeline_split import model_chunks

H100 = MegatronRun("h100", ":4096:8")
MiB = 2**20
# A small MoE GPT (dense first layer) on tp 2 with sequence parallel, pp 2, ep 4.
ARGS = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
        "--max-position-embeddings": 1024, "--micro-batch-size": 2, "--global-batch-size": 16, "--bf16": True,
        "--disable-bias-linear": True, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
        "--pipeline-model-parallel-size": 2, "--expert-model-parallel-size": 2, "--num-experts": 4,
        "--moe-layer-freq": "([0]*1+[1]*3)", "--moe-router-topk": 2, "--moe-ffn-hidden-size": 1024,
        "--moe-grouped-gemm": True, "--moe-token-dispatcher-type": "alltoall", "--use-distributed-optimizer": True,
        "--untie-embeddings-and-output-weights": True, "--hidden-dropout": 0.0, "--attention-dropout": 0.0}


def _cfg(**extra):
    return config_from_megatron({**ARGS, **{"--" + k.replace("_", "-"): v for k, v in extra.items()}}, world_size=8)


def test_the_mtp_layers_sit_on_the_loss_chunk_or_where_the_layout_puts_them():
    cfg = _cfg(mtp_num_layers=2)
    assert [c.mtp for c in model_chunks(cfg, 0)] == [0] and [c.mtp for c in model_chunks(cfg, 1)] == [2]
    laid = _cfg(mtp_num_layers=1, pipeline_model_parallel_layout="Et|t|t|tmL")
    assert [(c.layers, c.mtp, c.loss) for c in model_chunks(laid, 1)] == [(1, 0, False), (1, 1, True)]
    with pytest.raises(BadInput, match="places 0 multi-token-prediction layers"):
        _cfg(mtp_num_layers=1, pipeline_model_parallel_layout="Et|t|t|tL")
    with pytest.raises(BadInput, match="apart from the loss"):
        _cfg(mtp_num_layers=1, pipeline_model_parallel_layout="Et|t|tm|tL")
    with pytest.raises(BadInput, match="--mtp-use-repeated-layer"):
        _cfg(mtp_num_layers=2, mtp_use_repeated_layer=True)


def test_an_mtp_layer_adds_an_embedding_its_norms_eh_proj_and_a_layer_of_the_last_kind():
    plain, cfg = _cfg(), _cfg(mtp_num_layers=1)
    h, t = 512, 2
    added = {g: stage_parameter_groups(cfg, 1)[g] - stage_parameter_groups(plain, 1)[g] for g in ("dense", "expert")}
    last = layer_parameter_groups(plain, 3)  # a MoE layer: the MTP layer takes the last decoder layer's spec
    assert last["expert"] > 0 and added["expert"] == last["expert"]
    # the chunk's own embedding copy (words over tp, learned positions whole), enorm + hnorm +
    # final_layernorm (LayerNorm: 2h each), eh_proj [h/t, 2h]
    assert added["dense"] == last["dense"] + cfg.vocab_rows * h / t + 1024 * h + 3 * 2 * h + 2 * h * h / t
    assert stage_parameter_groups(cfg, 0) == stage_parameter_groups(plain, 0)
    assert layer_linear_weights(cfg, 4)["eh_proj"] == (h // t, 2 * h)


def test_an_mtp_layer_keeps_its_layer_its_projection_input_and_a_second_softmax():
    cfg = _cfg(mtp_num_layers=1)
    plain = _cfg()
    tokens, h, t, e = 1024 * 2, 512, 2, 2
    extras = mtp.mtp_saved_bytes(cfg, 0)
    assert extras["mtp.cross_entropy.softmax"] == 4 * logits(cfg)  # fp32 softmax of the MTP head's logits
    assert extras["mtp.eh_proj.input"] == e * tokens * 2 * h / t  # the [s/t, b, 2h] concatenation
    assert extras["mtp.output_layer.input"] == 2 * e * tokens * h / t  # torch.cat: the decoder's and the MTP share
    assert "mtp.hnorm.input" not in extras and "mtp.hnorm.input" in mtp.mtp_saved_bytes(cfg, 1)
    first, chunk = model_chunks(cfg, 1)[0], model_chunks(plain, 1)[0]
    with_mtp = chunk_bytes(cfg, H100, first.layers, first.first_layer, mtp=first.mtp)
    without = chunk_bytes(plain, H100, chunk.layers, chunk.first_layer)
    assert with_mtp.stored - without.stored == pytest.approx(layer_bytes(cfg, H100, (), 4) + sum(extras.values()))
    # full recompute: the MTP checkpoint keeps the embedding's output (and later layers' hidden states)
    full = _cfg(mtp_num_layers=1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kept = mtp.mtp_saved_bytes(full, 0, checkpointed=True)
    assert set(kept) == {"mtp.checkpoint.decoder_input", "mtp.output_layer.input", "mtp.cross_entropy.softmax"}


def test_mtp_layers_run_fp8_even_where_the_last_layers_stay_bf16():
    cfg = _cfg(mtp_num_layers=1, fp8_format="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
               num_layers_at_end_in_bf16=1)
    assert not layer_runs_fp8(cfg, 3) and layer_runs_fp8(cfg, 4)


CASES = Path(__file__).parent / "data" / "megatron" / "cases.json"


@pytest.mark.parametrize("name,peak_error,static_error,missing", [
    # MoE + MLA, tp2 pp2 vp4 ep4, mbs 4 x 4096 tokens: without the MTP terms the estimate would be
    # 1152 MiB short after the step (its embedding copy and MoE layer) and 7.8 GiB short at the peak
    ("gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed", -0.041, -0.041, 1152),
    # (FP8: the experts' and MLA projections' inputs one byte a value, fp8.linear_input_bytes)
    ("gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8", -0.009, -0.038, 1233),
])
def test_the_mtp_goldens_are_the_estimate_with_the_mtp_terms(name, peak_error, static_error, missing):
    case = next(c for c in json.loads(CASES.read_text())["cases"] if c["case"] == name)
    g = case["goldens"]["dev_h100"]
    cfg = config_from_megatron(case["args"], world_size=8)
    plain = config_from_megatron({k: v for k, v in case["args"].items() if k != "--mtp-num-layers"}, world_size=8)
    peak, without = stage_peak(cfg, 1, H100), stage_peak(plain, 1, H100)
    assert peak.peak_allocated_bytes / g["max_allocated_bytes"] - 1 == pytest.approx(peak_error, abs=0.002)
    assert peak.static_bytes / g["allocated_bytes"] - 1 == pytest.approx(static_error, abs=0.002)
    assert (g["allocated_bytes"] - without.static_bytes) / MiB == pytest.approx(missing, abs=2)
