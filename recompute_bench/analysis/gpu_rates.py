"""The rates the time model prices work at, per GPU kind: matrix FLOP/s per precision, HBM bytes/s,
the NVLink bytes/s one GPU sends (one direction), the host link (CPU offload) and the network past
the NVLink domain, each from a named datasheet, or from a profile measured on the GPU itself (`measure/rates.py`, cached under results/profiles/), which overrides the
datasheet figure it measured. Pure Python.

Datasheets print tensor-core rates with 2:4 sparsity; the figures below are the dense ones (half).
NVLink is printed as the total of both directions; a ring collective sends in one direction at a
time, so the link rate is half the printed figure. No rate is scaled by an efficiency: the model is
a roofline, and where a kernel runs below it the docs say which (docs/plan-megatron.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recompute_bench.analysis.cache import cache_file, read_json
from recompute_bench.config.schema import BadInput

RATES_SCHEMA = "recompute-bench/gpu-rates/v1"
TERA = 1e12


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

    def comm_seconds(self, nbytes: float, group: int, stride: int, pattern: str) -> float:
        """Time one rank spends sending `nbytes` in a collective over `group` ranks `stride` ranks
        apart (Megatron's rank order puts tensor parallel innermost, then context, expert and data
        parallel: a group spans group x stride consecutive ranks). Within one NVLink domain: bytes
        over NVLink. Across domains, a ring ("ring": all-gather, reduce-scatter, all-reduce, a
        context-parallel ring step) is as fast as its slowest hop, the network; an all-to-all
        ("all_to_all") sends the share addressed to peers outside the rank's domain over the network
        and the rest over NVLink at the same time. BadInput where the network would be needed and the
        GPU kind names none."""
        if nbytes <= 0:
            return 0.0
        if group * stride <= self.nvlink_domain or group <= 1:
            return nbytes / self.link_bytes_per_s
        if not self.network_bytes_per_s:
            raise BadInput(f"a collective over {group} ranks {stride} apart leaves {self.product}'s NVLink domain of "
                           f"{self.nvlink_domain} GPUs, and no network rate is named for it; lay the group out within "
                           "the domain or pass another --gpu")
        if pattern != "all_to_all":
            return nbytes / self.network_bytes_per_s
        local = max(1, self.nvlink_domain // stride) if stride <= self.nvlink_domain else 1
        outside = (group - min(local, group)) / (group - 1)
        return max(nbytes * (1 - outside) / self.link_bytes_per_s, nbytes * outside / self.network_bytes_per_s)

    def matrix_rate(self, precision: str) -> float:
        """FLOP/s of matrix work in `precision`; BadInput where this GPU has none (FP8 before Hopper)."""
        if precision not in self.matrix_flops:
            raise BadInput(f"{self.product} has no {precision} tensor cores (its rates: {', '.join(self.matrix_flops)}); "
                           f"pass --precision bf16 or another --gpu")
        return self.matrix_flops[precision]


def _dense(bf16_sparse_tflops: float, tf32_sparse_tflops: float, fp8_sparse_tflops: float | None,
           fp64_tflops: float) -> dict[str, float]:
    """Dense rates from the datasheet's sparse tensor-core figures; FP64 (tensor core, no sparsity:
    what an fp64 router's torch.mm runs at) as printed."""
    out = {"bf16": bf16_sparse_tflops / 2 * TERA, "fp16": bf16_sparse_tflops / 2 * TERA,
           "fp32": tf32_sparse_tflops / 2 * TERA, "fp64": fp64_tflops * TERA}
    if fp8_sparse_tflops:
        out["fp8"] = fp8_sparse_tflops / 2 * TERA
    return out


GBIT = 1e9 / 8
"""Bytes per second of one Gb/s (network ports are rated in bits)."""

