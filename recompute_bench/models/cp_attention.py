"""Attention across a context-parallel split (torch): this rank's queries against every rank's keys.

Each rank holds two chunks of every sequence (`models.context_parallel`: chunks r and 2cp - 1 - r of
2cp). Core attention runs as one autograd function per layer, the way Transformer Engine's
`AttnFuncWithCPAndKVAllGather` / `AttnFuncWithCPAndKVP2P` and torch's ring attention run it: the
rank's queries meet the keys and values of the whole sequence block by block
(`context_parallel.attention_blocks`), each block giving its output and the log-sum-exp of its
scores, merged exactly (`merge`); it saves only this rank's q, k, v, its output and the fp32
log-sum-exp per query, and its backward exchanges K and V again and sends each rank its keys' and
values' gradients:

- `all_gather`: K and V of every rank gathered once (an all-gather) and put in sequence order; each
  local chunk attends to the prefix ending with it, the causal mask offset by its start. Backward
  gathers again and reduce-scatters the gradients of K and V to their owners.
- `p2p`: a ring: at step i the rank holds rank (r - i) mod cp's K and V and passes them on
  (isend/irecv); backward passes K and V around again with the gradients accumulated so far, which
  arrive at their owner after a last step.

Per block a kernel computes (out, lse) and, in backward, the block's gradients from the merged output
and log-sum-exp: `flash`, torch's fused flash kernel for one block (`_scaled_dot_product_flash_attention_for_cpu`
on a CPU, `_scaled_dot_product_flash_attention` on CUDA; no dropout, which CPU flash does not take),
or `sdpa_math`, the same formulas written out in fp32 (the stand-in for sdpa's math fallback, which
one rank runs with attention dropout on a CPU): scores, the causal mask of the block, exp(S - lse),
dropout, times V; its backward recomputes the scores (3 QK-sized and 2 PV-sized matmuls, as a fused
kernel's). Dropout masks are drawn per block from a generator seeded by one draw of the default
generator in forward, so backward draws them again in any order and a checkpoint's RNG restore
makes its recompute draw the same ones.

On CUDA, `p2p` with the flash kernel and as many key/value heads as query heads runs torch's own
`context_parallel` ring attention instead (`torch_ring_applies`); the record names the path that ran.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from recompute_bench.models.context_parallel import (CP_KERNELS, Block, attention_blocks, chunk_count, chunk_length, fused_blocks, rank_chunks,
                                                     rank_positions, rank_ranges, torch_ring_applies)

# ----- merging partial softmaxes -----------------------------------------------------------------

def merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold one block's (output, log-sum-exp) over some keys into the running (out, lse) over other
    keys of the same queries, in place (fp32): softmax over the union = each part's softmax weighted
    by exp(its lse - the union's lse). A row with no keys yet has lse -inf and weight 0."""
    new = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(part_out.float() * torch.exp(part_lse - new).unsqueeze(-1))
    lse.copy_(new)


# ----- block kernels -------------------------------------------------------------------------------

def _keep_mask(shape, p: float, seed: int, device: torch.device) -> torch.Tensor:
    """A block's dropout keep-mask (True where kept), drawn from its own seeded generator."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.empty(shape, device=device).bernoulli_(1 - p, generator=g).bool()


def _positions(chunks: tuple[int, ...], n: int, device: torch.device) -> torch.Tensor:
    """The sequence positions of `chunks` (n positions each), in order, made on `device`."""
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in chunks])


def causal_block_mask(block: Block, n: int, device: torch.device) -> Optional[torch.Tensor]:
    """True where the causal mask hides a (query, key) pair of `block`: the key's sequence position is
    after the query's (None: a "full" block). Made on the device, with no host loop, at every call."""
    if block.kind == "full":
        return None
    return _positions(block.k_chunks, n, device).unsqueeze(0) > _positions(block.q_chunks, n, device).unsqueeze(1)


def _repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


