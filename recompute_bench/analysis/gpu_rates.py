"""The rates the time model prices work at, per GPU kind: matrix FLOP/s per precision, HBM bytes/s,
the NVLink bytes/s one GPU sends (one direction), the host link (CPU offload) and the network past
the NVLink domain. Every figure comes from the one GPU table (`config.gpus`, each with its source):
`datasheet_rates` (the roofline) or `achieved_rates` (what the plan prices at: the maximum achievable
matmul rate a published microbenchmark or our own run measured, the measured copy bandwidth, and the
waves a GEMM's tiles take over the SMs, and nccl-tests' collectives by message size where a sweep was
published for the kind), or from a profile measured on the GPU itself
(`measure/rates.py`, cached under results/profiles/; ours ship in `data/profiles/`), which overrides
what it measured. Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recompute_bench.analysis.cache import cache_file, read_json
from recompute_bench.config.gpus import ATTENTION_SHARE, COPY_SHARE, KINDS, LINK_SHARE, MULTI_TENSOR_SHARE, Gpu, NcclTable
from recompute_bench.config.schema import BadInput

RATES_SCHEMA = "recompute-bench/gpu-rates/v1"


@dataclass(frozen=True)
class GpuRates:
    """What one GPU does per second, and where each figure comes from."""

    kind: str
    """The GPU kind (`analysis.megatron.gpu.COMPUTE_CAPABILITY`'s keys: h100, a100, ...)."""
    product: str
    matrix_flops: dict[str, float]
    """Dense tensor-core FLOP/s by precision: bf16, fp16, fp32 (TF32, what Transformer Engine's
    cuBLAS calls use for fp32 inputs) and fp8 (absent where the GPU has no FP8 tensor cores)."""
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    """NVLink bytes per second one GPU sends in one direction (a tensor-parallel group within a node)."""
    host_link_bytes_per_s: float | None
    """Bytes per second between the GPU and host memory, one direction (CPU offload's copies); None
    where the datasheet names no per-GPU figure."""
    source: str
    """The datasheet, or the measured profile, each figure comes from."""
    network_bytes_per_s: float | None = None
    """Bytes per second one GPU sends over the scale-out network, one direction: the NIC each GPU
    of the vendor's reference system has (DGX datasheets); None where none is named."""
    nvlink_domain: int = 8
    """GPUs that reach each other over NVLink (an HGX / DGX board's 8, an NVL72 rack's 72); a
    collective over ranks further apart crosses the network."""
    sms: int | None = None
    """Streaming multiprocessors a GEMM's output tiles run in waves over (`gemm_seconds`); None: the
    roofline, no waves (the datasheet rates)."""
    peak_flops: dict[str, float] | None = None
    """The datasheet's dense FLOP/s by precision (what MFU divides by); None: `matrix_flops`."""
    measured_gemms: dict[tuple, float] | None = None
    """FLOP/s a profile measured for GEMMs of the run's own shapes, by (m, n, k, precision)."""
    attention_flops: dict[str, float] | None = None
    """FLOP/s of the fused attention kernel, "forward" and "backward" (16-bit): the GPU table's measured ones or
    `config.gpus.ATTENTION_SHARE` of the bf16 matmul rate; None: the 16-bit matmul rate (the roofline)."""
    nccl_sms: int = 0
    """SMs a NCCL collective over the NVLink domain holds while it runs (the GPU table's `nccl_channels`:
    one thread block per channel, NCCL src/enqueue.cc); a GEMM launched beside it runs its tiles on the
    rest (`time_ops.op_times`). 0: not known, not priced (and on the datasheet's roofline)."""
    kernel_shares: dict[str, float] | None = None
    """The share of `hbm_bytes_per_s` the multi-tensor-apply kernels reach, by `time_ops.Op.kernel` ("adam",
    "multi_tensor"): `config.gpus.MULTI_TENSOR_SHARE`, measured on our H200; None: the copy's (the roofline)."""
    nccl: NcclTable | None = None
    """nccl-tests' all-gather, reduce-scatter and all-reduce by message size over the NVLink domain (the GPU
    table's published sweep): a collective of those kinds within the domain is priced by its size
    (`collective_seconds`); None: at `link_bytes_per_s` whatever its size."""
    tile: tuple[int, int] = (128, 256)
    """cuBLAS's output tile of large GEMMs (rows x columns): 128 x 256 on Hopper and Blackwell
    (CUTLASS's default SM90 warp-specialized tile), 256 x 128 on Ampere."""
    short_k: dict[str, float] = dataclasses.field(default_factory=dict)
    """By precision: the K elements an output tile's fixed cost is worth (`config.gpus.SHORT_K_HOPPER`);
    empty: short K not priced (the datasheet's roofline, or a kind no table measures)."""
    rate_k: dict[str, float] = dataclasses.field(default_factory=dict)
    """By precision: the K of the GEMM `matrix_flops` was measured at (the MAMF best shape, or a profile's
    square matmul), where the short-K factor is 1."""

    def memory_rate(self, kernel: str | None = None) -> float:
        """Bytes per second a memory-bound kernel moves: the copy bandwidth, or a multi-tensor kernel's share of it."""
        return self.hbm_bytes_per_s * (self.kernel_shares or {}).get(kernel, 1.0)

    def peak(self, precision: str = "bf16") -> float:
        """The datasheet's dense FLOP/s of `precision` (MFU's denominator)."""
        return (self.peak_flops or self.matrix_flops).get(precision) or self.matrix_rate(precision)

    def gemm_seconds(self, flops: float, precision: str, shape: tuple[float, float, float] | None = None,
                     comm_sms: int = 0, groups: int = 1) -> float:
        """A GEMM's time at the precision's rate. With the GPU's SM count and the GEMM's (m, n, k):
        cuBLAS splits the m x n output into tiles (`TILE`: 128 x 256 on Hopper and Blackwell, 256 x 128
        on Ampere, its largest kernels' tiles: `tile`), run one per SM in waves; a partial last tile or a last
        wave that leaves SMs idle takes as long as a full one, so the GEMM runs at the rate times
        useful / launched tile work (`groups` GEMMs of the shape in one grouped GEMM, the local experts',
        share the waves). `comm_sms`: SMs a communication kernel running beside the GEMM
        holds (Transformer Engine's SM margin, `time_ops.UB_COMM_SMS`): the tiles run in waves over the
        SMs left, each SM at its share of the rate (a measured GEMM of the shape: its time scaled by
        all SMs / the SMs left). A short K costs more per FLOP where the kind prices it (`short_k_factor`).
        Without an SM count (the datasheet's roofline) nothing is taken."""
        rate = self.matrix_rate(precision)
        left = self.sms - comm_sms if self.sms else None
        if left is not None and left <= 0:
            raise ValueError(f"{comm_sms} SMs taken of {self.sms}")
        if shape is not None and self.measured_gemms and (*shape, precision) in self.measured_gemms:
            measured = flops / self.measured_gemms[(*shape, precision)]
            return measured * self.sms / left if left else measured
        if not self.sms or shape is None:
            return flops / rate * (self.sms / left if left else 1.0)
        m, n, k = shape
        tm, tn = self.tile
        tiles = groups * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / left)
        return flops / rate * (waves * self.sms * tm * tn) / (groups * m * n) * self.short_k_factor(k, precision)

    def short_k_factor(self, k: float, precision: str) -> float:
        """How much longer than at the rate's own K a GEMM of inner size `k` takes: each output tile pays
        a fixed cost worth `short_k` elements of K (filling its pipeline, writing its output), so the
        time goes as (K + k0) / K, normalised to 1 at the K the rate was measured at (`rate_k`). 1 where
        the kind prices no short K."""
        k0, measured_at = self.short_k.get(precision), self.rate_k.get(precision)
        if not k0 or not measured_at or k <= 0:
            return 1.0
        return (k + k0) / k / ((measured_at + k0) / measured_at)

    def comm_seconds(self, nbytes: float, group: int, stride: int, pattern: str,
                     collective: str | None = None) -> float:
        """Time one rank spends sending `nbytes` in a collective over `group` ranks `stride` ranks
        apart (Megatron's rank order puts tensor parallel innermost, then context, expert and data
        parallel: a group spans group x stride consecutive ranks). Within one NVLink domain: an
        all-gather, reduce-scatter or all-reduce (`collective`) on a kind with nccl-tests' table by its
        size (`collective_seconds`), anything else as bytes over NVLink. Across domains, a ring ("ring":
        all-gather, reduce-scatter, all-reduce, a context-parallel ring step) is as fast as its slowest
        hop, the network; an all-to-all ("all_to_all") sends the share addressed to peers outside the
        rank's domain over the network and the rest over NVLink at the same time. BadInput where the network would be needed and the
        GPU kind names none."""
        if nbytes <= 0:
            return 0.0
        if group * stride <= self.nvlink_domain or group <= 1:
            ring = collective and pattern == "ring" and group > 1
            measured = self.collective_seconds(nbytes, group, collective) if ring else None
            return nbytes / self.link_bytes_per_s if measured is None else measured
        if not self.network_bytes_per_s:
            raise BadInput(f"a collective over {group} ranks {stride} apart leaves {self.product}'s NVLink domain of "
                           f"{self.nvlink_domain} GPUs, and no network rate is named for it; lay the group out within "
                           "the domain or pass another --gpu")
        if pattern != "all_to_all":
            return nbytes / self.network_bytes_per_s
        local = max(1, self.nvlink_domain // stride) if stride <= self.nvlink_domain else 1
        outside = (group - min(local, group)) / (group - 1)
        return max(nbytes * (1 - outside) / self.link_bytes_per_s, nbytes * outside / self.network_bytes_per_s)

    def collective_seconds(self, nbytes: float, group: int, collective: str) -> float | None:
        """A ring `collective` (all_gather, reduce_scatter, all_reduce) over `group` ranks of the NVLink domain
        in which one rank sends `nbytes` (`time_ops.ring_bytes`: (g - 1) shards of the whole buffer / g, twice
        that for all-reduce), priced from nccl-tests' published sweep of this kind (`nccl`); None where the
        GPU table has none for it.

        nccl-tests' busbw is exactly those bytes one rank sends per second, so on the table's own rank count
        and sizes the price is the measured time. Between sizes the time is interpolated linearly in log
        size and log time, and below the smallest it stays at the smallest one's time (a small collective is
        latency-bound: its time does not go to 0); above the largest, the largest one's busbw (the plateau)
        carries on. The classic latency + size / bandwidth fit (least squares in relative error) misses the
        B200 sweep by up to 34 % (all-gather) to 49 % (reduce-scatter) around 8 MiB, where NCCL changes
        protocol, and the H100 sweep by up to 15 to 19 %; the interpolation is exact at every measured size.
        Fewer ranks than the table's (a tp 4 group on an 8-GPU board): a ring of g ranks takes g - 1 steps
        (2 (g - 1) for all-reduce) of one shard each, so its busbw is taken as the table's at the same shard
        (the table size ranks x shard), and its time as that row's time x its steps / the table's steps. NVLink SHARP all-reduce on Hopper and Blackwell is not a ring; the same rule is kept for it."""
        table = self.nccl.rows.get(collective) if self.nccl else None
        if not table or nbytes <= 0:
            return None
        reduce = 2 if collective == "all_reduce" else 1
        steps, table_steps = reduce * (group - 1), reduce * (self.nccl.ranks - 1)
        size = self.nccl.ranks * nbytes / steps  # the table's size whose shard is this collective's
        return _interpolated_seconds(table, size) * steps / table_steps

    def matrix_rate(self, precision: str) -> float:
        """FLOP/s of matrix work in `precision`; BadInput where this GPU has none (FP8 before Hopper)."""
        if precision not in self.matrix_flops:
            raise BadInput(f"{self.product} has no {precision} tensor cores (its rates: {', '.join(self.matrix_flops)}); "
                           f"pass --precision bf16 or another --gpu")
        return self.matrix_flops[precision]


def _interpolated_seconds(rows: tuple[tuple[float, float, float], ...], size: float) -> float:
    """The time (seconds) of a collective of `size` bytes from nccl-tests' rows (size, microseconds, busbw):
    linear in log size and log time between rows, the first row's time below them, the last row's busbw
    above them."""
    first, last = rows[0], rows[-1]
    if size <= first[0]:
        return first[1] * 1e-6
    if size >= last[0]:
        return last[1] * 1e-6 * size / last[0]
    hi = next(i for i, row in enumerate(rows) if row[0] >= size)
    (s0, t0, _), (s1, t1, _) = rows[hi - 1], rows[hi]
    w = math.log(size / s0) / math.log(s1 / s0)
    return math.exp((1 - w) * math.log(t0) + w * math.log(t1)) * 1e-6


def _rates(gpu: Gpu, achieved: bool) -> GpuRates:
    """The rates of one product of the GPU table: its datasheet's, or what it achieves (the MAMF of each
    precision the table has one for, the measured copy bandwidth or the datasheet's at `COPY_SHARE`, and
    its SM count for the GEMM waves); the links stay the datasheet's."""
    matrix, hbm, sms, source = dict(gpu.dense_flops), gpu.hbm_bytes_per_s, None, gpu.source
    link = gpu.link_bytes_per_s
    if achieved:
        matrix.update(gpu.mamf)
        if "bf16" in gpu.mamf and "fp32" in matrix:  # TF32 runs at the share bf16 reaches of its peak
            matrix["fp32"] *= gpu.mamf["bf16"] / gpu.dense_flops["bf16"]
        hbm = gpu.achieved_hbm_bytes_per_s or COPY_SHARE * gpu.hbm_bytes_per_s
        link = gpu.achieved_link_bytes_per_s or LINK_SHARE * gpu.link_bytes_per_s
        sms = gpu.sms
        source = (f"achieved: matmul {gpu.mamf_source or 'the datasheet'}; copy "
                  f"{gpu.hbm_source or f'{COPY_SHARE:.0%} of the datasheet (the share our H200 copy reached)'}; "
                  f"fused Adam {MULTI_TENSOR_SHARE['adam']:.0%} and the other multi-tensor kernels "
                  f"{MULTI_TENSOR_SHARE['multi_tensor']:.0%} of the copy (our H200's); "
                  f"NVLink {gpu.link_source or f'{LINK_SHARE:.0%} of the datasheet (the busbw share nccl-tests reach on A100)'}"
                  f"{f' of {gpu.nccl.source}, which prices all-gather, reduce-scatter, all-reduce by size' if gpu.nccl else ''}"
                  f"; peaks: {gpu.source}")
    return GpuRates(gpu.kind, gpu.product, matrix, hbm, link, gpu.host_link_bytes_per_s, source,
                    gpu.network_bytes_per_s, gpu.nvlink_domain, sms, dict(gpu.dense_flops),
                    attention_flops=_attention(gpu, matrix) if achieved else None,
                    nccl_sms=(gpu.nccl_channels or 0) if achieved else 0, nccl=gpu.nccl if achieved else None,
                    kernel_shares=dict(MULTI_TENSOR_SHARE) if achieved else None,
                    tile=(128, 256) if gpu.compute_capability >= 90 else (256, 128),
                    short_k=dict(gpu.short_k) if achieved else {}, rate_k=dict(gpu.mamf_k) if achieved else {})


def _attention(gpu: Gpu, matrix: dict[str, float]) -> dict[str, float] | None:
    """The flash attention rates a kind achieves: measured on it, else `ATTENTION_SHARE` of its bf16 rate."""
    if gpu.attention_flops:
        return dict(gpu.attention_flops)
    return {k: share * matrix["bf16"] for k, share in ATTENTION_SHARE.items()} if "bf16" in matrix else None


DATASHEET: dict[str, GpuRates] = {kind: _rates(gpu, False) for kind, gpu in KINDS.items() if gpu.link_bytes_per_s}
"""Each kind's datasheet rates (the roofline), for the kinds the table has rates for."""
ACHIEVED: dict[str, GpuRates] = {kind: _rates(gpu, True) for kind, gpu in KINDS.items() if gpu.link_bytes_per_s}
"""Each kind's achieved rates: what the time model prices a plan at unless a profile measured the GPU."""


def achieved_rates(kind: str) -> GpuRates:
    """The achieved rates of GPU kind `kind`; BadInput naming the kinds that have some."""
    datasheet_rates(kind)
    return ACHIEVED[kind]


def datasheet_rates(kind: str) -> GpuRates:
    """The datasheet rates of GPU kind `kind`; BadInput naming the kinds that have some."""
    if kind not in DATASHEET:
        raise BadInput(f"no datasheet rates for GPU kind {kind!r} to price time with; pass --gpu with one of "
                       f"{', '.join(DATASHEET)}, or --profile on that GPU to measure its rates")
    return DATASHEET[kind]


# ----- measured profiles ------------------------------------------------------------------------

PROFILE_FIELDS = ("bf16_flops", "fp8_flops", "hbm_bytes_per_s")
"""What `measure/rates.py` measures on one GPU (NVLink needs two GPUs: it keeps the datasheet's)."""
PROFILE_MATMUL_SIZE = 8192
"""The square matmul (M = N = K) `measure/rates.py` times for a profile's bf16 and FP8 rates."""


def rates_cache_path(device_name: str, folder: Path = Path("results/profiles"), shapes: list | tuple = ()) -> Path:
    """results/profiles/rates-<device>-<hash of the name and the GEMM shapes measured>.json."""
    return cache_file(folder, device_name, device_name + (repr(sorted(shapes)) if shapes else ""), 8, prefix="rates-")


def read_rates_profile(path: Path) -> dict[str, Any] | None:
    """The rates profile at `path`, or None when there is none; BadInput when it is not one."""
    data = read_json(path, "rates profile")
    if data is None:
        return None
    if data.get("schema") != RATES_SCHEMA or not isinstance(data.get("measured"), dict):
        raise BadInput(f"{path} is not a rates profile ({RATES_SCHEMA}); delete it to measure again")
    return data


def with_profile(rates: GpuRates, profile: dict[str, Any]) -> GpuRates:
    """`rates` with each figure the profile measured in its place (bf16 also prices fp16; the
    datasheet keeps what the profile did not measure: TF32, NVLink, FP8 where it could not run)."""
    measured = profile["measured"]
    matrix, rate_k = dict(rates.matrix_flops), dict(rates.rate_k)
    if measured.get("bf16_flops"):
        matrix["bf16"] = matrix["fp16"] = float(measured["bf16_flops"])
        rate_k["bf16"] = rate_k["fp16"] = PROFILE_MATMUL_SIZE
    if measured.get("fp8_flops"):
        matrix["fp8"] = float(measured["fp8_flops"])
        rate_k["fp8"] = PROFILE_MATMUL_SIZE
    hbm = float(measured.get("hbm_bytes_per_s") or rates.hbm_bytes_per_s)
    gemms = {(g["m"], g["n"], g["k"], g["precision"]): float(g["flops_per_s"]) for g in profile.get("gemms") or ()}
    taken = ", ".join([k for k in PROFILE_FIELDS if measured.get(k)] + ([f"{len(gemms)} GEMM shapes"] if gemms else []))
    return dataclasses.replace(rates, matrix_flops=matrix, rate_k=rate_k, hbm_bytes_per_s=hbm, measured_gemms=gemms or None,
                               source=f"measured on {profile['device_name']} ({taken}); the rest: {rates.source}")


SHIPPED = Path(__file__).parent / "profiles"
"""The profiles we measured ourselves, shipped with the package (one JSON per GPU we ran on)."""


def find_profile(kind: str, folders: tuple[Path, ...] = (Path("results/profiles"), SHIPPED)) -> tuple[dict[str, Any], Path] | None:
    """Without a GPU here: a rates profile of GPU kind `kind`, the first found, cached ones (measured
    here before, or copied from the machine that has the GPU) before the shipped ones; None when none."""
    from recompute_bench.config.presets import gpu_type

    for folder in folders:
        for path in sorted(Path(folder).glob("rates-*.json")):
            profile = read_rates_profile(path)
            if profile is not None and gpu_type(profile["device_name"]) == kind:
                return profile, path
    return None


def rates_row(rates: GpuRates) -> dict[str, Any]:
    """The rates as `plan --json` carries them."""
    return {"gpu": rates.kind, "product": rates.product, "source": rates.source,
            "matrix_flops": dict(rates.matrix_flops), "hbm_bytes_per_s": rates.hbm_bytes_per_s,
            "link_bytes_per_s": rates.link_bytes_per_s, "host_link_bytes_per_s": rates.host_link_bytes_per_s,
            "network_bytes_per_s": rates.network_bytes_per_s, "nvlink_domain": rates.nvlink_domain}
