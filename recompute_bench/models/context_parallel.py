"""The sequence split of context parallel, shared by this harness (which runs it) and the estimates
of both frameworks (which count it). Pure Python.

Megatron splits each sequence into 2 x cp equal chunks and gives context-parallel rank r chunks r and
2cp - 1 - r (megatron/core/utils.py `get_batch_on_this_cp_rank`; Transformer Engine's
`get_cu_seqlens_on_cp_rank` assumes the same order). Under a causal mask chunk i attends to i + 1
chunks, so each rank's pair attends to (r + 1) + (2cp - r) = 2cp + 1 chunks: the work is even.
"""

from __future__ import annotations

from recompute_bench.config.choices import HARNESS_COMM_TYPES


def chunk_count(cp: int) -> int:
    """How many chunks a sequence is cut into: 2 x cp (one chunk when cp is 1)."""
    return 2 * cp if cp > 1 else 1


def chunk_length(seq_length: int, cp: int) -> int:
    """Tokens of one chunk: s / 2cp (s when cp is 1)."""
    return seq_length // chunk_count(cp)


def rank_chunks(cp_rank: int, cp: int) -> tuple[int, ...]:
    """The chunk indices context-parallel rank `cp_rank` holds, in sequence order: (r, 2cp - 1 - r)."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} outside 0..{cp - 1}")
    return (0,) if cp == 1 else (cp_rank, 2 * cp - 1 - cp_rank)


def rank_positions(seq_length: int, cp_rank: int, cp: int) -> list[int]:
    """The positions (token indices in the whole sequence) rank `cp_rank` holds, in order."""
    n = chunk_length(seq_length, cp)
    return [c * n + i for c in rank_chunks(cp_rank, cp) for i in range(n)]


def local_seq_length(seq_length: int, cp: int) -> int:
    """Tokens of a sequence on one context-parallel rank: s / cp."""
    return seq_length // cp


def causal_key_chunks(cp_rank: int, cp: int) -> int:
    """Key chunks the rank's queries attend to under a causal mask, summed over its two chunks:
    chunk i sees chunks 0..i, so (r + 1) + (2cp - r) = 2cp + 1 for every rank."""
    return sum(c + 1 for c in rank_chunks(cp_rank, cp))


# ----- attention across the split ---------------------------------------------------------------

CP_KERNELS = ("flash", "sdpa_math")
"""What each block of a rank's attention runs in this harness (`models.cp_attention.BlockKernel`):
torch's fused flash kernel, or the same formulas written out in fp32."""


def chunk_range(chunk: int, seq_length: int, cp: int) -> tuple[int, int]:
    """Positions [start, stop) of chunk `chunk` of the whole sequence."""
    n = chunk_length(seq_length, cp)
    return chunk * n, (chunk + 1) * n


def rank_ranges(seq_length: int, cp_rank: int, cp: int) -> list[tuple[int, int]]:
    """The position ranges rank `cp_rank` holds, in its local order (its first chunk, then its second)."""
    return [chunk_range(c, seq_length, cp) for c in rank_chunks(cp_rank, cp)]


class Block:
    """One attention call of a context-parallel rank: the queries of sequence chunks `q_chunks` (each
    of n = s / 2cp positions, in order) against the keys of `k_chunks`, under the causal mask evaluated
    on the true sequence positions (a key is seen when its position is at most the query's).

    `kind` says what that mask leaves: "full" (every key precedes every query), "diagonal" (queries and
    keys are the same chunks: the causal mask of the square, aligned top-left, which a fused kernel
    takes as `is_causal`), or "offset" (queries of one chunk against a prefix ending with that chunk:
    the causal mask shifted by the prefix, which the explicit kernel applies as a mask and a fused
    kernel runs as the prefix's "full" block plus the chunk's "diagonal" one, `fused_blocks`)."""

    __slots__ = ("q_chunks", "k_chunks", "step")

    def __init__(self, q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], step: int = 0):
        self.q_chunks, self.k_chunks, self.step = tuple(q_chunks), tuple(k_chunks), step

    @property
    def kind(self) -> str:
        if self.q_chunks == self.k_chunks:
            return "diagonal"
        if max(self.k_chunks) < min(self.q_chunks):
            return "full"
        if len(self.q_chunks) == 1 and self.k_chunks == tuple(range(self.q_chunks[0] + 1)):
            return "offset"
        raise ValueError(f"block {self.q_chunks} x {self.k_chunks} has no mask this harness runs")

    def pairs(self, n: int, kernel_pairs=None) -> int:
        """(query, key) pairs a kernel evaluates for chunks of n positions: every pair of the
        rectangle, except a "diagonal" block under a fused kernel (`kernel_pairs(square side)`: the
        tiles its causal mask does not hide wholly)."""
        rows, cols = n * len(self.q_chunks), n * len(self.k_chunks)
        if self.kind == "diagonal" and kernel_pairs is not None:
            return kernel_pairs(rows)
        return rows * cols

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Block) and (self.q_chunks, self.k_chunks, self.step) == (other.q_chunks, other.k_chunks, other.step)

    def __repr__(self) -> str:
        return f"Block(q={self.q_chunks}, k={self.k_chunks}, step={self.step})"


