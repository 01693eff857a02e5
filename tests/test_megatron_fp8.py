"""Framework megatron under FP8: what Transformer Engine's quantized tensors take (their data, transposes
and scale-inverses, by recipe and GPU), what a layer's linears keep of their inputs, the weights' FP8
copies or FP8 primary weights, bf16 first and last layers, the GPUs each recipe runs on, and Megatron's
FP8 arguments; pinned on Megatron's own goldens where one isolates a term."""

import json
from pathlib import Path

import pytest

from helpers import invoke
from recompute_bench.analysis import megatron as mg
from recompute_bench.analysis.megatron import attention, fp8, layer, stage
from recompute_bench.ingest.megatron_args import CannotExpress, config_from_megatron
from recompute_bench.config.schema import BadInput

MiB = 2**20
CASES = Path(__file__).parent / "data" / "megatron" / "cases.json"
H100, GB200 = mg.MegatronRun("h100", ":4096:8"), mg.MegatronRun("gb200", ":4096:8")
# A small TE GPT as Megatron's functional tests write one (tp 2, sequence parallel, swiglu).
SMALL = {"--num-layers": 4, "--hidden-size": 512, "--num-attention-heads": 8, "--seq-length": 1024,
         "--max-position-embeddings": 1024, "--micro-batch-size": 2, "--global-batch-size": 8, "--swiglu": True,
         "--tensor-model-parallel-size": 2, "--sequence-parallel": True, "--use-distributed-optimizer": True,
         "--bf16": True, "--attention-dropout": 0.0, "--hidden-dropout": 0.0, "--normalization": "RMSNorm"}


def _fp8(recipe="tensorwise", **more):
    return config_from_megatron({**SMALL, "--fp8-format": "hybrid", "--fp8-recipe": recipe, **more}, world_size=4)


def test_per_tensor_fp8_keeps_a_transpose_on_hopper_and_one_copy_on_blackwell():
    # float8_tensor.py / csrc quantizer.cpp: row-wise `_data` and column-wise `_transpose` on sm90;
    # sm100 multiplies FP8 in any layout and keeps `_data` for both; one fp32 scale-inverse (one
    # 512-byte allocator block).
    both = dict(rowwise=True, columnwise=True, weight=True)
    assert fp8.quantized_bytes("tensorwise", 1024, 512, run=H100, **both) == 2 * 1024 * 512 + 512
    assert fp8.quantized_bytes("delayed", 1024, 512, run=GB200, **both) == 1024 * 512 + 512
    assert fp8.quantized_bytes("tensorwise", 1024, 512, rowwise=False, columnwise=True) == 1024 * 512 + 512


def test_block_and_mx_scales_follow_transformer_engines_scale_shapes():
    # mxfp8_tensor.py get_scale_shape: row-wise (ceil128(rows), ceil4(cols / 32)), column-wise
    # (ceil4(rows / 32), ceil128(cols)), one byte each. [4096, 1024]: 4096 x 32 and 128 x 1024.
    assert fp8.quantized_bytes("mxfp8", 4096, 1024, rowwise=True, columnwise=False) == 4096 * 1024 + 4096 * 32
    assert fp8.quantized_bytes("mxfp8", 4096, 1024, rowwise=False, columnwise=True) == 4096 * 1024 + 128 * 1024
    # float8_blockwise_tensor.py: 1 x 128 blocks for activations, column-wise (ceil(rows/128),
    # ceil4(cols)) fp32; 128 x 128 blocks for weights, (ceil(r/128), ceil4(ceil(c/128))) fp32.
    assert fp8.quantized_bytes("blockwise", 4096, 1024, rowwise=False, columnwise=True) == 4096 * 1024 + 4 * 32 * 1024
    assert fp8.quantized_bytes("blockwise", 1024, 512, rowwise=True, columnwise=False, weight=True) == 1024 * 512 + 512
    assert fp8.quantized_bytes("blockwise", 1280, 512, rowwise=True, columnwise=True, weight=True) == \
        2 * 1280 * 512 + 512 + 512  # (10 x 4) and (4 x 12) fp32 scales, each under one block


