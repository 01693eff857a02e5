"""The field registry: every setting of a point declared once, with the one name it has everywhere.

A field is a dataclass field of `config.schema` (its section and attribute) and its `key`: Megatron's
argument name (`num_layers`, `tensor_model_parallel_size`, `recompute_granularity`, ...). That key is
the CLI flag (`--num-layers`), the grid-file key of a `[[point]]`, the golden/DataFrame key column,
and the override path `section.attribute` that `--set` takes. The help text of a flag is the
docstring written under the field in `config/schema.py`.

Commands take their options from here (`cli/options.py`), the golden key and the DataFrame key
columns come from here (`results.rows.KEY_FIELDS`), and a grid file's point keys are checked
against it.
Pure Python.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import Any

from recompute_bench.config.schema import SECTIONS

# How a point is measured, not what: left out of the golden key and the config hash.
PROTOCOL_KEYS = ("warmup_steps", "measured_steps")
# Fields added after the first goldens were written (mixture-of-experts): a record or golden from
# before them holds their default. At the default they stay out of `config_hash`, and a golden
# without their column reads every row as the default, so older records and goldens keep their key.
LATER_KEYS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_layer_freq", "moe_router_score_function", "moe_grouped_gemm", "expert_model_parallel_size",
              "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "kv_channels", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
              "moe_router_num_groups", "moe_router_group_topk", "moe_aux_loss_coeff",
              "moe_expert_capacity_factor", "moe_token_drop_policy", "framework", "transformer_impl",
              "masked_softmax_fusion", "attention_softmax_in_fp32", "cross_entropy_loss_fusion",
              "pipeline_parallel_schedule", "context_parallel_size", "cp_comm_type",
              "hierarchical_context_parallel_sizes", "fp8_recipe", "fp8_format", "fp8_param_gather",
              # Megatron's dense-world and MLA arguments (framework megatron)
              "qk_layernorm", "attention_output_gate", "add_qkv_bias", "cross_entropy_fusion_impl",
              "rope_type", "apply_rope_fusion", "mtp_num_layers", "create_attention_mask_in_dataloader",
              "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
              "exp_avg_sq_dtype", "grad_reduce_in_bf16", "defer_embedding_wgrad_compute", "wgrad_deferral_limit",
              "gradient_accumulation_fusion",
              "num_distributed_optimizer_instances", "decoder_first_pipeline_num_layers",
              "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
              "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout",
              "microbatch_group_size_per_vp_stage", "tp_comm_overlap",
              "overlap_grad_reduce", "overlap_param_gather", "ddp_bucket_size", "overlap_p2p_comm",
              "scatter_gather_tensors_in_pipeline",
              # Megatron's MoE settings (framework megatron)
              "moe_router_load_balancing_type", "moe_z_loss_coeff", "moe_router_pre_softmax", "moe_router_dtype",
              "moe_token_dispatcher_type", "moe_pad_expert_input_to_capacity", "moe_permute_fusion",
              "moe_shared_expert_gate", "moe_shared_expert_overlap", "expert_tensor_parallel_size",
              "overlap_moe_expert_parallel_comm",
              # FP8, CUDA graphs and offload (framework megatron)
              "fp8_amax_history_len", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
              "num_layers_at_end_in_bf16", "cuda_graph_impl", "cuda_graph_modules", "cuda_graph_warmup_steps",
              "fine_grained_activation_offloading", "offload_modules",
              # this harness's speed (docs/speed.md)
              "compile")
# The default of a field that has none (the model's shape): a record must hold it.
REQUIRED = object()
# Recompute fields whose attribute is not already Megatron's argument name.
_RECOMPUTE_PREFIXED = ("granularity", "modules", "method", "num_layers")


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line (fields without one are set with --set)."""

    panel: str
    """The help panel: Workload, Parallelism or Recompute."""
    aliases: tuple[str, ...] = ()
    """Further long spellings (--tp), rewritten before parsing."""
    short: str | None = None
    """Megatron Bridge's short flag (-tp, -rl), rewritten before parsing."""


