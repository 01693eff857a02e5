"""This harness's training step against a plain PyTorch loop of the same model and the same precision
recipe, measured side by side in one process on whatever device is present, eager and compiled.

The plain loop (`PlainGPT`, `PlainStep`) is what a user would write: nn.Linear, torch's own norm
(`F.rms_norm` / `F.layer_norm`), `F.scaled_dot_product_attention`, `F.cross_entropy`, and the same
recipe as the harness: 16-bit weights, fp32 main gradients (each micro-batch's gradients added into
them, one multi-tensor add), torch's fused Adam over fp32 master weights, one multi-tensor copy back.
The harness runs its own step (`measure.step.Stepper` over the model `layout.build` makes, no
recompute). Both draw the same shapes from one resolved workload; dropout is off in both.

Printed: each variant's median step time over interleaved rounds and its speed as a ratio of the
plain eager loop's (plain time / variant time: 1.00 is as fast, 0.82 is 18% slower), the peak memory
of each (CUDA: the allocator's peak; CPU: the profiler's peak of live bytes above the step's start),
and the operators whose self time differs most between the harness's eager step and the plain
eager loop (torch.profiler, one step each).

    python bench/step_overhead.py [--workload llama3-8b] [--rounds 5] [--no-compile] [--threads 1] [--set section.key=value ...]

On a CPU the default is a small llama-shaped slice (a couple of minutes on two cores, compile
included); on CUDA the llama3-8b slice of the first GPU run (4 layers, seq 8192, micro-batch 1).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from recompute_bench.launch.compiler import compile_problem
from recompute_bench.measure.compile import COMPILE_BACKEND
from recompute_bench.measure.layout import DTYPES, SingleRank
from recompute_bench.measure.point import float32_matmul_precision, pick_device
from recompute_bench.measure.step import synthetic_batches
from recompute_bench.workload import resolve

CPU_SETS = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
            "model.ffn_hidden_size=352", "model.vocab_size=2048", "model.max_position_embeddings=256",
            "training.seq_length=128", "training.global_batch_size=2", "training.micro_batch_size=1"]
"""The CPU proxy: llama3-8b's layer (RMSNorm, GQA, RoPE, SwiGLU, untied output) at a small shape."""
CUDA_SETS = ["model.num_layers=4", "training.global_batch_size=1", "training.micro_batch_size=1"]
"""The llama3-8b slice of the first H200 run (`shared/gpu-runs/2026-11-28-h200`)."""


# ----- the plain loop --------------------------------------------------------------------------

def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class PlainLayer(nn.Module):
    def __init__(self, m, dtype):
        super().__init__()
        self.m = m
        h, d = m.hidden_size, m.head_dim
        self.norm1 = nn.RMSNorm(h, m.layernorm_epsilon) if m.normalization == "RMSNorm" else nn.LayerNorm(h, m.layernorm_epsilon)
        self.norm2 = nn.RMSNorm(h, m.layernorm_epsilon) if m.normalization == "RMSNorm" else nn.LayerNorm(h, m.layernorm_epsilon)
        self.qkv = nn.Linear(h, (m.num_attention_heads + 2 * m.groups) * d, bias=m.add_bias_linear)
        self.proj = nn.Linear(m.num_attention_heads * d, h, bias=m.add_bias_linear)
        self.swiglu = m.activation == "swiglu"
        self.fc1 = nn.Linear(h, m.ffn_hidden_size * (2 if self.swiglu else 1), bias=m.add_bias_linear)
        self.fc2 = nn.Linear(m.ffn_hidden_size, h, bias=m.add_bias_linear)

    def forward(self, x, cos, sin):
        m, (b, s) = self.m, x.shape[:2]
        heads, groups, d = m.num_attention_heads, m.groups, m.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([heads * d, groups * d, groups * d], dim=-1)
        q, k, v = q.view(b, s, heads, d), k.view(b, s, groups, d), v.view(b, s, groups, d)
        if cos is not None:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=groups != heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        y = self.fc1(self.norm2(x))
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return x + self.fc2(y)