def test_a_linear_keeps_one_byte_per_input_value_under_fp8():
    bf16, tw = config_from_megatron(SMALL, world_size=4), _fp8()
    n = 2048 * 512
    assert fp8.linear_input_bytes(bf16, n, 512) == 2 * n
    # per-tensor FP8 gathered under sequence parallel keeps row-wise data; otherwise column-wise
    assert fp8.linear_input_bytes(tw, n, 512, gathered=True) == n + 512
    assert fp8.linear_input_bytes(_fp8("mxfp8"), n, 512, gathered=True) == n + 64 * 512  # (2048/32, 512) scales


def test_fp8_changes_only_what_the_linears_save():
    # tensorwise on Hopper: linear_qkv's and linear_fc1's ln_out and linear_fc2's input drop to one
    # byte a value; linear_proj keeps the attention output it was given (save_original_input);
    # attention, norm inputs and statistics, fc1's output (bias-SwiGLU's input) stay 16-bit.
    bf16, tw = config_from_megatron(SMALL, world_size=4), _fp8()
    a, b = layer.layer_saved_bytes(bf16, H100), layer.layer_saved_bytes(tw, H100)
    assert set(a) == set(b)
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {"linear_qkv.ln_out", "linear_fc1.ln_out", "linear_fc2.input"}
    tokens, f = 1024 * 2, 4 * 512 * 2 // 3 // 64 * 64  # swiglu's ffn_hidden_size, a multiple of 64
    assert b["linear_fc2.input"] == pytest.approx((tokens * f + 512) / 2)  # [s, b, f/t], split over tp 2
    assert b["linear_qkv.ln_out"] == pytest.approx((tokens * 512 + 512) / 2)  # [s/t, b, h] under sp
    assert fp8.proj_saves_original_input(tw)


def test_delayed_scaling_keeps_linear_projs_own_fp8_copy():
    # attention.py sets save_original_input on linear_proj only for recipes other than delayed: with
    # delayed scaling linear_proj keeps an FP8 copy beside the attention output FusedAttention saves.
    delayed = _fp8("delayed")
    saved = layer.layer_saved_bytes(delayed, H100)
    assert attention.attention_path(delayed, H100) == "fused"
    assert saved["linear_proj.input"] == pytest.approx((2048 * 512 + 512) / 2)
    assert saved["core_attention.output"] == 2 * 2048 * 512 / 2


def test_first_and_last_layers_run_in_bf16():
    cfg = _fp8("tensorwise", **{"--first-last-layers-bf16": True, "--num-layers-at-end-in-bf16": 2})
    assert [fp8.layer_runs_fp8(cfg, i) for i in range(4)] == [False, True, False, False]
    assert fp8.layer_config(cfg, 0).training.precision == "bf16" and fp8.layer_config(cfg, 1) is cfg
    chunk = stage.chunk_bytes(cfg, H100, 4)
    bf16 = layer.layer_bytes(fp8.layer_config(cfg, 0), H100)
    assert chunk.stored == pytest.approx(3 * bf16 + layer.layer_bytes(cfg, H100))


def test_fp8_weights_per_recipe():
    # Without fp8_param_gather: TE caches an FP8 copy with both usages (base.py quantize_weight). With
    # it the weight is FP8 in DDP's uint8 buffer (one byte less than bf16) plus its Hopper transpose.
    cfg, gather = _fp8(), _fp8(**{"--fp8-param-gather": True})
    rows, cols = 1024, 512
    assert fp8.weight_bytes(cfg, H100, rows, cols) == {"FP8 weight copies": 2 * rows * cols + 512}
    assert fp8.weight_bytes(gather, H100, rows, cols) == {"weights": 512 - rows * cols, "FP8 weight transposes": rows * cols}
    assert fp8.weight_bytes(gather, GB200, rows, cols) == {"weights": 512 - rows * cols}


def test_hopper_holds_the_fp8_weight_transposes_that_blackwell_does_not(tmp_path):
    # gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8 (tensorwise, fp8_param_gather): after the
    # step its H100 rank holds exactly 9 MiB more than its GB200 rank. The estimate's only difference
    # between the two is the FP8 weights' transposes: 12 layers x 12 x 512^2 / tp 4 = 9 MiB.
    case = next(c for c in json.loads(CASES.read_text())["cases"]
                if c["case"] == "gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap")
    measured = case["goldens"]["dev_h100"]["allocated_bytes"] - case["goldens"]["dev_gb200"]["allocated_bytes"]
    args = {k: v for k, v in case["args"].items() if k != "--context-parallel-size"}  # its own category's term
    cfg = config_from_megatron(args, world_size=4)
    h, g = (stage.static_items(cfg, 0, mg.MegatronRun(gpu, ":4096:8")) for gpu in ("h100", "gb200"))
    assert h["FP8 weight transposes"] == measured == 9 * MiB
    assert sum(h.values()) - sum(g.values()) == measured


