"""The data-parallel traffic of a Megatron step that the step leaves exposed: the gradient reduce after
the last backward and the distributed optimizer's parameter all-gather before the next forward.

What each rank sends, per pipeline stage (`stage_traffic`):
- the gradient reduce over the data-parallel group: dense parameters over dp x cp (`intra_dp_cp_group`),
  the routed experts' over the expert-data-parallel group; a reduce-scatter with the distributed
  optimizer, an all-reduce without (param_and_grad_buffer.py `start_grad_sync`), of DDP's gradient
  buffer (fp32, or 16-bit with grad_reduce_in_bf16: `optimizer.main_gradient_bytes`);
- with the distributed optimizer, the all-gather of the updated parameters (`start_param_sync`) in
  their own dtype: 16-bit, or one byte for the FP8 layers' linear weights under fp8_param_gather
  (ddp config `fp8_param_gather`: FP8 primary weights gathered in FP8).
Ring collectives at `GpuRates.comm_seconds`: the dense group holds ranks tp apart (Megatron's rank
order tp-cp-dp-pp puts cp and dp outside tp), the expert-data-parallel group ranks etp x ep apart.

What of it is exposed (`data_parallel_seconds`), a stated model:
- overlap_grad_reduce off: `finish_grad_sync` runs every bucket after the stage's last backward;
  on: DDP reduces each bucket as the last micro-batch's backward fills it (`register_grad_ready`;
  earlier micro-batches run under no_sync). What backward's end leaves is the last bucket (the first
  layers' and the embedding's gradients, filled last), or, where the reduces outlast the stage's
  backward of one micro-batch (the window they run in), all that window cannot hold.
- Buckets (`bucket_size`): ddp_bucket_size, or Megatron's max(40M, 1M x dp) elements
  (distributed_data_parallel.py `__init__`), filled in reverse order of the parameters
  (`_compute_default_per_buffer_param_layout`), here at layer granularity. Only the first pipeline
  stage's first model chunk is bucketed (training.py `per_chunk_bucket_sizes`: None for later chunks
  and pp rank > 0), so a later stage, or a later chunk, reduces as one bucket.
- overlap_param_gather off: the all-gather runs after the optimizer step; on: it is issued bucket by
  bucket in the forward pre-hooks of the next step's first micro-batch (`finish_param_sync` waits for
  one bucket and dispatches the next), so the first bucket stays exposed, and what outlasts the
  stage's forward of one micro-batch.
- Under pipeline parallel the first stage finishes its backward last and starts its forward first:
  stage s ends its last backward sum_{j<s} B_j / vp earlier (the gradient passes the stages after it
  first) and starts its first forward sum_{j<s} F_j / vp later (B_j, F_j: stage j's backward and
  forward of one micro-batch), so its own reduce and gather are exposed only by what outlasts that
  lead. The step adds the most any stage leaves: the grad-norm all-reduce after it waits for every
  stage.
- A hidden collective still holds its NCCL channels' SMs (`GpuRates.nccl_sms`, as `time_ops.beside_nccl`
  prices a tensor-parallel one): the GEMMs of the window it hides in run on the rest, so the step
  grows by the hidden seconds x nccl_sms / SMs x the window's GEMM share (not priced where the GPU
  table names no channel count).

Left out: the tied embedding's all-reduce between the first and last stages, several
distributed-optimizer instances (priced as one over dp x cp), overlap_param_gather_with_optimizer_step
and align_param_gather, the separate buffers and buckets Megatron keeps per parameter dtype (FP8
weights under fp8_param_gather are bucketed here with the 16-bit ones), the kernel launches of the
buckets. Pure Python.

Sources (Megatron-LM d98e8a6): megatron/core/distributed/distributed_data_parallel.py
(`__init__`: the default bucket size, no buckets for pp rank > 0; `finish_grad_sync`),
distributed_data_parallel_config.py (`bucket_size`, `overlap_grad_reduce`, `overlap_param_gather`,
`fp8_param_gather`), param_and_grad_buffer.py (`start_grad_sync`, `finish_grad_sync`,
`finish_param_sync`, `register_grad_ready`, `_compute_default_per_buffer_param_layout`),
megatron/training/training.py (`per_chunk_bucket_sizes`), megatron/core/process_groups_config.py
(`setup_process_groups_for_ddp`: the bucket size is set from the dp group, without cp).
"""

from __future__ import annotations

from dataclasses import dataclass

from recompute_bench.analysis.gpu_rates import GpuRates
from recompute_bench.analysis.megatron.context_parallel import optimizer_shards
from recompute_bench.analysis.megatron.fp8 import layer_runs_fp8
from recompute_bench.analysis.megatron.layer import layer_linear_weights
from recompute_bench.analysis.megatron.mtp import chunk_layer_indices, is_mtp_layer
from recompute_bench.analysis.megatron.optimizer import main_gradient_bytes
from recompute_bench.analysis.megatron.parameters import chunk_parameter_groups, layer_parameter_groups
from recompute_bench.analysis.megatron.time_ops import ring_bytes
from recompute_bench.config.pipeline_split import ModelChunk, model_chunks
from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES

GROUPS = ("dense", "expert")


def bucket_size(cfg: Config) -> int:
    """Elements per DDP bucket: ddp_bucket_size, or Megatron's default max(40M, 1M x dp)."""
    par = cfg.parallel
    return par.ddp_bucket_size or max(40_000_000, 1_000_000 * par.data_parallel_size)


@dataclass(frozen=True)
class Traffic:
    """One pipeline stage's data-parallel collectives on one rank, in seconds."""

    reduce: float
    """Every gradient bucket reduced, one after another."""
    reduce_tail: float
    """What backward's end leaves to reduce under overlap_grad_reduce: the last bucket of the chunk
    that finishes last (chunk 0), or all of that chunk where it is not bucketed."""
    gather: float
    """Every parameter all-gathered (0 without the distributed optimizer)."""
    gather_head: float
    """The all-gather of the first bucket forward needs, which overlap_param_gather cannot hide."""


@dataclass(frozen=True)
class _Unit:
    """Parameters registered together (a layer, or what a chunk holds beyond its layers), by group."""

    elements: dict[str, float]
    gathered_bytes: dict[str, float]
    """Bytes the parameter all-gather carries of them (the whole tensors, before the ring's share)."""


class _Collectives:
    """The two groups' sizes and strides, and the seconds of a reduce or a gather over them."""

    def __init__(self, cfg: Config, rates: GpuRates):
        par = cfg.parallel
        self.rates = rates
        self.dist = par.use_distributed_optimizer
        self.grad_bytes = main_gradient_bytes(cfg)
        etp = par.expert_tensor_parallel
        self.groups = {"dense": (optimizer_shards(cfg), par.tensor_model_parallel_size),
                       "expert": (par.expert_data_parallel_size, etp * par.expert_model_parallel_size)}

    def reduce(self, elements: dict[str, float]) -> float:
        """Seconds to reduce these gradients: a reduce-scatter with the distributed optimizer, an all-reduce without."""
        kind = "reduce_scatter" if self.dist else "all_reduce"
        return self._ring(kind, {group: n * self.grad_bytes for group, n in elements.items()})

    def gather(self, nbytes: dict[str, float]) -> float:
        """Seconds to all-gather parameters of these bytes (the distributed optimizer only)."""
        return self._ring("all_gather", nbytes) if self.dist else 0.0

    def _ring(self, kind: str, nbytes: dict[str, float]) -> float:
        """Seconds of NCCL's ring `kind` over each group of its whole buffer's bytes, one group after the other
        (within the NVLink domain by its size, where the GPU table has nccl-tests' sweep of it)."""
        out = 0.0
        for group, b in nbytes.items():
            g, stride = self.groups[group]
            if g > 1 and b:
                out += self.rates.comm_seconds(ring_bytes(kind, b, g), g, stride, "ring", kind)
        return out


def _layer_unit(cfg: Config, layer: int) -> _Unit:
    """Layer `layer`'s parameters by group, and the bytes their all-gather carries: the training's
    element size, one byte for an FP8 layer's linear weights under fp8_param_gather."""
    elements = layer_parameter_groups(cfg, layer)
    e = ELEMENT_BYTES[cfg.training.precision]
    gathered = {g: n * e for g, n in elements.items()}
    if cfg.training.fp8_param_gather and layer_runs_fp8(cfg, layer):
        for name, (rows, cols) in layer_linear_weights(cfg, layer).items():
            gathered["expert" if name.startswith("experts.") else "dense"] -= (e - 1) * rows * cols
    return _Unit(elements, gathered)


def _chunk_units(cfg: Config, chunk: ModelChunk, holds_embedding: bool, units: dict) -> list[_Unit]:
    """The chunk's parameters in the order DDP fills its buckets (the reverse of registration): the
    final norm and output layer, the layers last to first, then the embedding. `units`: layer units
    already built, by the layer's kind."""
    e = ELEMENT_BYTES[cfg.training.precision]
    out = []
    if chunk.loss:
        tail = chunk_parameter_groups(cfg, ModelChunk(0, loss=True), holds_embedding)
        out.append(_Unit(tail, {g: n * e for g, n in tail.items()}))
    layered = {g: 0.0 for g in GROUPS}
    for i in reversed(chunk_layer_indices(cfg, chunk.first_layer, chunk.layers, chunk.mtp)):
        key = (cfg.model.is_moe_layer(i), is_mtp_layer(cfg, i), layer_runs_fp8(cfg, i))
        if key not in units:
            units[key] = _layer_unit(cfg, i)
        out.append(units[key])
        for g in GROUPS:
            layered[g] += units[key].elements.get(g, 0.0)
    whole = chunk_parameter_groups(cfg, chunk, holds_embedding)
    rest = {g: whole.get(g, 0.0) - layered[g] - (out[0].elements.get(g, 0.0) if chunk.loss else 0.0) for g in GROUPS}
    if any(n > 0 for n in rest.values()):  # the embedding (and a multi-token-prediction chunk's copy of it)
        out.append(_Unit(rest, {g: n * e for g, n in rest.items()}))
    return out