class PlainGPT(nn.Module):
    def __init__(self, m, dtype):
        super().__init__()
        self.m = m
        vocab = m.padded_vocab_size()
        self.embed = nn.Embedding(vocab, m.hidden_size)
        self.pos = nn.Embedding(m.max_position_embeddings, m.hidden_size) if m.position_embedding_type == "learned_absolute" else None
        self.layers = nn.ModuleList(PlainLayer(m, dtype) for _ in range(m.num_layers))
        self.norm = nn.RMSNorm(m.hidden_size, m.layernorm_epsilon) if m.normalization == "RMSNorm" else nn.LayerNorm(m.hidden_size, m.layernorm_epsilon)
        self.out = nn.Linear(m.hidden_size, vocab, bias=False)
        if m.share_embeddings_and_output_weights:
            self.out.weight = self.embed.weight
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, m.init_method_std)
        self.to(dtype)
        if m.position_embedding_type == "rope":
            d = m.rotary_dim
            inv = 1.0 / (m.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            angles = torch.outer(torch.arange(m.max_position_embeddings, dtype=torch.float64), inv)
            self.register_buffer("cos", angles.cos()[:, None, :].to(dtype), persistent=False)
            self.register_buffer("sin", angles.sin()[:, None, :].to(dtype), persistent=False)
        else:
            self.cos = self.sin = None

    def forward(self, tokens, labels):
        s = tokens.shape[1]
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos.weight[:s]
        cos, sin = (self.cos[:s], self.sin[:s]) if self.cos is not None else (None, None)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.reshape(-1))


class PlainStep:
    """A plain training loop with fp32 main gradients and fp32 master weights under 16-bit weights."""

    def __init__(self, model: nn.Module, batches: torch.Tensor, lr: float = 1e-4):
        self.model, self.batches = model, batches
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = self.params[0].dtype != torch.float32
        self.master = [p.detach().float().clone() for p in self.params] if self.mixed else self.params
        self.main_grads = [torch.zeros_like(m) for m in self.master]
        for m, g in zip(self.master, self.main_grads):
            m.grad = g
        self.adam = torch.optim.Adam(self.master, lr=lr, fused=True)

    def step(self) -> torch.Tensor:
        n = len(self.batches)
        total = torch.zeros((), device=self.batches.device)
        for tokens in self.batches:
            loss = self.model(tokens[:, :-1], tokens[:, 1:])
            (loss / n).backward()
            grads = [p.grad for p in self.params]
            if self.mixed:
                torch._foreach_add_(self.main_grads, grads)
                for p in self.params:
                    p.grad = None
            total += loss.detach()
        self.adam.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        for g in self.main_grads:
            g.zero_()
        if not self.mixed:
            for p, g in zip(self.params, self.main_grads):
                p.grad = g  # fp32: the main gradients are the parameters' own, kept between steps
        return total / n


