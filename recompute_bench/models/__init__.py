"""Model specs: one per architecture, what the analysis needs to know about a model without building it.

A spec is pure Python (it imports no torch), so `estimate` and `plan` start at once and run
anywhere. Its methods take a resolved `Config` and answer, for one layer of the architecture:

- FLOPs: forward and backward per part, as the kernels run them and `FlopCounterMode` counts them
  (`layer_flops`), what each selective target repeats (`selective_recompute_flops`), and the layer's
  term of Megatron's model FLOPs (`layer_model_flops`); the same for the output layer;
- bytes: the storages one layer keeps for backward, by name (`layer_saved_bytes`), and a norm's
  statistics (`norm_stats_bytes`);
- parameters of one layer on one tensor-parallel rank (`layer_parameters`);
- the selective recompute targets it offers (`recompute_targets`);
- `build()`: the torch model, imported only when called.

Adding an architecture (MoE, MLA) is one new module with a class like `dense.spec.DenseSpec` and a
line in `spec_for`. What is the same for every architecture (units, the vocabulary's padding, the
`SavedBytes` bookkeeping) lives here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from recompute_bench.config.schema import Config, ModelConfig

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
"""Bytes of one activation (and weight, unless FP8 weights are asked for) by precision: fp8 keeps
bf16 activations; only the linears' matrix multiplies and what they save change (analysis.megatron.fp8)."""
FP32_BYTES = 4
MASK_BYTES = 1      # dropout keeps a bool mask (native_dropout)
INDEX_BYTES = 8     # int64 token ids and labels
LOSS_CHUNK_LOGITS = 2**25
"""The cross-entropy works its fp32 copy of the logits this many logits at a time (whole tokens):
128 MiB of fp32 (backends/pytorch.py `cross_entropy`, analysis.harness.stage `loss_workspace_bytes`)."""


def loss_chunk_rows(tokens: int, vocab: int) -> int:
    """Tokens per chunk of the cross-entropy's fp32 working copy: as many whole rows of `vocab`
    logits (this rank's shard) as fit in `LOSS_CHUNK_LOGITS`, at least one, at most `tokens`."""
    return max(1, min(int(tokens), LOSS_CHUNK_LOGITS // int(vocab)))


def device_kind(device: str) -> str:
    """"cuda" or "cpu" from a torch device string ("cuda:1" -> "cuda")."""
    return "cpu" if str(device).split(":")[0] == "cpu" else "cuda"


class DeviceKernels(str):
    """A device string as the analysis takes it ("cuda", "cpu"), carrying the kernels a run measured
    there: `attention_kernel`, what core attention ran ("flash", "efficient", "cudnn", "sdpa_math",
    "math"; None: not measured), and the CUDA device's facts that size torch's cuBLAS workspaces
    (`analysis.cuda_workspaces`): its `compute_capability` (major x 10 + minor; None: not known) and
    the run's CUBLAS_WORKSPACE_CONFIG. It is a `str`, so the analysis passes it on unchanged wherever it
    passes a device, and a spec that picks a kernel takes the measured one over its own prediction
    (`attention_kernel`): the measurement is handed to the analysis as data, which imports no torch."""

    attention_kernel: str | None
    compute_capability: int | None
    cublas_workspace_config: str | None

    def __new__(cls, device: str, attention_kernel: str | None = None, compute_capability: int | None = None,
                cublas_workspace_config: str | None = None) -> "DeviceKernels":
        self = super().__new__(cls, device)
        self.attention_kernel = attention_kernel
        self.compute_capability = compute_capability
        self.cublas_workspace_config = cublas_workspace_config
        return self


@dataclass(frozen=True)
class Work:
    """FLOPs of one part for some samples: its forward, and its backward as its kernels run it."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        """Forward plus backward."""
        return self.forward + self.backward


class SavedBytes:
    """Storages kept for backward, by name: a name added twice is one storage (the probe
    de-duplicates storages the same way), each with how it splits under tensor parallelism
    ("tp": always by t; "sp": by t only with sequence parallelism; "none": never)."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[float, str]] = {}

    def add(self, name: str, nbytes: float, split: str) -> None:
        """Record storage `name` unless it is already there."""
        self.items.setdefault(name, (nbytes, split))

    def per_rank(self, t: int, sp: bool) -> dict[str, float]:
        """Bytes per storage on one of `t` tensor-parallel ranks."""
        return {name: nbytes / t if split == "tp" or (split == "sp" and sp) else nbytes
                for name, (nbytes, split) in self.items.items()}


class ModelSpec(Protocol):
    """What every architecture's spec answers (see the module docstring). `samples` is a number of
    sequences (default: one micro-batch); `device` a torch device string, which picks the kernels."""

    name: str
    recompute_targets: tuple[str, ...]

    def attention_kernel(self, cfg: Config, device: str = "cuda") -> str: ...
    def layer_flops(self, cfg: Config, samples: int | None = None, device: str = "cuda") -> dict[str, Work]: ...
    def selective_recompute_flops(self, cfg: Config, modules: Iterable[str], samples: int | None = None,
                                  device: str = "cuda") -> float: ...
    def layer_model_flops(self, cfg: Config, samples: int | None = None) -> float: ...
    def output_layer_flops(self, cfg: Config, samples: int | None = None) -> Work: ...
    def logits_model_flops(self, cfg: Config, samples: int | None = None) -> float: ...
    def layer_saved_bytes(self, cfg: Config, modules: Iterable[str] = (), device: str = "cuda") -> dict[str, float]: ...
    def norm_stats_bytes(self, cfg: Config, device: str, tokens: int) -> float: ...
    def layer_parameters(self, cfg: Config) -> dict[str, float]: ...
    def build(self, cfg: Config, device: Any = "cpu", dtype: Any = None) -> Any: ...


def spec_for(model: ModelConfig) -> ModelSpec:
    """The spec of the architecture `model` describes: MoE when it has experts, else the dense GPT;
    with multi-latent attention in place of MHA/GQA when `multi_latent_attention` is set."""
    from recompute_bench.models.dense.spec import DENSE  # here, not at the top: dense.spec imports this module

    if model.multi_latent_attention:
        from recompute_bench.models.mla.spec import MLAMoESpec, MLASpec

        return MLAMoESpec(model) if model.num_moe_experts else MLASpec()
    if model.num_moe_experts:
        from recompute_bench.models.moe.spec import MoESpec

        return MoESpec(model)
    return DENSE


def kind_config(cfg: Config, kind: str) -> Config:
    """cfg as a model whose every layer is of `kind` ("dense" or "moe", `policy.layer_kind`), so that
    the spec's per-layer answers (a mean over the model's layers) are that kind's exactly. The
    copy carries its own model's spec (a dense model's for "dense")."""
    m = cfg.model
    if not m.num_moe_experts or (kind == "moe" and m.moe_layers == m.num_layers):
        return cfg
    model = dataclasses.replace(m, moe_layer_freq=1) if kind == "moe" else dataclasses.replace(m, num_moe_experts=None)
    return dataclasses.replace(cfg, model=model, _resolved=(model, spec_for(model)))