DATASHEET: dict[str, GpuRates] = {
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16/FP16 624 TFLOPS*, TF32 312*
    # (* with sparsity), no FP8, FP64 Tensor Core 19.5; GPU memory bandwidth 2,039 GB/s; NVLink 600 GB/s;
    # PCIe Gen4 64 GB/s.
    # NVIDIA DGX A100 datasheet: 8 GPUs on NVSwitch; 8 single-port ConnectX-6 VPI, 200 Gb/s HDR InfiniBand.
    "a100": GpuRates("a100", "A100 SXM4 80GB", _dense(624, 312, None, 19.5), 2039e9, 600e9 / 2, 64e9 / 2,
                     "NVIDIA A100 datasheet (SXM4 80GB); network: DGX A100 datasheet", 200 * GBIT, 8),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP8 3,958 TFLOPS*, BF16/FP16 1,979*, TF32 989*,
    # FP64 Tensor Core 67; GPU memory bandwidth 3.35 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s.
    # NVIDIA DGX H100 datasheet: 8 GPUs on NVSwitch; 8 single-port ConnectX-7 VPI, 400 Gb/s InfiniBand.
    "h100": GpuRates("h100", "H100 SXM5 80GB", _dense(1979, 989, 3958, 67), 3.35e12, 900e9 / 2, 128e9 / 2,
                     "NVIDIA H100 datasheet (SXM5); network: DGX H100 datasheet", 400 * GBIT, 8),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: tensor cores as H100 SXM; 4.8 TB/s; NVLink 900 GB/s;
    # PCIe Gen5 128 GB/s. NVIDIA DGX H200 datasheet: 8 GPUs; 8 single-port ConnectX-7 VPI, 400 Gb/s.
    "h200": GpuRates("h200", "H200 SXM 141GB", _dense(1979, 989, 3958, 67), 4.8e12, 900e9 / 2, 128e9 / 2,
                     "NVIDIA H200 datasheet (SXM); network: DGX H200 datasheet", 400 * GBIT, 8),
    # NVIDIA HGX B200 datasheet, per GPU (the 8-GPU board's figures / 8): FP8 9 PFLOPS*, BF16/FP16
    # 4.5*, TF32 2.25*, FP64 Tensor Core 296 TFLOPS for the 8; HBM3e 8 TB/s; NVLink 1.8 TB/s (no
    # per-GPU host link figure).
    # NVIDIA DGX B200 datasheet: 8 GPUs; 8 single-port ConnectX-7 VPI, 400 Gb/s InfiniBand.
    "b200": GpuRates("b200", "B200 (HGX)", _dense(4500, 2250, 9000, 296 / 8), 8e12, 1.8e12 / 2, None,
                     "NVIDIA HGX B200 datasheet, per GPU; network: DGX B200 datasheet", 400 * GBIT, 8),
    # NVIDIA GB200 NVL72 datasheet, per GPU (the rack's figures / 72): FP8 10 PFLOPS*, BF16/FP16 5*,
    # TF32 2.5*, FP64 Tensor Core 3,240 TFLOPS for the 72; HBM3e 8 TB/s; NVLink 1.8 TB/s in one 72-GPU
    # NVLink domain; NVLink-C2C to the Grace CPU 900 GB/s. NVIDIA DGX GB200 datasheet: 72 single-port ConnectX-7 VPI, 400 Gb/s InfiniBand.
    "gb200": GpuRates("gb200", "GB200 (NVL72)", _dense(5000, 2500, 10000, 3240 / 72), 8e12, 1.8e12 / 2, 900e9 / 2,
                      "NVIDIA GB200 NVL72 datasheet, per GPU; network: DGX GB200 datasheet", 400 * GBIT, 72),
}


def datasheet_rates(kind: str) -> GpuRates:
    """The datasheet rates of GPU kind `kind`; BadInput naming the kinds that have some."""
    if kind not in DATASHEET:
        raise BadInput(f"no datasheet rates for GPU kind {kind!r} to price time with; pass --gpu with one of "
                       f"{', '.join(DATASHEET)}, or --profile on that GPU to measure its rates")
    return DATASHEET[kind]


# ----- measured profiles ------------------------------------------------------------------------

PROFILE_FIELDS = ("bf16_flops", "fp8_flops", "hbm_bytes_per_s")
"""What `measure/rates.py` measures on one GPU (NVLink needs two GPUs: it keeps the datasheet's)."""


def rates_cache_path(device_name: str, folder: Path = Path("results/profiles")) -> Path:
    """results/profiles/rates-<device>-<hash of the name>.json."""
    return cache_file(folder, device_name, device_name, 8, prefix="rates-")


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
    matrix = dict(rates.matrix_flops)
    if measured.get("bf16_flops"):
        matrix["bf16"] = matrix["fp16"] = float(measured["bf16_flops"])
    if measured.get("fp8_flops"):
        matrix["fp8"] = float(measured["fp8_flops"])
    hbm = float(measured.get("hbm_bytes_per_s") or rates.hbm_bytes_per_s)
    taken = ", ".join(k for k in PROFILE_FIELDS if measured.get(k))
    return dataclasses.replace(rates, matrix_flops=matrix, hbm_bytes_per_s=hbm,
                               source=f"measured on {profile['device_name']} ({taken}); the rest: {rates.source}")


def rates_row(rates: GpuRates) -> dict[str, Any]:
    """The rates as `plan --json` carries them."""
    return {"gpu": rates.kind, "product": rates.product, "source": rates.source,
            "matrix_flops": dict(rates.matrix_flops), "hbm_bytes_per_s": rates.hbm_bytes_per_s,
            "link_bytes_per_s": rates.link_bytes_per_s, "host_link_bytes_per_s": rates.host_link_bytes_per_s,
            "network_bytes_per_s": rates.network_bytes_per_s, "nvlink_domain": rates.nvlink_domain}