# ----- measuring -------------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def self_times(device: torch.device, step) -> tuple[dict[str, tuple[float, int]], int | None]:
    """{operator: (self time in seconds, calls)} of one step under torch.profiler, and on a CPU the
    peak of live bytes above the step's start (the profiler's allocation events in time order)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=device.type != "cuda") as prof:
        step()
        sync(device)
    out: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        if us > 0 and not e.key.startswith(("ProfilerStep", "[memory]")):
            out[e.key] = (us / 1e6, e.count)
    peak = None
    if device.type != "cuda":
        live = high = 0
        # each operator's own allocations net of its frees (children apart), in the order they started
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            live += e.self_cpu_memory_usage
            high = max(high, live)
        peak = high
    return out, peak


def harness_paths(cfg, device: torch.device) -> str:
    """The harness's fused paths on this device, and what its loss holds (analysis.harness.stage)."""
    from recompute_bench.analysis.harness.stage import loss_saved_bytes, loss_workspace_bytes
    from recompute_bench.backends.main_grad_linear import FUSED_DEVICES
    from recompute_bench.models import loss_chunk_rows
    from recompute_bench.models.context_parallel import rank_seq_length

    tokens = rank_seq_length(cfg) * cfg.training.micro_batch_size
    rows = loss_chunk_rows(tokens, cfg.vocab_rows)
    norm = ("nn.LayerNorm (fused)" if cfg.model.normalization == "LayerNorm" else
            "F.rms_norm (fused)" if device.type == "cuda" else "one-node autograd RMSNorm (exact)")
    wgrad = ("into the fp32 main gradients inside the matmul" if device.type in FUSED_DEVICES
             else "autograd's, then added into the fp32 main gradients (exact)")
    return (f"harness paths: {norm}; cross-entropy chunked, {rows} of {tokens} tokens a chunk: "
            f"keeps {loss_saved_bytes(cfg, device.type)['loss.logits_gradient']:,.0f} B (the gradient in the "
            f"logits), fp32 chunk {loss_workspace_bytes(cfg):,.0f} B; linear weight gradients {wgrad}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="llama3-8b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--top", type=int, default=12, help="operators listed by their difference in self time")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: on a shared machine a parallel region waits for its slowest core)")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    device = pick_device()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    sets = (CUDA_SETS if device.type == "cuda" else CPU_SETS) if args.workload == "llama3-8b" else []
    sets = [*sets, *args.sets, "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
    cfg, _ = resolve(args.workload, sets=sets, gpu="cpu")
    dtype = DTYPES[cfg.training.precision]
    batches = synthetic_batches(cfg, device)
    compile_ok = not args.no_compile and compile_problem(device.type) is None
    if not args.no_compile and not compile_ok:
        print(f"compiled variants left out: {compile_problem(device.type)}")

    with float32_matmul_precision(device, cfg.training.precision):
        variants = {}
        layout = SingleRank()
        harness = layout.build(cfg, device).train()
        variants["harness eager"] = layout.stepper(cfg, harness, layout.optimizer(harness, cfg.training.precision), batches)
        torch.manual_seed(cfg.training.seed)
        plain = PlainGPT(cfg.model, dtype).to(device).train()
        variants["plain eager"] = PlainStep(plain, batches)
        if compile_ok:
            compiled_cfg, _ = resolve(args.workload, sets=[*sets, "training.compile=true"], gpu="cpu")
            compiled = layout.build(compiled_cfg, device).train()  # `run --compile`'s model
            variants["harness compiled"] = layout.stepper(cfg, compiled, layout.optimizer(compiled, cfg.training.precision),
                                                          batches)
            torch.manual_seed(cfg.training.seed)
            plain_c = PlainGPT(cfg.model, dtype).to(device).train()
            for layer in plain_c.layers:
                layer.compile(backend=COMPILE_BACKEND)
            variants["plain compiled"] = PlainStep(plain_c, batches)

        first = {}
        for name, v in variants.items():  # warm-up (and compilation): two steps each
            start = time.perf_counter()
            first[name] = v.step().item()
            v.step()
            sync(device)
            first[name + " warm-up s"] = time.perf_counter() - start

        times: dict[str, list[float]] = defaultdict(list)
        peaks: dict[str, int | None] = {}
        for _ in range(args.rounds):
            for name, v in variants.items():
                sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                v.step()
                sync(device)
                times[name].append(time.perf_counter() - start)
                if device.type == "cuda":
                    peaks[name] = torch.cuda.max_memory_allocated(device)
        profiles = {}
        for name in ("harness eager", "plain eager"):
            profiles[name], cpu_peak = self_times(device, variants[name].step)
            if device.type != "cuda":
                peaks[name] = cpu_peak
        if device.type != "cuda":
            for name in variants:
                if name not in peaks:
                    peaks[name] = self_times(device, variants[name].step)[1]

    m, t = cfg.model, cfg.training
    print(f"{args.workload}: {m.num_layers} layers, h {m.hidden_size}, seq {t.seq_length}, micro-batch "
          f"{t.micro_batch_size} x {cfg.num_microbatches}, {t.precision} weights, fp32 master weights and main "
          f"gradients, on {device} ({args.rounds} interleaved rounds, median)")
    print(harness_paths(cfg, device))
    base = statistics.median(times["plain eager"])
    peak_label = "peak alloc" if device.type == "cuda" else "peak above start"
    print(f"{'variant':<20}{'step':>11}{'plain eager / it':>18}{peak_label:>20}{'first loss':>12}{'warm-up':>10}")
    for name in variants:
        med = statistics.median(times[name])
        peak = f"{peaks[name]:,}" if peaks.get(name) is not None else "-"
        print(f"{name:<20}{med * 1e3:>9.2f}ms{base / med:>17.3f}x{peak:>20}{first[name]:>12.4f}"
              f"{first[name + ' warm-up s']:>9.1f}s")
    if "harness compiled" in variants:
        c = statistics.median(times["harness compiled"])
        print(f"harness compiled / harness eager: {statistics.median(times['harness eager']) / c:.3f}x; "
              f"plain compiled / plain eager: {base / statistics.median(times['plain compiled']):.3f}x")

    h, p = profiles["harness eager"], profiles["plain eager"]
    diff = sorted(set(h) | set(p), key=lambda k: -abs(h.get(k, (0, 0))[0] - p.get(k, (0, 0))[0]))
    print(f"\noperators by self {'device' if device.type == 'cuda' else 'CPU'} time, harness eager vs plain eager "
          f"(one step each; the {args.top} largest differences)")
    print(f"{'operator':<58}{'harness':>11}{'calls':>7}{'plain':>11}{'calls':>7}{'difference':>12}")
    for k in diff[:args.top]:
        (ht, hc), (pt, pc) = h.get(k, (0.0, 0)), p.get(k, (0.0, 0))
        print(f"{k[:57]:<58}{ht * 1e3:>9.2f}ms{hc:>7}{pt * 1e3:>9.2f}ms{pc:>7}{(ht - pt) * 1e3:>+10.2f}ms")
    total_h, total_p = sum(v[0] for v in h.values()), sum(v[0] for v in p.values())
    print(f"{'all operators':<58}{total_h * 1e3:>9.2f}ms{'':>7}{total_p * 1e3:>9.2f}ms{'':>7}{(total_h - total_p) * 1e3:>+10.2f}ms")
    if not all(math.isfinite(v) for v in first.values()):
        raise SystemExit("a variant's loss is not finite")


if __name__ == "__main__":
    main()
