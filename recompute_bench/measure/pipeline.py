"""Pipeline parallelism with PyTorch's own engine, `torch.distributed.pipelining`.

The ranks form a (pp, dp, tp) mesh: rank = pp_rank x dp x tp + dp_rank x tp + tp_rank (tensor
parallel innermost, pipeline outermost, as Megatron and torchtitan order them); with context
parallel (pp, dp, cp, tp), each stage sending this rank's s / cp positions (`measure.context_parallel`). Each pipeline rank
holds model chunks (virtual stages `analysis.pipelining_schedule.rank_stages` names: its stage, with virtual
stages r, r + p, ..., under a V schedule r and 2p - 1 - r), each a `GPTStage`: the first virtual
stage has the embedding, the last the final norm and the output layer (the loss is the schedule's
loss function), every one its layers under their model-wide names (`layers.4...`), so gradients
compare by name with one rank's. A chunk is built as torchtitan builds one: tensor parallel, then
recompute, then FSDP2 (`reshard_after_forward=False`: the schedule runs many micro-batches through a
chunk, so its all-gathered weights stay for the step) over the data-parallel group; under `ddp` the
optimizer's main-gradient buckets are all-reduced over it (`measure.data_parallel.BucketedGrads`) at
the optimizer's step.

Each chunk is a hand-made `PipelineStage` with its input and output shapes given (no shape inference
at run time, which needs numpy): the received activation is marked as requiring grad, which is what
lets a stage whose layers hold Megatron's re-entrant checkpoints (`use_reentrant=True`: forward under
no_grad, inputs saved) send a gradient back; a stage input that does not require grad leaves every
earlier stage without one. The loss function divides by the micro-batches and `scale_grads` is off,
so each micro-batch's backward is the single rank's `(loss / n).backward()`, operation for operation.
An embedding tied to the output layer and held by two ranks is two copies whose gradients are summed
over the two ranks after the step (Megatron's embedding group).

A step through the schedule is `measure.pipeline_step.PipelineStepper`'s, the saved tensors over it
`measure.pipeline_probe.ScheduleProbe`'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from recompute_bench.analysis.pipelining_schedule import rank_stages
from recompute_bench.backends.pytorch import local
from recompute_bench.config.schema import Config
from recompute_bench.measure.data_parallel import BUCKET_PARAMETERS, BucketedGrads, DataParallel, fsdp_shard
from recompute_bench.measure.layout import DTYPES
from recompute_bench.measure.optimizer import MainGradAdam, MainGrads, make_adam
from recompute_bench.measure.pipeline_probe import ScheduleProbe
from recompute_bench.measure.pipeline_step import PipelineStepper
from recompute_bench.models.dense.layers import GPT, TransformerLayers
from recompute_bench.recompute.apply import apply_recompute


class StageLayers(TransformerLayers):
    """A model chunk's layers under their model-wide indices (`layers.4`, `layers.5`, ...), indexed
    and iterated in order as `TransformerLayers` is (recompute installs its policies through it)."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def __getitem__(self, i: int) -> nn.Module:
        return list(self._modules.values())[i]


class GPTStage(GPT):
    """One virtual stage of a built GPT, sharing its modules: the embedding on the first, the layers
    `layers`, the final norm and output layer on the last. `forward` takes token ids (first) or hidden
    states and returns hidden states, or the logits (last)."""

    def __init__(self, model: GPT, stage: int, stages: int, layers: range, seq_length: int):
        nn.Module.__init__(self)
        self.cfg, self.backend, self.seq_length = model.cfg, model.backend, seq_length
        first, last = stage == 0, stage == stages - 1
        self.word_embeddings = model.word_embeddings if first else None
        self.position_embeddings = model.position_embeddings if first else None
        self.embedding_dropout = model.embedding_dropout if first else None
        self.rotary = model.rotary
        self.layers = StageLayers({i: model.layers[i] for i in layers})
        self.final_layernorm = model.final_layernorm if last else None
        self.output_layer = model.output_layer if last else None

    def tie_weights(self) -> None:
        """Share the embedding with the output layer where this chunk holds both."""
        if self.word_embeddings is not None and self.output_layer is not None:
            super().tie_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.word_embeddings is not None:
            x = self.embed(x)
        rope = self.rotary(self.seq_length) if self.rotary is not None else ()  # the whole sequence, also under SP
        x = self.layers(x, *rope)
        return self.head(x) if self.output_layer is not None else x


