"""What a full-recompute checkpoint keeps, in both frameworks: its [s, b, h] input (this harness's
checkpoint and Megatron's tensor_parallel/random.py CheckpointFunction, or Transformer Engine's,
alike). Pure Python."""

from __future__ import annotations

from recompute_bench.config.schema import Config
from recompute_bench.models import ELEMENT_BYTES
from recompute_bench.models.context_parallel import rank_seq_length


def checkpoint_input_bytes(cfg: Config) -> float:
    """What full recompute keeps per checkpoint: the chunk's [s, b, h] input, sharded over the
    tensor-parallel group with sequence parallelism or `distribute_saved_activations`; under
    context parallel a rank's s/cp tokens (`models.context_parallel.local_seq_length`)."""
    tr, par = cfg.training, cfg.parallel
    nbytes = ELEMENT_BYTES[tr.precision] * rank_seq_length(cfg) * tr.micro_batch_size * cfg.model.hidden_size
    if par.sequence_parallel or cfg.recompute.distribute_saved_activations:
        nbytes /= par.tensor_model_parallel_size
    return nbytes
