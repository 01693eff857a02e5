"""Where a bf16 llama layer casts (issue 35: SwiGLU and RoPE without extra casts): a step's forward
and backward, every `_to_copy` and dtype-changing `copy_` found by where it runs. SwiGLU, RoPE (its
tables are buffers in the model's dtype), attention and the linears cast nothing; the casts are the
CPU's exact RMSNorm (CUDA runs the fused kernel) and the loss's fp32 chunks."""

import traceback
from collections import Counter

import torch
from helpers import config
from torch.utils._python_dispatch import TorchDispatchMode

from recompute_bench.measure.step import synthetic_batches
from recompute_bench.models.dense.layers import build_model


class _Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast = func == torch.ops.aten._to_copy.default or (
            func == torch.ops.aten.copy_.default and args[0].dtype != args[1].dtype)
        if cast:
            ours = [f for f in traceback.extract_stack() if "recompute_bench" in f.filename]
            self.where[(ours[-1].filename.split("recompute_bench/")[-1], ours[-1].name) if ours else ("autograd", "")] += 1
        return out


def test_a_bf16_llama_layer_casts_only_in_the_cpu_norm_and_the_loss():
    cfg = config("llama3-8b", sets=["model.num_layers=2", "model.hidden_size=128", "model.ffn_hidden_size=256",
                                     "model.num_attention_heads=4", "model.num_query_groups=2",
                                     "training.seq_length=64", "model.vocab_size=512"])
    model = build_model(cfg.model, 1, torch.device("cpu"), torch.bfloat16).train()
    assert {b.dtype for b in model.buffers()} == {torch.bfloat16}  # the RoPE tables
    tokens = synthetic_batches(cfg, torch.device("cpu"))[0]
    with _Casts() as casts:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert casts.where and set(casts.where) <= {("backends/pytorch.py", "forward"), ("backends/pytorch.py", "backward")}
    # 5 norms (2 layers x 2 and the final one) x 3 casts in forward; the loss's 2 per-token ones and its chunk
    assert sum(n for (_, fn), n in casts.where.items() if fn == "forward") == 5 * 3 + 5