class PipelineChunks(nn.ModuleList):
    """The model chunks (`GPTStage`s) of this rank, in its order."""

    @property
    def layers(self) -> list[nn.Module]:
        """Every layer of every chunk (the MoE routing counts read them)."""
        return [layer for chunk in self for layer in chunk.layers]


class PipelineParallel(DataParallel):
    """Pipeline stages over the "pp" dimension of a (pp, dp, tp) mesh, each stage's chunks tensor
    parallel over "tp" and data parallel (DDP or FSDP2) over "dp"."""

    def __init__(self, kind: str, cfg: Config, device_type: str = "cpu"):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(kind, None, device_type)  # the data-parallel kind; the mesh is made here
        par = cfg.parallel
        self.pp, tp, cp = par.pipeline_model_parallel_size, par.tensor_model_parallel_size, par.context_parallel_size
        self.vp = par.virtual_pipeline_model_parallel_size or 1
        self.schedule_name = par.schedule
        self.dp_size = self.world_size // (self.pp * cp * tp)
        if cp > 1:  # (pp, dp, cp, tp), gradients reduced over dp x cp (`measure.context_parallel`)
            from recompute_bench.measure.context_parallel import ContextParallel, layout_mesh
            self.mesh, self.grad_mesh = layout_mesh(device_type, pp=self.pp, dp=self.dp_size, cp=cp, tp=tp)
            self.context = ContextParallel(cfg, self.mesh)
        else:
            self.mesh = init_device_mesh(device_type, (self.pp, self.dp_size, tp), mesh_dim_names=("pp", "dp", "tp"))
            self.grad_mesh = self.mesh["dp"]
        self.grad_ranks = self.dp_size * cp
        self.pp_rank, self.dp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("dp")
        self.pp_group = self.mesh["pp"].get_group()
        if tp > 1:
            from recompute_bench.measure.tensor_parallel import TensorParallel
            self.tensor = TensorParallel(tp, par.sequence_parallel, device_type, self.mesh)
        self.stages = rank_stages(self.schedule_name, self.pp, self.vp, self.pp_rank)
        self.num_stages = self.pp * len(self.stages)
        self.first, self.last = 0 in self.stages, self.num_stages - 1 in self.stages
        self.embedding_group = self._embedding_groups(cfg)
        self.whole_parameters = 0

    def _embedding_groups(self, cfg: Config):
        """The group of this rank and the rank holding the other copy of a tied embedding (the first
        and the last pipeline rank of its (dp, tp) column), when they are two ranks; every rank makes
        every group, in the same order (`dist.new_group`)."""
        if not cfg.model.share_embeddings_and_output_weights:
            return None
        ends = [r for r in range(self.pp) if {0, self.num_stages - 1} & set(rank_stages(self.schedule_name, self.pp, self.vp, r))]
        if len(ends) < 2:
            return None
        mine = None
        grid = self.mesh.mesh.reshape(self.pp, -1)  # [pp, the (dp, cp, tp) ranks of a stage] -> global rank
        for column in range(grid.shape[1]):
            ranks = [int(grid[r, column]) for r in ends]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def build(self, cfg: Config, device: torch.device, dtype: torch.dtype | None = None) -> PipelineChunks:
        """This rank's model chunks, built as torchtitan builds a stage: the whole model on the meta
        device, cut into this rank's chunks, per chunk tensor parallel, recompute (the chunk's own
        layers' policies) and FSDP2 there, then only the chunks materialised and initialised with the
        values one rank's build holds (`GPT.init_weights` draws every parameter of the whole model in
        order and drops the other stages'). Under DDP the optimizer reduces the main gradients."""
        fsdp = self.kind == "fsdp" and self.grad_ranks > 1
        whole = cfg.spec.build(cfg, "meta", torch.float32 if fsdp else dtype or DTYPES[cfg.training.precision])
        self.whole_parameters = sum(p.numel() for p in whole.parameters())
        per = cfg.model.num_layers // self.num_stages
        chunks = PipelineChunks()
        for v in self.stages:
            chunk = GPTStage(whole, v, self.num_stages, range(v * per, (v + 1) * per), cfg.training.seq_length)
            if (chunk.output_layer is not None and chunk.word_embeddings is None and not self.first
                    and cfg.model.share_embeddings_and_output_weights):
                # this rank's copy; a rank that also holds the embedding (the V's rank 0) keeps the one weight
                chunk.output_layer.weight = nn.Parameter(torch.empty_like(whole.word_embeddings.weight))
            if self.tensor:
                self.tensor.parallelize(chunk)
            if self.context:
                self.context.parallelize(chunk)
            apply_recompute(chunk, cfg.recompute, self.tensor_group, first=v * per)
            if fsdp:
                fsdp_shard(chunk, cfg, self.grad_mesh, reshard_after_forward=False)  # held for the step
            chunks.append(chunk)
        chunks.to_empty(device=device)
        if self.first and self.last:
            whole.tie_weights()  # to_empty gave the V's rank 0 two embeddings, one per chunk: one again
        whole.init_weights(cfg.training.seed)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the initialisation's one whole parameter at a time
        return chunks

    def optimizer(self, model: nn.Module, precision: str):
        """As `DataParallel.optimizer`, its reduction over this rank's data-parallel group."""
        params = [p for p in model.parameters() if p.requires_grad]
        if self.kind == "fsdp" and self.grad_ranks > 1:
            return make_adam(params, 1e-4)
        if self.grad_ranks == 1:
            return MainGradAdam(MainGrads(params), precision)
        group = self.grad_mesh.get_group()
        return MainGradAdam(BucketedGrads(params[::-1], [group] * len(params), self.grad_ranks, BUCKET_PARAMETERS), precision)

    def num_parameters(self, model: nn.Module) -> int:
        """The whole model's parameters (counted before it was cut into stages)."""
        return self.whole_parameters

    def batches(self, cfg: Config, device: torch.device) -> torch.Tensor:
        """The data-parallel replica's micro-batches where this rank embeds tokens or computes the
        loss; nothing (no rows) on a rank between them."""
        if not (self.first or self.last):
            return torch.empty(cfg.num_microbatches, 0, dtype=torch.long, device=device)
        return super().batches(cfg, device)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The loss of the last stage averaged over its data-parallel replicas (every rank gets it)."""
        value = value.detach().clone() if self.last else torch.zeros_like(value)
        dist.all_reduce(value)
        return value / (self.world_size // self.pp)

    def world_flops(self, local_flops: int) -> int:
        """The step's FLOPs over every rank (stages differ: the first embeds, the last has the output
        layer), summed (`DataParallel.summed_flops`)."""
        return self.summed_flops(local_flops)

    def place(self) -> dict[str, Any]:
        """This rank's pipeline stage and model chunks (virtual stages), known before anything runs,
        so a rank that fails in setup is still named by its stage."""
        return {"pipeline_stage": self.pp_rank, "model_chunks": list(self.stages),
                **(self.context.place() if self.context else {})}

    def stepper(self, cfg: Config, model: PipelineChunks, optimizer, batches: torch.Tensor) -> PipelineStepper:
        return PipelineStepper(cfg, model, optimizer, batches, self)

    def probe(self, model: PipelineChunks) -> ScheduleProbe:
        return ScheduleProbe(model, self.stages)

    def sum_tied_embedding(self, model: PipelineChunks) -> None:
        """Megatron's embedding all-reduce (`_allreduce_word_embedding_grads`): the first stage's
        embedding and the last stage's copy each hold part of the tied weight's gradient; both
        become the sum. Where the optimizer moves gradients into fp32 main gradients, those."""
        if self.embedding_group is None:
            return
        for stage in model:
            module = stage.word_embeddings if stage.word_embeddings is not None else stage.output_layer
            if module is None:
                continue
            p = module.weight
            grad = getattr(p, "main_grad", None)
            if grad is None and p.grad is not None:
                if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)  # laid out as the weight, as the copy's
                grad = local(p.grad)
            if grad is not None:
                dist.all_reduce(grad, group=self.embedding_group)

    def schedule(self, model: PipelineChunks, cfg: Config, device: torch.device):
        """torch's schedule over this rank's chunks (`PipelineStage`s with their shapes given)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        tr, par = cfg.training, cfg.parallel
        b, s, n = tr.micro_batch_size, tr.seq_length, cfg.num_microbatches
        tp = par.tensor_model_parallel_size
        dtype = DTYPES[tr.precision]
        mine = s // par.context_parallel_size  # this rank's positions; token ids and labels stay whole
        hidden = torch.empty(b, mine // tp if par.sequence_parallel else mine, cfg.model.hidden_size, dtype=dtype,
                             device="meta", requires_grad=True)  # a stage's input must require grad (see the module doc)
        logits = torch.empty(b, mine, cfg.model.padded_vocab_size(tp) // tp, dtype=dtype, device="meta")
        tokens = torch.empty(b, s, dtype=torch.long, device="meta")
        stages = [PipelineStage(chunk, v, self.num_stages, device, input_args=tokens if v == 0 else hidden,
                                output_args=logits if v == self.num_stages - 1 else hidden, group=self.pp_group)
                  for chunk, v in zip(model, self.stages)]

        def loss_fn(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = model[0].loss(output, labels) / n  # as the single rank's (loss / n).backward()
            return loss.to_local() if hasattr(loss, "to_local") else loss  # the vocabulary-parallel loss, this rank's

        cls = get_schedule_class(self.schedule_name)
        single = issubclass(cls, PipelineScheduleSingle)
        return cls(stages[0] if single else stages, n, loss_fn=loss_fn, scale_grads=False), stages


def pipeline_loss_and_grads(cfg: Config, tokens: torch.Tensor, device: torch.device,
                            layout: PipelineParallel) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """One step's micro-batches `tokens` ([micro-batches, b, s + 1], this data-parallel replica's)
    through torch's schedule over this rank's chunks, dropout seeded with the training seed before
    the step: the step's loss (the mean over micro-batches, averaged over the replicas, on every rank)
    and every gradient whole by its single-rank name on every rank: the tied embedding's two copies
    summed (Megatron's embedding group), averaged over the data-parallel replicas (DDP) or gathered
    (FSDP2's shards, `full_tensor`), tensor-parallel shards in the single-rank layout, then every
    pipeline rank's gathered over the pipeline group."""
    model = layout.build(cfg, device)
    model.train()
    schedule, _ = layout.schedule(model, cfg, device)
    rows = tokens.reshape(-1, tokens.shape[-1])
    losses: list[torch.Tensor] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.training.seed)
        schedule.step(*((rows[:, :-1],) if layout.first else ()), target=rows[:, 1:] if layout.last else None,
                      losses=losses if layout.last else None, return_outputs=False)
    layout.sum_tied_embedding(model)
    loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros((), device=device)
    tied_copy = cfg.model.share_embeddings_and_output_weights
    mine: dict[str, torch.Tensor | None] = {}
    for chunk in model:
        for name, p in chunk.named_parameters():
            if tied_copy and name == "output_layer.weight" and chunk.word_embeddings is None:
                continue  # the copy of word_embeddings.weight: after the sum its gradient is the embedding's
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):
                g = g.full_tensor()
            elif g is not None and layout.grad_ranks > 1:
                g = g.clone()
                dist.all_reduce(g, group=layout.grad_mesh.get_group())
                g /= layout.grad_ranks
            if g is not None and layout.tensor:
                g = layout.tensor.whole(name, g, cfg)
            mine[name] = None if g is None else g.detach().cpu()
    every: list[dict | None] = [None] * layout.pp
    dist.all_gather_object(every, mine, group=layout.pp_group)
    grads = {name: None if g is None else g.to(device) for part in every for name, g in part.items()}
    return layout.mean(loss), grads