def test_delayed_scaling_keeps_an_amax_history_per_module():
    cfg = _fp8("delayed", **{"--fp8-amax-history-len": 1024})
    # DelayedScalingRecipeState per direction: scale [n] and amax_history [1024, n] fp32, n = 3 and 2
    assert fp8.scaling_state_bytes(cfg) == 512 + 1024 * 3 * 4 + 512 + 1024 * 2 * 4
    assert fp8.scaling_state_bytes(_fp8("tensorwise")) == 0


@pytest.mark.parametrize("recipe,gpu,words", [
    ("tensorwise", "a100", "Float8CurrentScaling (--fp8-recipe tensorwise) does not run on a100"),
    ("mxfp8", "h100", "MXFP8BlockScaling (--fp8-recipe mxfp8) does not run on h100"),
    ("blockwise", "l40s", "Float8BlockScaling (--fp8-recipe blockwise) does not run on l40s"),
])
def test_each_recipe_runs_on_its_gpus_only(recipe, gpu, words):
    with pytest.raises(BadInput, match=words.replace("(", r"\(").replace(")", r"\)")):
        mg.stage_peak(_fp8(recipe), 0, mg.MegatronRun(gpu))
    mg.stage_peak(_fp8(recipe), 0, mg.MegatronRun("gb200"))  # Blackwell runs all four


@pytest.mark.parametrize("argv,words", [
    (["--precision", "fp8", "--gpu", "a100"], "does not run on a100"),
    (["--precision", "fp8", "--set", "training.fp8_param_gather=true"], "only supported with the distributed optimizer"),
    (["--precision", "fp8", "--set", "training.first_last_layers_bf16=true"], "Delayed scaling does not support first"),
    (["--precision", "fp8", "--transformer-impl", "local"], "Transformer Engine's linears"),
    (["--set", "training.fp8_param_gather=true"], "FP8 runs only"),
])
def test_bad_fp8_settings_are_one_line(argv, words):
    result = invoke("estimate", "-w", "llama3-8b", "--framework", "megatron", *argv)
    assert result.exit_code == 2 and words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_megatrons_fp8_arguments_map_onto_the_fields():
    cfg = _fp8("blockwise", **{"--fp8-param-gather": True, "--first-last-layers-bf16": True,
                               "--num-layers-at-start-in-bf16": 0, "--fp8-amax-history-len": 16})
    t = cfg.training
    assert (t.precision, t.fp8_format, t.fp8_recipe, t.fp8_param_gather) == ("fp8", "hybrid", "blockwise", True)
    assert (t.first_last_layers_bf16, t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16) == (True, 0, 1)
    assert t.fp8_amax_history_len == 16
    # a log's argument dump names the format `fp8`; Megatron's default recipe is delayed
    dumped = config_from_megatron({**SMALL, "fp8": "e4m3"}, world_size=4).training
    assert (dumped.precision, dumped.fp8_format, dumped.fp8_recipe) == ("fp8", "e4m3", "delayed")


@pytest.mark.parametrize("more,argument", [
    ({"--fp8-recipe": "custom"}, "--fp8-recipe"),
    ({"--fp8-dot-product-attention": True}, "--fp8-dot-product-attention"),
    ({"--bf16": False, "--fp16": True}, "--fp8-format"),
])
def test_fp8_variants_the_estimate_cannot_express_are_named(more, argument):
    with pytest.raises(CannotExpress) as e:
        config_from_megatron({**SMALL, "--fp8-format": "hybrid", **more}, world_size=4)
    assert e.value.argument == argument and "\n" not in str(e.value)