class BlockKernel:
    """One block's attention: forward gives (out, lse), backward the block's (dq, dk, dv) from the
    merged output and log-sum-exp. Tensors [b, heads, length, d]; k and v may have fewer heads (GQA)."""

    def __init__(self, name: str, scale: float, dropout_p: float, n: int):
        if name not in CP_KERNELS:
            raise ValueError(f"context-parallel attention kernel {name!r} is not one of {CP_KERNELS}")
        self.name, self.scale, self.dropout_p, self.n = name, scale, dropout_p, n
        self.cuda_rest: dict[int, list] = {}

    def blocks(self, blocks: list[Block]) -> list[Block]:
        """The blocks as this kernel runs them (a fused kernel splits an offset block)."""
        return fused_blocks(blocks) if self.name == "flash" else blocks

    def forward(self, q, k, v, block: Block, index: int, seed: int):
        """Block `index`'s (out, lse) over its keys."""
        if self.name == "flash":
            return self._flash_forward(q, k, v, block.kind == "diagonal", index)
        return self._math_forward(q, k, v, block, seed + index)

    def backward(self, dout, q, k, v, out, lse, block: Block, index: int, seed: int):
        """Block `index`'s (dq, dk, dv) given the merged output and log-sum-exp of its queries."""
        if self.name == "flash":
            return self._flash_backward(dout, q, k, v, out, lse, block.kind == "diagonal", index)
        return self._math_backward(dout, q, k, v, out, lse, block, seed + index)

    # torch's fused flash kernel, one block
    def _flash_forward(self, q, k, v, causal: bool, index: int):
        if q.is_cuda:
            # CUDA's flash returns, beside out and lse, what its backward takes back: the cumulative and
            # maximal lengths of a dense batch and the (unused without dropout) philox state
            out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                                 scale=self.scale)
            self.cuda_rest[index] = rest[:6]
            return out, lse
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)

    def _flash_backward(self, dout, q, k, v, out, lse, causal: bool, index: int):
        # A block's rows of the merged log-sum-exp are a strided view of it. CUDA's flash backward reads
        # the log-sum-exp by its data pointer alone, as one contiguous [b, heads, s_q] array
        # (ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_bwd: `softmax_lse.data_ptr()`,
        # no stride), so a view hands it other rows' values and the gradients are wrong; torch's own
        # ring does the same (_context_parallel/_attention.py, _templated_ring_attention_backward:
        # "Need to make logsumexp contiguous"). q, k, v, out and dout it reads through their strides.
        lse = lse.contiguous()
        if q.is_cuda:
            cum_q, cum_k, max_q, max_k, seed, offset = self.cuda_rest[index]
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=self.scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=self.scale)

    # the same formulas, written out in fp32
    def _probs(self, q, k, block: Block, lse=None):
        heads = q.shape[1]
        scores = torch.matmul(q.float(), _repeat_kv(k, heads).float().transpose(-2, -1)) * self.scale
        hidden = causal_block_mask(block, self.n, q.device)
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def _dropped(self, probs, seed: int):
        if self.dropout_p == 0:
            return probs, None
        keep = _keep_mask(probs.shape, self.dropout_p, seed, probs.device)
        return probs * keep / (1 - self.dropout_p), keep

    def _math_forward(self, q, k, v, block: Block, seed: int):
        probs, lse = self._probs(q, k, block)
        dropped, _ = self._dropped(probs, seed)
        return torch.matmul(dropped, _repeat_kv(v, q.shape[1]).float()), lse

    def _math_backward(self, dout, q, k, v, out, lse, block: Block, seed: int):
        heads = q.shape[1]
        probs, _ = self._probs(q, k, block, lse)
        dropped, keep = self._dropped(probs, seed)
        dout = dout.float()
        vf = _repeat_kv(v, heads).float()
        dv = torch.matmul(dropped.transpose(-2, -1), dout)
        dp = torch.matmul(dout, vf.transpose(-2, -1))
        if keep is not None:
            dp = dp * keep / (1 - self.dropout_p)
        rowsum = (dout * out.float()).sum(-1, keepdim=True)  # D = rowsum(dO * O) of the merged output
        ds = probs * (dp - rowsum) * self.scale
        dq = torch.matmul(ds, _repeat_kv(k, heads).float())
        dk = torch.matmul(ds.transpose(-2, -1), q.float())
        groups = k.shape[1]
        if groups != heads:  # each key/value head served heads / groups query heads: sum their gradients
            dk = dk.unflatten(1, (groups, heads // groups)).sum(2)
            dv = dv.unflatten(1, (groups, heads // groups)).sum(2)
        return dq, dk, dv


# ----- exchanging K and V ----------------------------------------------------------------------------

class _Peers:
    """The context-parallel group and this rank's neighbours on the ring (global ranks)."""

    def __init__(self, group, cp_rank: int, cp: int):
        self.group, self.rank, self.size = group, cp_rank, cp
        self.next = dist.get_global_rank(group, (cp_rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (cp_rank - 1) % cp)

    def shift(self, t: torch.Tensor) -> list:
        """Start sending `t` to the next rank and receiving the previous rank's into a new tensor:
        (handles, received)."""
        received = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group), dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return [dist.batch_isend_irecv(ops), received]

    @staticmethod
    def wait(started: list) -> torch.Tensor:
        for handle in started[0]:
            handle.wait()
        return started[1]

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` stacked along a new leading dimension, in rank order."""
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, t.contiguous(), group=self.group)
        return out.unflatten(0, (self.size, t.shape[0]))

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """t is [cp, ...], one slice per rank: each rank gets the sum over ranks of its own slice."""
        out = torch.empty(t.shape[1:], dtype=t.dtype, device=t.device)
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, t.flatten(0, 1).contiguous(), group=self.group)
        return out


def _sequence_order(cp: int, n: int, device: torch.device) -> torch.Tensor:
    """For the ranks' local positions laid end to end in rank order, each one's sequence position."""
    return torch.tensor([p for r in range(cp) for p in rank_positions(2 * cp * n, r, cp)], device=device)


def _rows(block: Block, mine: tuple[int, ...], n: int) -> slice:
    """The local query rows of `block` (its chunks are one or both of this rank's, in order)."""
    first = mine.index(block.q_chunks[0])
    return slice(first * n, (first + len(block.q_chunks)) * n)


def _kv_all_gather(peers: _Peers, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """K and V of the whole sequence, [2, b, groups, s, d] in sequence order."""
    gathered = peers.gather(torch.stack([k, v]))  # [cp, 2, b, g, s/cp, d], rank order
    ranked = gathered.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [2, b, g, s, d], rank order
    whole = torch.empty_like(ranked)
    whole[:, :, :, order] = ranked
    return whole


class _AttentionWithCP(torch.autograd.Function):
    """Core attention over the split (see the module docstring): q [b, heads, s/cp, d], k and v
    [b, groups, s/cp, d] of this rank's two chunks; returns [b, heads, s/cp, d] laid out as
    [b, s/cp, heads, d] in memory (so the [b, s, heads * d] the output projection takes is a view)."""

    @staticmethod
    def forward(ctx, q, k, v, split: "SequenceSplit", kernel: BlockKernel):
        peers, n, mine = split.peers, kernel.n, split.chunks
        blocks = kernel.blocks(attention_blocks(peers.rank, peers.size, split.comm_type))
        seed = int(torch.randint(0, 2**62, (), device="cpu").item()) if kernel.dropout_p else 0
        b, heads, local, d = q.shape
        out = torch.zeros(b, heads, local, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, heads, local), float("-inf"), dtype=torch.float32, device=q.device)
        for i, block, kv in _walk(split, blocks, k, v):
            keys = _keys(split, block, kv, n)
            rows = _rows(block, mine, n)
            part_out, part_lse = kernel.forward(q[:, :, rows], keys[0], keys[1], block, i, seed)
            merge(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
        result = torch.empty(b, local, heads, d, dtype=q.dtype, device=q.device).transpose(1, 2)
        result.copy_(out)
        ctx.split, ctx.kernel, ctx.seed = split, kernel, seed
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        split, kernel, seed = ctx.split, ctx.kernel, ctx.seed
        peers, n, mine = split.peers, kernel.n, split.chunks
        blocks = kernel.blocks(attention_blocks(peers.rank, peers.size, split.comm_type))
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dout = dout.contiguous() if kernel.name == "flash" else dout

        def block_grads(i: int, block: Block, keys: torch.Tensor):
            rows = _rows(block, mine, n)
            part = kernel.backward(dout[:, :, rows], q[:, :, rows], keys[0], keys[1], out[:, :, rows], lse[:, :, rows],
                                   block, i, seed)
            dq[:, :, rows] += part[0]
            return part[1], part[2]

        if split.comm_type == "all_gather":
            whole = _kv_all_gather(peers, k, v, split.order)
            grads = torch.zeros(whole.shape, dtype=torch.float32, device=q.device)
            for i, block in enumerate(blocks):
                keys = _key_cols(block, n, split.all_chunks)
                dk, dv = block_grads(i, block, whole[:, :, :, keys])
                grads[0, :, :, keys] += dk
                grads[1, :, :, keys] += dv
            ranked = grads[:, :, :, split.order].unflatten(3, (peers.size, -1)).permute(3, 0, 1, 2, 4, 5)
            dkv = peers.reduce_scatter(ranked)
        else:
            # K and V go around the ring again, each rank adding its blocks' gradients of them to the
            # sum that travels with them; after the last step one more hop brings each sum home.
            kv, travelling = torch.stack([k, v]), None
            pending_kv = pending_grad = None
            for step, blocks_now in enumerate(_by_step(blocks, peers.size)):
                if step > 0:
                    kv, travelling = _Peers.wait(pending_kv), _Peers.wait(pending_grad)
                pending_kv = peers.shift(kv) if step < peers.size - 1 else None
                mine_now = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
                theirs = rank_chunks((peers.rank - step) % peers.size, peers.size)
                for i, block in blocks_now:
                    cols = _key_cols(block, n, theirs)
                    dk, dv = block_grads(i, block, kv[:, :, :, cols])
                    mine_now[0, :, :, cols] += dk
                    mine_now[1, :, :, cols] += dv
                travelling = mine_now if travelling is None else travelling + mine_now
                pending_grad = peers.shift(travelling)
            dkv = _Peers.wait(pending_grad)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _walk(split: "SequenceSplit", blocks: list[Block], k: torch.Tensor, v: torch.Tensor):
    """(index, block, K and V it reads) in order: all_gather gathers once; p2p passes K and V around
    the ring, the next step's exchange started before this step's blocks run."""
    peers = split.peers
    if split.comm_type == "all_gather":
        whole = _kv_all_gather(peers, k, v, split.order)
        for i, block in enumerate(blocks):
            yield i, block, whole
        return
    kv = torch.stack([k, v])
    pending = None
    for step, blocks_now in enumerate(_by_step(blocks, peers.size)):
        if pending is not None:
            kv = _Peers.wait(pending)
        pending = peers.shift(kv) if step < peers.size - 1 else None
        for i, block in blocks_now:
            yield i, block, (kv, (peers.rank - step) % peers.size)


def _by_step(blocks: list[Block], steps: int) -> list[list[tuple[int, Block]]]:
    """The ring's steps, each with its (index, block)s."""
    out: list[list[tuple[int, Block]]] = [[] for _ in range(steps)]
    for i, block in enumerate(blocks):
        out[block.step].append((i, block))
    return out


def _key_cols(block: Block, n: int, held: tuple[int, ...]) -> slice:
    """The columns of `block`'s keys in a K/V buffer holding chunks `held` in order (the whole
    sequence under all_gather, one rank's two chunks in the ring)."""
    first = held.index(block.k_chunks[0])
    return slice(first * n, (first + len(block.k_chunks)) * n)


def _keys(split: "SequenceSplit", block: Block, kv, n: int) -> torch.Tensor:
    """The [2, b, groups, len, d] keys and values `block` reads from what `_walk` handed it."""
    if split.comm_type == "all_gather":
        return kv[:, :, :, _key_cols(block, n, split.all_chunks)]
    buffer, src = kv
    return buffer[:, :, :, _key_cols(block, n, rank_chunks(src, split.peers.size))]


# ----- torch's context_parallel (CUDA) ---------------------------------------------------------------

def _torch_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, scale: float) -> torch.Tensor:
    """torch's ring attention (torch.distributed.tensor.experimental context parallel, head-tail load
    balancing, which is this split) over the "cp" mesh: q, k, v as DTensors sharded on the sequence."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import (_cp_options, _enable_context_parallel_dispatcher,
                                                                         set_rotate_method)

    _cp_options.enable_load_balance = True
    set_rotate_method("alltoall")  # K/V passed to the next rank each step: the ring
    _enable_context_parallel_dispatcher()
    q, k, v = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).to_local()


# ----- this rank's part of each sequence ---------------------------------------------------------------

class SequenceSplit:
    """What one context-parallel rank holds of every sequence, and how its attention reaches the rest:
    `select` takes this rank's positions (chunks r and 2cp - 1 - r) of a whole-sequence tensor,
    `attention` runs core attention over the split."""

    def __init__(self, group, cp_rank: int, cp: int, comm_type: str, seq_length: int, mesh=None):
        self.peers = _Peers(group, cp_rank, cp)
        self.comm_type, self.seq_length, self.mesh = comm_type, seq_length, mesh
        self.chunks = rank_chunks(cp_rank, cp)
        self.all_chunks = tuple(range(chunk_count(cp)))
        """Every chunk of a sequence in order: what an all-gathered K/V buffer holds."""
        self.ranges = rank_ranges(seq_length, cp_rank, cp)
        self.n = chunk_length(seq_length, cp)
        self.order: Optional[torch.Tensor] = None
        """For the ranks' local positions laid end to end in rank order, each one's sequence position."""
        self.path: Optional[str] = None
        """The path the last forward with a graph ran: "all_gather", "p2p" (this module's), "torch_ring"."""
        self.ran: Optional[tuple] = None
        """What that forward's block kernel took (kernel, heads, groups, head dim, dtype, device), for
        `models.cp_check.checked_splits`; None under torch's ring."""

    def select(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of `t` along `dim` (the whole sequence there), in local order."""
        return torch.cat([t.narrow(dim, start, stop - start) for start, stop in self.ranges], dim=dim)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, scale: float,
                  dropout_p: float) -> torch.Tensor:
        """Core attention of this rank's q [b, heads, s/cp, d] against the whole sequence's k and v
        (this rank's given as [b, groups, s/cp, d]); the output as `_AttentionWithCP` lays it out."""
        if torch_ring_applies(q.device.type, kernel, self.comm_type, q.shape[1], k.shape[1]) and self.mesh is not None:
            path = "torch_ring"
            out = _torch_ring(q, k, v, self.mesh, scale)
        else:
            path = self.comm_type
            if self.order is None or self.order.device != q.device:
                self.order = _sequence_order(self.peers.size, self.n, q.device)
            out = _AttentionWithCP.apply(q, k, v, self, BlockKernel(kernel, scale, dropout_p, self.n))
        if torch.is_grad_enabled():
            self.path = path
            self.ran = None if path == "torch_ring" else (kernel, q.shape[1], k.shape[1], q.shape[-1], q.dtype,
                                                          str(q.device))
        return out