def _last_bucket(units: list[_Unit], size: int | None) -> _Unit:
    """The last bucket of each group's buffer (what backward fills last, what forward needs first)
    when the units fill buckets of `size` elements in order (None: one bucket)."""
    elements, gathered = {}, {}
    for g in GROUPS:
        bucket_e = bucket_b = 0.0
        last = (0.0, 0.0)
        for u in units:
            n = u.elements.get(g, 0.0)
            if not n:
                continue
            bucket_e, bucket_b = bucket_e + n, bucket_b + u.gathered_bytes.get(g, 0.0)
            last = (bucket_e, bucket_b)
            if size is not None and bucket_e >= size:  # the bucket closes at the unit that fills it
                bucket_e = bucket_b = 0.0
        elements[g], gathered[g] = last
    return _Unit(elements, gathered)


def _total(units: list[_Unit]) -> _Unit:
    return _Unit({g: sum(u.elements.get(g, 0.0) for u in units) for g in GROUPS},
                 {g: sum(u.gathered_bytes.get(g, 0.0) for u in units) for g in GROUPS})


_BUILT: dict[str, Traffic] = {}
"""`stage_traffic` by what it depends on (the model, training and layout, the rates, the stage): a plan
prices many recompute settings of one layout, and none of them changes the traffic."""


def stage_traffic(cfg: Config, rates: GpuRates, stage: int) -> Traffic:
    """Pipeline stage `stage`'s data-parallel collectives on one rank (`Traffic`)."""
    key = repr((cfg.model, cfg.training, cfg.parallel, rates, stage))
    if key not in _BUILT:
        if len(_BUILT) > 4096:
            _BUILT.clear()
        _BUILT[key] = _stage_traffic(cfg, rates, stage)
    return _BUILT[key]


def _stage_traffic(cfg: Config, rates: GpuRates, stage: int) -> Traffic:
    comm = _Collectives(cfg, rates)
    chunks = model_chunks(cfg, stage)
    holds_embedding = any(c.embedding for c in chunks)
    built: dict = {}
    per_chunk = [_chunk_units(cfg, c, holds_embedding, built) for c in chunks]
    whole = _total([u for units in per_chunk for u in units])
    bucketed = stage == 0 and cfg.parallel.overlap_grad_reduce  # training.py: only pp rank 0's chunk 0
    first = _last_bucket(per_chunk[0], bucket_size(cfg) if bucketed else None)
    return Traffic(comm.reduce(whole.elements), comm.reduce(first.elements), comm.gather(whole.gathered_bytes),
                   comm.gather(first.gathered_bytes))


def data_parallel_seconds(cfg: Config, rates: GpuRates, forward: list[float], backward: list[float],
                          forward_gemm: list[float], backward_gemm: list[float]) -> dict[str, float]:
    """The seconds the data-parallel gradient reduce ("grad_reduce") and parameter all-gather
    ("param_gather") add to the step (the module's model): `forward` and `backward` are each stage's
    forward and backward (with its recompute) of one micro-batch, `forward_gemm` and `backward_gemm`
    the GEMM seconds within them."""
    par = cfg.parallel
    out = {"grad_reduce": 0.0, "param_gather": 0.0}
    if optimizer_shards(cfg) == 1 and par.expert_data_parallel_size == 1:
        return out
    vp = par.virtual_pipeline_model_parallel_size or 1
    sm_share = rates.nccl_sms / rates.sms if rates.nccl_sms and rates.sms else 0.0
    for s in range(par.pipeline_model_parallel_size):
        t = stage_traffic(cfg, rates, s)
        reduce, hidden = t.reduce, 0.0
        if par.overlap_grad_reduce:
            reduce = max(t.reduce_tail, t.reduce - backward[s])
            hidden = t.reduce - reduce
        reduce += hidden * sm_share * (backward_gemm[s] / backward[s] if backward[s] else 0.0)
        gather, hidden = t.gather, 0.0
        if par.overlap_param_gather:
            gather = t.gather_head + max(0.0, t.gather - t.gather_head - forward[s])
            hidden = t.gather - gather
        gather += hidden * sm_share * (forward_gemm[s] / forward[s] if forward[s] else 0.0)
        out["grad_reduce"] = max(out["grad_reduce"], reduce - sum(backward[:s]) / vp)
        out["param_gather"] = max(out["param_gather"], gather - sum(forward[:s]) / vp)
    return out


__all__ = ["Traffic", "bucket_size", "data_parallel_seconds", "stage_traffic"]