def test_fp8_experts_keep_one_byte_per_input_value():
    """TE's GroupedLinear under FP8 quantizes each expert's split of its input and keeps only the
    column-wise data (grouped_linear.py `_GroupedLinear.forward`), so the routed experts' fc1 and fc2
    inputs take one byte a value; the shared experts' TE linears keep their own FP8 copy of the norm's
    output (row-wise, the local shard, under sequence parallel), beside the 16-bit one the router keeps."""
    from recompute_bench.analysis.megatron import moe

    more = {"--num-experts": 4, "--moe-router-topk": 2, "--moe-ffn-hidden-size": 256, "--moe-grouped-gemm": True,
            "--moe-token-dispatcher-type": "alltoall", "--moe-shared-expert-intermediate-size": 512,
            "--disable-bias-linear": True}
    bf16 = config_from_megatron({**SMALL, **more}, world_size=4)
    cfg = _fp8(**more)
    plain, quantized = moe.moe_saved_bytes(bf16), moe.moe_saved_bytes(cfg)
    rows = moe.routed_rows(cfg)
    assert quantized["experts.linear_fc1.input"] == rows * 512 + 512  # one scale-inverse block
    assert plain["experts.linear_fc1.input"] == 2 * rows * 512
    assert quantized["experts.linear_fc2.input"] == rows * 256 / cfg.parallel.expert_tensor_parallel + 512
    assert quantized["experts.linear_fc1.output"] == plain["experts.linear_fc1.output"]  # the activation's input
    n = moe.local_tokens(cfg)  # s x b / t under sequence parallel
    assert quantized["shared_experts.linear_fc1.input"] == n * 512 + 512 and "shared_experts.linear_fc1.input" not in plain
    assert quantized["shared_experts.linear_fc2.input"] == 2 * n * 512 / 2 + 512  # [s x b, 512 / t] FP8
    assert quantized["pre_mlp_layernorm.output"] == plain["pre_mlp_layernorm.output"]  # the router's 16-bit input
    # moe_act recompute: fc2 keeps the activation's output it was given, dropped and rebuilt
    assert "experts.linear_fc2.input" not in moe.moe_saved_bytes(cfg, ["moe_act"])


def test_fp8_mla_projections_keep_their_inputs_quantized():
    """Under FP8 MLA's duplicated down projections each keep their own FP8 copy of the input norm's
    local output (column-wise) instead of the 16-bit output, and the up projections their latent as
    the row-wise local shard they gather again in backward (TE linear.py); `mla_up_proj` keeps the
    16-bit latents, which its checkpoint holds."""
    args = {"--num-layers": 2, "--hidden-size": 512, "--num-attention-heads": 8, "--multi-latent-attention": True,
            "--q-lora-rank": 192, "--kv-lora-rank": 128, "--qk-head-dim": 64, "--qk-pos-emb-head-dim": 32,
            "--v-head-dim": 64, "--seq-length": 1024, "--max-position-embeddings": 1024, "--micro-batch-size": 2,
            "--global-batch-size": 8, "--tensor-model-parallel-size": 2, "--sequence-parallel": True,
            "--use-distributed-optimizer": True, "--bf16": True, "--hidden-dropout": 0.0}
    bf16 = config_from_megatron(args, world_size=4)
    cfg = config_from_megatron({**args, "--fp8-format": "hybrid", "--fp8-recipe": "tensorwise"}, world_size=4)
    plain, quantized = layer.layer_saved_bytes(bf16, H100), layer.layer_saved_bytes(cfg, H100)
    local = 1024 * 2 // 2  # s x b / t tokens
    assert plain["input_layernorm.output"] == 2 * local * 512 and "input_layernorm.output" not in quantized
    for name in ("linear_q_down_proj.input", "linear_kv_down_proj.input"):
        assert quantized[name] == (2 * local * 512 + 512) / 2  # one byte a value, a scale block, over t
    assert plain["linear_q_down_proj.output"] == 2 * local * 192
    assert quantized["linear_q_down_proj.output"] == (2 * local * 192 + 512) / 2
    assert quantized["linear_kv_up_proj.input"] == (2 * local * 128 + 512) / 2
    assert quantized["core_attention.output"] == plain["core_attention.output"]  # attention stays 16-bit
    recomputed = layer.layer_saved_bytes(cfg, H100, ["mla_up_proj"])
    assert recomputed["linear_q_down_proj.output"] == plain["linear_q_down_proj.output"]
