"""Activation offload: which of a layer's saved tensors leave the device, and for how long.

Two mechanisms, never together (transformer_config.py):

- Layer-level CPU offloading (`--cpu-offloading --cpu-offloading-num-layers N`, this product's
  `recompute.activation_offload_layers`; no pipeline parallel, no recompute). Megatron wraps each
  layer of its TransformerBlock in Transformer Engine's offload context (transformer_block.py,
  extensions/transformer_engine.py `get_cpu_offload_context`, model_layers = num_layers). TE's
  default synchronizer (cpu_offload.py `DefaultOffloadSynchronizer`) offloads layers 0..N-1: every
  tensor a layer saves for backward with at least 256 Ki elements (`_check_if_offload`; smaller
  ones and parameters stay) is copied to the host, and layer i's device copies are released when
  layer L - N + i starts its forward; in backward layer i is reloaded when layer L - 1 - N + i's
  backward starts. So at most L - N layers' offloadable tensors are on the device at once, in
  forward and in backward ("activation memory usage is equal to (num_layers - num_offloaded_layers)
  * T", get_cpu_offload_context). The pinned host buffers are host memory. (TE's older code path,
  NVTE_CPU_OFFLOAD_V1=1, with its optional double reload buffer, is not modelled.)
- Fine-grained offloading (`--fine-grained-activation-offloading --offload-modules ...`,
  pipeline_parallel/fine_grained_activation_offload.py). Each listed module of each layer is an
  offload group: what it saves while it runs (saved-tensor hooks) with at least
  min_offloaded_tensor_size = 1 Mi elements is copied to the host when the module's forward ends
  (`on_group_commit_forward`, `tensor_need_offloading_checker`) and its device copy released; in
  backward a group is reloaded when the group after it starts its backward (`bulk_reload`: one group
  ahead). After the first (warm-up) iteration, a model chunk whose backward comes next
  (`should_bulk_offload`: the last pipeline stage's chunk that computes the loss) keeps the last
  group of each name (its last layer's) on the device. For a dense Transformer Engine layer the
  groups are qkv_linear (TE LayerNormLinear's norm input, statistics and ln_out), core_attn
  (everything the attention kernel saves, RoPE's q and k, the QKV output behind v) unless core_attn
  is recomputed (its checkpoint runs outside the group: attention.py), attn_proj (linear_proj's saved
  input; its `forced_released_tensors` frees the attention output); attn_norm and mlp_norm are
  Transformer Engine's fused norms (IdentityOp), which save nothing of their own
  (transformer_layer.py `_set_offload_modules`). Only these dense TE groups are mapped: a MoE
  layer's expert_fc1 and moe_act groups (moe/experts.py: fc1's input, the activation's fc1 output)
  and MLA's attn_norm, qkv_linear and mlp_norm groups (its own TENorms' inputs, the down
  projections' outputs) stay on the device here, which is where Megatron's goldens find them
  (docs/megatron.md, the offload misses). Pure Python.
"""

from __future__ import annotations

from recompute_bench.analysis.megatron.fp8 import FP8_BYTES, runs_fp8
from recompute_bench.models import ELEMENT_BYTES, FP32_BYTES, MASK_BYTES
from recompute_bench.config.schema import Config

TE_MIN_OFFLOAD_ELEMENTS = 256 * 1024
"""cpu_offload.py `OffloadableLayerState._check_if_offload`: smaller tensors stay on the device."""
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
"""TransformerConfig.min_offloaded_tensor_size, Megatron's default (elements)."""

# Storages of a dense TE layer (layer.py / attention.py names) by the fine-grained offload group
# that saves them.
_GROUP_PREFIXES = (("linear_qkv.input", "qkv_linear"), ("linear_qkv.norm_stats", "qkv_linear"),
                   ("linear_qkv.ln_out", "qkv_linear"), ("linear_qkv.output", "core_attn"),
                   ("rotary.", "core_attn"), ("query.reshape", "core_attn"), ("core_attention.output", "attn_proj"),
                   ("core_attention.", "core_attn"), ("linear_proj.input", "attn_proj"))


def element_bytes(cfg: Config, name: str) -> float:
    """Bytes of one element of the storage `name` (what the offload thresholds count in)."""
    if any(word in name for word in ("norm_stats", "softmax_stats", "softmax_lse")):
        return FP32_BYTES
    if "dropout_mask" in name:
        return MASK_BYTES
    if runs_fp8(cfg) and (name.endswith("ln_out") or name in ("linear_fc2.input", "linear_proj.input")):
        return FP8_BYTES
    return ELEMENT_BYTES[cfg.training.precision]


def offload_group(name: str) -> str | None:
    """The fine-grained offload group whose module saves storage `name`, or None."""
    for prefix, group in _GROUP_PREFIXES:
        if name.startswith(prefix):
            return group
    return None


def layer_offloaded(cfg: Config, saved: dict[str, float]) -> dict[str, float]:
    """Layer-level offloading: the storages of one layer (`layer_saved_bytes`) TE copies to the host."""
    return {name: b for name, b in saved.items() if b / element_bytes(cfg, name) >= TE_MIN_OFFLOAD_ELEMENTS}


def fine_grained_offloaded(cfg: Config, saved: dict[str, float], modules: list[str] | None = None) -> dict[str, float]:
    """Fine-grained offloading: the storages of one layer that leave the device between its forward
    and its backward. The attention output goes with attn_proj (linear_proj holds it, and forces
    its release), or with core_attn where linear_proj keeps its own FP8 copy instead; core_attn's
    group is empty when core_attn is recomputed."""
    r = cfg.recompute
    groups = set(r.offload_modules if modules is None else modules)
    if r.granularity == "selective" and "core_attn" in r.modules:
        groups.discard("core_attn")
    def group(name: str) -> str | None:
        if name == "core_attention.output" and "linear_proj.input" in saved:
            return "core_attn"  # linear_proj keeps its own FP8 copy: only the kernel holds the output
        return offload_group(name)

    return {name: b for name, b in saved.items() if group(name) in groups
            and b / element_bytes(cfg, name) >= MIN_OFFLOADED_TENSOR_SIZE}