# The fields with a dedicated flag. Every other field is reachable with --set section.key=value.
FLAGS: dict[str, Flag] = {
    "num_layers": Flag("Workload"),
    "seq_length": Flag("Workload", short="-sl"),
    "micro_batch_size": Flag("Workload", short="-mb"),
    "global_batch_size": Flag("Workload", short="-gb"),
    "precision": Flag("Workload"),
    "fp8_recipe": Flag("Workload"),
    "attention_backend": Flag("Workload"),
    "framework": Flag("Workload"),
    "transformer_impl": Flag("Workload"),
    "compile": Flag("Workload"),
    "tensor_model_parallel_size": Flag("Parallelism", ("--tp",), "-tp"),
    "pipeline_model_parallel_size": Flag("Parallelism", ("--pp",), "-pp"),
    "data_parallel_size": Flag("Parallelism", ("--dp",), "-dp"),
    "expert_model_parallel_size": Flag("Parallelism", ("--ep",), "-ep"),
    "pipeline_parallel_schedule": Flag("Parallelism", ("--pp-schedule",)),
    "context_parallel_size": Flag("Parallelism", ("--cp",), "-cp"),
    "sequence_parallel": Flag("Parallelism"),
    "use_distributed_optimizer": Flag("Parallelism"),
    "recompute_granularity": Flag("Recompute"),
    "recompute_modules": Flag("Recompute"),
    "recompute_method": Flag("Recompute"),
    "recompute_num_layers": Flag("Recompute", short="-rl"),
    "activation_offload_layers": Flag("Recompute", short="-ol"),
}


@dataclass(frozen=True)
class Field:
    """One setting: where it lives in the Config, its Megatron name, its type and help."""

    section: str
    attribute: str
    key: str
    type: Any
    default: Any
    """The dataclass default (a fresh one for a factory); REQUIRED where there is none."""
    help: str

    @property
    def path(self) -> str:
        """"section.attribute", as --set and `resolve` overrides spell it."""
        return f"{self.section}.{self.attribute}"

    @property
    def option(self) -> str:
        """The long CLI flag: --num-layers, --recompute-granularity."""
        return "--" + self.key.replace("_", "-")

    @property
    def flag(self) -> Flag | None:
        return FLAGS.get(self.key)

    @property
    def in_key(self) -> bool:
        """Part of a point's identity (golden key column): everything but the measurement protocol."""
        return self.key not in PROTOCOL_KEYS

    @property
    def is_list(self) -> bool:
        return "list" in str(self.type)

    @property
    def is_float(self) -> bool:
        """A float field: 10000 and 10000.0 are the same value (and must give the same key)."""
        return self.value_type is float

    @property
    def value_type(self) -> type:
        """The scalar Python type of a value (int, float, bool, str)."""
        text = str(self.type).replace("Optional[", "").rstrip("]")
        for name, t in (("list", str), ("bool", bool), ("int", int), ("float", float)):
            if name in text:
                return t
        return str


def key_of(section: str, attribute: str) -> str:
    """Megatron's argument name of a field: recompute's own four take the `recompute_` prefix."""
    if section == "recompute" and attribute in _RECOMPUTE_PREFIXED:
        return f"recompute_{attribute}"
    return attribute


def _docstrings(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass (its help text)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
            out[node.target.id] = " ".join(str(following.value.value).split())
    return out


@functools.lru_cache(maxsize=None)
def fields() -> tuple[Field, ...]:
    """Every field of every section, in section order."""
    out = []
    for section, cls in SECTIONS.items():
        docs = _docstrings(cls)
        for f in dataclasses.fields(cls):
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else REQUIRED)
            out.append(Field(section, f.name, key_of(section, f.name), f.type, default, docs.get(f.name, "")))
    keys = [f.key for f in out]
    assert len(keys) == len(set(keys)), "two fields share a key"
    return tuple(out)


@functools.lru_cache(maxsize=None)
def defaults() -> dict[str, Any]:
    """Every field's default (`Field.default`) by its path, "section.attribute"."""
    return {f.path: f.default for f in fields()}


def field(key: str) -> Field:
    """The field with this Megatron name (KeyError if there is none)."""
    return _by_key()[key]


@functools.lru_cache(maxsize=None)
def _by_key() -> dict[str, Field]:
    return {f.key: f for f in fields()}


def flagged() -> list[Field]:
    """The fields with a dedicated CLI flag, in FLAGS order."""
    return [field(k) for k in FLAGS]


def other_spellings() -> dict[str, str]:
    """Further spellings of a flag (--tp, and Megatron Bridge's short flags -tp, -rl) -> the long
    flag they mean; the command line is rewritten with them before it is parsed."""
    return {other: f.option for f in flagged() for other in (*f.flag.aliases, f.flag.short) if other}


def overrides_from_keys(values: dict[str, Any]) -> dict[str, Any]:
    """{key: value} (CLI flags, grid keys) -> {"section.attribute": value} for `resolve`."""
    return {field(k).path: v for k, v in values.items()}