def attention_blocks(cp_rank: int, cp: int, comm_type: str) -> list[Block]:
    """The attention calls of rank `cp_rank`, in order, with the step of the exchange each waits for.

    all_gather (Megatron's `all_gather`, Llama 3's context parallel; Transformer Engine's
    `AttnFuncWithCPAndKVAllGather`): K and V of the whole sequence are gathered once (step 0); each
    local chunk c attends to chunks 0..c, the causal mask offset by c x n ("offset").

    p2p (a ring; Megatron's default, TE's `AttnFuncWithCPAndKVP2P`, torch's `_templated_ring_attention`
    with its head-tail load balancing): at step i the rank holds the K and V of rank (r - i) mod cp.
    Step 0 is its own two chunks against themselves ("diagonal"); from an earlier rank (src < r) both
    local chunks see that rank's first chunk only, whole; from a later rank (src > r) only the local
    second chunk sees both of that rank's chunks, whole. Every step is the same work, 2n x n pairs
    (the diagonal's kept half of 2n x 2n), on every rank."""
    if comm_type not in HARNESS_COMM_TYPES:
        raise ValueError(f"cp_comm_type {comm_type!r} is not one of {HARNESS_COMM_TYPES}")
    mine = rank_chunks(cp_rank, cp)
    if cp == 1:
        return [Block((0,), (0,))]
    if comm_type == "all_gather":
        return [Block((c,), tuple(range(c + 1))) for c in mine]
    blocks = [Block(mine, mine)]
    for step in range(1, cp):
        src = (cp_rank - step) % cp
        theirs = rank_chunks(src, cp)
        blocks.append(Block(mine, theirs[:1], step) if src < cp_rank else Block(mine[1:], theirs, step))
    return blocks


def fused_blocks(blocks: list[Block]) -> list[Block]:
    """The blocks as a fused kernel runs them: an "offset" block (a chunk against a prefix ending with
    itself) becomes the prefix before the chunk, whole, and the chunk against itself, causal."""
    out = []
    for block in blocks:
        if block.kind == "offset":
            c = block.q_chunks[0]
            if c > 0:
                out.append(Block((c,), tuple(range(c)), block.step))
            out.append(Block((c,), (c,), block.step))
        else:
            out.append(block)
    return out


def rank_attention_pairs(seq_length: int, cp: int, comm_type: str, fused: bool, kernel_pairs=None) -> int:
    """(query, key) pairs the attention of one sequence evaluates over all cp ranks: each rank's
    blocks (`attention_blocks`, as a fused kernel runs them when `fused`), each block whole except a
    diagonal one under a fused kernel (`kernel_pairs(side)`, see `Block.pairs`)."""
    n = chunk_length(seq_length, cp)
    total = 0
    for r in range(cp):
        blocks = attention_blocks(r, cp, comm_type)
        for block in fused_blocks(blocks) if fused else blocks:
            total += block.pairs(n, kernel_pairs if fused else None)
    return total


def rank_seq_length(cfg) -> int:
    """Positions of a sequence one context-parallel rank of `cfg` holds: s / cp (s without context parallel)."""
    return local_seq_length(cfg.training.seq_length, cfg.parallel.context_parallel_size)


def torch_ring_applies(device: str, kernel: str, comm_type: str, heads: int, groups: int) -> bool:
    """Whether torch's own `context_parallel` ring attention runs a rank's attention instead of this
    harness's (`models.cp_attention`): on CUDA with the flash kernel (torch dispatches only its CUDA
    SDPA kernels to its ring), as a ring (p2p), and with one key/value head per query head (its ring
    handlers call the kernel with the heads they are given). It runs the p2p blocks."""
    return str(device).split(":")[0] == "cuda" and kernel == "flash" and comm_type == "p2p" and heads == groups
