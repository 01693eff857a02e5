"""The one GPU table: each GPU kind's facts, stated once with their sources. Everything else reads
them from here: the datasheet and achieved rates the time model prices work at
(`analysis.gpu_rates`), the dense peaks MFU divides by by the name CUDA reports (`analysis.flops`),
the compute capability that picks Megatron's kernels (`analysis.megatron.gpu`) and the short kind a
device name maps to (`config.presets.gpu_type`). Pure data, no imports from the rest of the package.

Datasheets print tensor-core rates with 2:4 sparsity; the figures here are the dense ones (half).
NVLink is printed as the total of both directions; a ring collective sends one way at a time, so the
link figure is half the printed one. Achieved rates ("mamf": the maximum achievable matmul FLOP/s, the
best shape a brute-force search found) come from published microbenchmarks or our own measurement,
each named beside its figure; none is set from an end-to-end training throughput. What one kind
measured and the others lack is carried over as a share of a rate every kind has: the copy as a share
of the datasheet bandwidth (`COPY_SHARE`), flash attention as a share of the matmul rate
(`ATTENTION_SHARE`), fused Adam and the other multi-tensor-apply kernels as shares of the copy
(`MULTI_TENSOR_SHARE`), each measured on our H200. Collectives by message
size come from nccl-tests' own published output (`NcclTable`): measured for H100 and B200 (H200 and
GB200 take their NVLink generation's), A100's all-reduce; A100's other collectives take nccl-tests'
plateau, and the other kinds assume `LINK_SHARE` of their link at every size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TERA = 1e12
GBIT = 1e9 / 8
"""Bytes per second of one Gb/s (network ports are rated in bits)."""

MAMF_SOURCE = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
               "table' (mamf-finder.py, torch matmul, mean of 100 runs)")
OURS_H200 = "our H200 run 2026-11-28 (shared/gpu-runs/2026-11-28-h200: bf16 8192^3 matmul 771 TFLOP/s, copy 4.23 TB/s)"


@dataclass(frozen=True)
class Gpu:
    """One GPU product: its kind, what CUDA calls it, its datasheet and what it achieves."""

    kind: str
    """The short kind (h100, a100, ...): `--gpu`'s words, golden file names."""
    product: str
    compute_capability: int
    """Major x 10 + minor; it picks Transformer Engine's attention kernel and workspace and torch's cuBLAS workspace."""
    device_names: tuple[str, ...] = ()
    """The exact names CUDA and NVML report for this product."""
    short: str = ""
    """The product as MFU's peak names it ("H100 SXM")."""
    dense_flops: dict[str, float] = field(default_factory=dict)
    """Datasheet dense tensor-core FLOP/s: bf16, fp16, fp32 (TF32), fp8, fp64 (tensor core, as printed)."""
    hbm_bytes_per_s: float = 0.0
    link_bytes_per_s: float = 0.0
    """NVLink bytes per second one GPU sends one way."""
    host_link_bytes_per_s: float | None = None
    network_bytes_per_s: float | None = None
    """The scale-out NIC per GPU of the vendor's reference system (DGX datasheets), one way."""
    nvlink_domain: int = 8
    sms: int | None = None
    """Streaming multiprocessors (the whitepaper's count): a GEMM's tiles run in waves over them."""
    source: str = ""
    """The datasheets of the figures above."""
    mamf: dict[str, float] = field(default_factory=dict)
    """Achieved matrix FLOP/s by precision, the best shape of a published microbenchmark or ours."""
    mamf_source: str = ""
    achieved_hbm_bytes_per_s: float | None = None
    """A device-to-device copy's bytes read + written per second, measured."""
    hbm_source: str = ""
    achieved_link_bytes_per_s: float | None = None
    """Bus bandwidth of a ring collective over the NVLink domain, measured (nccl-tests' busbw)."""
    link_source: str = ""
    nccl_channels: int | None = None
    """Channels NCCL runs a large collective over the NVLink domain with, as its own log prints them: NCCL
    launches one thread block per channel, each holding an SM while it runs (`time_ops.Op.nccl`); None: not
    known, and a GEMM beside NCCL keeps every SM."""
    nccl_source: str = ""
    attention_flops: dict[str, float] = field(default_factory=dict)
    """FP/s a fused (flash) attention kernel reached forward and backward, 16-bit, measured on this kind;
    empty: the kinds take `ATTENTION_SHARE` of their bf16 matmul rate."""
    mamf_k: dict[str, int] = field(default_factory=dict)
    """The K of the shape each `mamf` rate was measured at (the MAMF table's best shape, or ours): where a
    kind prices short K (`short_k`), a GEMM of that K runs at the table's rate."""
    short_k: dict[str, float] = field(default_factory=dict)
    """By precision: the K elements a GEMM output tile's fixed cost (filling its pipeline, writing its
    output, taking the next tile) is worth in main-loop time, so a GEMM runs at its rate times
    K / (K + short_k) (`SHORT_K_HOPPER`); empty: short K not priced on this kind."""
    nccl: NcclTable | None = None
    """nccl-tests' all-gather, reduce-scatter and all-reduce by message size over the NVLink domain, published for
    this kind; None: no table found, and every collective runs at `achieved_link_bytes_per_s` (or `LINK_SHARE` of
    the link) whatever its size."""


def _dense(bf16_sparse: float, tf32_sparse: float, fp8_sparse: float | None, fp64: float) -> dict[str, float]:
    """Dense rates (TFLOPS) from the datasheet's sparse tensor-core figures; FP64 tensor core as printed."""
    out = {"bf16": bf16_sparse / 2 * TERA, "fp16": bf16_sparse / 2 * TERA, "fp32": tf32_sparse / 2 * TERA,
           "fp64": fp64 * TERA}
    if fp8_sparse:
        out["fp8"] = fp8_sparse / 2 * TERA
    return out


NCCL_CHANNELS_A100 = ("NVIDIA/nccl-tests issue #100: NCCL_DEBUG=INFO log of 8 A100 on HGX A100's NVSwitch, "
                      "'Channel 00/24' ... 'Channel 23/24' (24 ring channels); NCCL launches one block per channel")
NCCL_A100_PLATEAU = ("NVIDIA/nccl-tests issue #149: all_reduce_perf on 8 A100 SXM4 80GB over NVSwitch, busbw ~200 GB/s "
                     "up to 1 GiB (issue #178: 208 GB/s); all-gather and reduce-scatter at that rate, all-reduce by size")
# The ring bus bandwidth nccl-tests reached on A100's NVLink, as a share of the one-way link; kinds with no
# nccl-tests figure of their own take the same share.
LINK_SHARE = 200e9 / 300e9


@dataclass(frozen=True)
class NcclTable:
    """nccl-tests' own output over one NVLink domain: for each collective, its rows as printed (size in bytes,
    the out-of-place time in microseconds, the busbw in GB/s), measured on `ranks` GPUs. nccl-tests prints the
    size of the whole buffer S (the all-gather's output, the reduce-scatter's input, the all-reduce's buffer) and
    busbw = S / time x 2 (n - 1) / n for all-reduce, x (n - 1) / n for all-gather and reduce-scatter (its
    doc/PERFORMANCE.md): the bytes one rank sends per second, the figure `GpuRates.comm_seconds` prices with."""

    ranks: int
    rows: dict[str, tuple[tuple[float, float, float], ...]]
    source: str


# A public script's nccl-tests output on 8 H100 SXM of one board (bf16, 1 MiB to 8 GiB doubling, out-of-place;
# its all_reduce runs NVLink SHARP). Its plateaus are the ones NVIDIA gives in NVIDIA/nccl-tests issue #212
# (sjeaugey: ~370 GB/s busbw for collectives other than all-reduce, ~480 GB/s for all-reduce on 8 H100).
NCCL_H100 = NcclTable(8, {
    "all_reduce": (
        (1048576, 46.24, 39.69), (2097152, 45.71, 80.29), (4194304, 57.93, 126.71), (8388608, 86.55, 169.61),
        (16777216, 125.9, 233.17), (33554432, 203.3, 288.90), (67108864, 328.4, 357.65), (134217728, 579.2, 405.51),
        (268435456, 1090.5, 430.79), (536870912, 2106.2, 446.07), (1073741824, 4022.4, 467.15),
        (2147483648, 7924.8, 474.22), (4294967296, 15736, 477.66), (8589934592, 31450, 477.98)),
    "all_gather": (
        (1048576, 47.14, 19.46), (2097152, 45.69, 40.16), (4194304, 47.23, 77.70), (8388608, 48.87, 150.21),
        (16777216, 73.03, 201.02), (33554432, 128.2, 228.99), (67108864, 211.3, 277.88), (134217728, 386.4, 303.92),
        (268435456, 730.2, 321.68), (536870912, 1394.3, 336.91), (1073741824, 2734.1, 343.63),
        (2147483648, 5379.0, 349.33), (4294967296, 10615, 354.05), (8589934592, 21025, 357.49)),
    "reduce_scatter": (
        (1048576, 43.62, 21.03), (2097152, 44.87, 40.90), (4194304, 59.15, 62.05), (8388608, 54.41, 134.90),
        (16777216, 75.44, 194.60), (33554432, 117.8, 249.25), (67108864, 205.3, 286.09), (134217728, 385.5, 304.68),
        (268435456, 726.0, 323.52), (536870912, 1410.0, 333.16), (1073741824, 2758.3, 340.61),
        (2147483648, 5419.6, 346.72), (4294967296, 10584, 355.09), (8589934592, 20940, 358.94)),
}, "nccl-tests on 8 H100 SXM (a public script's all_reduce_nccl_test, all_gather_nccl_test, reduce_scatter_nccl_test "
   "data, bf16, out-of-place, 1 MiB to 8 GiB; plateaus as NVIDIA/nccl-tests issue #212 gives them)")


# Rows of 128 B and up of a public HGX B200 acceptance report ("B200 / Vultr POC - cluster test summary", section 10
# "NCCL raw sweep", its nccl_tests_dgxc.log): all_reduce_perf, all_gather_perf and reduce_scatter_perf, float, 8
# ranks on one HGX B200 board's NVSwitch, 8 B to 16 GiB doubling; the out-of-place columns.
NCCL_B200 = NcclTable(8, {
    "all_reduce": (
        (128, 24.64, 0.01), (256, 24.73, 0.02), (512, 25.22, 0.04), (1024, 25.47, 0.07), (2048, 25.98, 0.14),
        (4096, 26.37, 0.27), (8192, 26.44, 0.54), (16384, 26.69, 1.07), (32768, 27.41, 2.09), (65536, 28.39, 4.04),
        (131072, 28.90, 7.94), (262144, 29.22, 15.70), (524288, 29.63, 30.96), (1048576, 30.10, 60.97),
        (2097152, 34.29, 107.03), (4194304, 56.17, 130.67), (8388608, 76.96, 190.75), (16777216, 106.99, 274.42),
        (33554432, 169.72, 345.98), (67108864, 277.18, 423.70), (134217728, 394.59, 595.26),
        (268435456, 712.60, 659.23), (536870912, 1334.60, 703.98), (1073741824, 2601.84, 722.20),
        (2147483648, 4605.28, 816.04), (4294967296, 9026.71, 832.66), (8589934592, 17919.9, 838.86),
        (17179869184, 35667.8, 842.91)),
    "all_gather": (
        (128, 16.12, 0.01), (256, 16.05, 0.01), (512, 16.21, 0.03), (1024, 16.42, 0.05), (2048, 16.74, 0.11),
        (4096, 16.88, 0.21), (8192, 17.13, 0.42), (16384, 17.10, 0.84), (32768, 17.93, 1.60), (65536, 18.70, 3.07),
        (131072, 18.87, 6.08), (262144, 19.21, 11.94), (524288, 19.89, 23.06), (1048576, 19.69, 46.59),
        (2097152, 22.35, 82.09), (4194304, 29.96, 122.48), (8388608, 44.92, 163.40), (16777216, 49.04, 299.38),
        (33554432, 76.98, 381.39), (67108864, 139.13, 422.06), (134217728, 207.50, 565.98),
        (268435456, 393.96, 596.21), (536870912, 762.42, 616.14), (1073741824, 1486.06, 632.22),
        (2147483648, 2911.01, 645.50), (4294967296, 5723.35, 656.62), (8589934592, 11322.8, 663.81),
        (17179869184, 22357.0, 672.38)),
    "reduce_scatter": (
        (128, 16.06, 0.01), (256, 16.01, 0.01), (512, 16.17, 0.03), (1024, 16.40, 0.05), (2048, 16.66, 0.11),
        (4096, 17.00, 0.21), (8192, 16.82, 0.43), (16384, 17.42, 0.82), (32768, 17.67, 1.62), (65536, 18.52, 3.10),
        (131072, 18.50, 6.20), (262144, 19.31, 11.88), (524288, 20.06, 22.87), (1048576, 19.70, 46.57),
        (2097152, 23.90, 76.79), (4194304, 34.26, 107.13), (8388608, 58.36, 125.78), (16777216, 52.30, 280.68),
        (33554432, 80.28, 365.71), (67108864, 138.64, 423.55), (134217728, 206.09, 569.85),
        (268435456, 388.79, 604.14), (536870912, 753.29, 623.61), (1073741824, 1451.69, 647.19),
        (2147483648, 2808.62, 669.03), (4294967296, 5552.57, 676.82), (8589934592, 10912.1, 688.79),
        (17179869184, 21629.9, 694.98)),
}, "nccl-tests on 8 B200 of one HGX B200 board (public acceptance report 'B200 / Vultr POC - cluster test summary', "
   "section 10 'NCCL raw sweep': all_reduce_perf, all_gather_perf, reduce_scatter_perf, out-of-place, 128 B to 16 GiB)")

# An all_reduce_perf sweep on one 8-GPU A100 board (OCI BM.GPU4.8: 8 A100-SXM4-40GB on HGX A100's NVSwitch), in
# oracle-japan/ocitutorials' GPU-cluster tutorial (spinup-gpu-cluster, section 4-2, `all_reduce_perf -b 64 -e 10G
# -f 2 -t 1 -g 8`, float, nccl-tests built on CUDA 11.3): its out-of-place rows from 64 KiB. A DGX A100's sweep
# (AFDWang/Hetu-Galvatron tests/profiler/test_hardware_profile.py, 1 MiB to 1 GiB) runs within 17% of it at every
# size; its plateau (235 GB/s at 8 GiB) is the ~230 GB/s NVIDIA gives for A100 (sjeaugey, NVIDIA/nccl-tests
# issue #149). No A100 all-gather or reduce-scatter sweep was found: those keep the flat rate.
NCCL_A100 = NcclTable(8, {
    "all_reduce": (
        (65536, 35.40, 3.24), (262144, 45.21, 10.15), (524288, 58.96, 15.56), (1048576, 76.71, 23.92),
        (2097152, 112.4, 32.66), (4194304, 134.5, 54.57), (8388608, 185.8, 79.02), (16777216, 245.1, 119.81),
        (33554432, 398.2, 147.46), (67108864, 589.5, 199.23), (134217728, 1191.2, 197.17),
        (268435456, 2121.9, 221.38), (536870912, 4208.2, 223.26), (1073741824, 8166.8, 230.08),
        (2147483648, 16232, 231.52), (4294967296, 32097, 234.17), (8589934592, 63929, 235.14)),
}, "nccl-tests all_reduce_perf on 8 A100-SXM4-40GB of one HGX board (oracle-japan/ocitutorials, GPU-cluster tutorial, "
   "section 4-2: float, out-of-place, 64 KiB to 8 GiB)")


def _causal_attention_flops(seq: int, heads: int, head_dim: int) -> float:
    """A causal attention forward's matrix FLOPs as the time model counts them (QK^T and x V over the
    s (s + 1) / 2 query-key pairs the flash kernels compute; `time_attention._fused`)."""
    return heads * seq * (seq + 1) / 2 * 2 * (2 * head_dim)


# Our H200 run (shared/gpu-runs/2026-11-28-h200/profiles/prof-plain.txt, torch.profiler over 13 steps of the
# llama3-8b slice: 4 layers, micro-batch 1, seq 8192, 32 heads of 128, causal, bf16, torch's cuDNN attention):
# aten::_cudnn_attention_forward 52.802 ms and aten::_cudnn_attention_backward 169.173 ms of self CUDA time over
# 52 calls each; backward computes 2.5x the forward's FLOPs.
ATTENTION_H200 = {"forward": _causal_attention_flops(8192, 32, 128) / (52.802e-3 / 52),
                  "backward": 2.5 * _causal_attention_flops(8192, 32, 128) / (169.173e-3 / 52)}
ATTENTION_SOURCE = ("our H200 run 2026-11-28 (profiles/prof-plain.txt: cuDNN flash attention, bf16, seq 8192, 32 heads "
                    "of 128, causal, 52 calls: forward 52.802 ms, backward 169.173 ms)")
ATTENTION_SHARE = {k: v / 771e12 for k, v in ATTENTION_H200.items()}
"""The flash attention rates our H200 reached, as shares of the bf16 matmul rate it reached in the same run
(forward 0.70, backward 0.55): the kinds with no attention measurement of their own take the same shares."""

# The copy our H200 run measured, as a share of its datasheet bandwidth (4.23 / 4.8); the kinds with no
# copy of their own measured take the same share (HBM controllers of one generation reach alike).
COPY_SHARE = 4.23e12 / 4.8e12

# DeepGEMM's published FP8 GEMM table on H800 SXM5 (deepseek-ai/DeepGEMM README at its first release,
# "Normal GEMMs for dense models", NVCC 12.8; H800 has H100 SXM5's 132 SMs and tensor cores): at M 4096,
# (N, K) -> TFLOP/s: (24576, 1536) 990, (32768, 512) 590, (7168, 16384) 1358, (4096, 7168) 1304,
# (7168, 2048) 1025. One GEMM's time as 2 M N (K + k0) / R, a fixed cost per output tile worth k0 elements
# of K, fits these five rows within 2.7% at k0 = 774 (R = 1,450 TFLOP/s; the (2112, 7168) row, 1058, is
# N's tiles over the SMs: `GpuRates.gemm_seconds`' waves).
# The 16-bit GEMMs of Hopper, measured on their own: TileLang's FP16 matmul benchmark on H800 SXM
# (xwhzz/tilelang benchmark/matmul/README.md, TileLang 17bd0a6, driver 560.35.05, autotuned), M = N = 8192,
# K -> TFLOP/s: 256 386, 512 520, 1024 628, 2048 705, 4096 736, 8192 758, 16384 766. The same form fits all
# seven rows within 1.2% at k0 = 264 (R = 786 TFLOP/s, MAMF's 794.5 within 1%).
# Blackwell's MAMF best shapes have K 1024 to 3072 and A100's 5120: no table measures their short K, so it
# is not priced there.
SHORT_K_SOURCE = ("FP8: deepseek-ai/DeepGEMM README (first release), 'Normal GEMMs for dense models' on H800, M 4096: "
                  "k0 = 774 fits 5 rows within 2.7%; 16-bit: xwhzz/tilelang benchmark/matmul/README.md, FP16 on "
                  "H800, M = N = 8192, K 256 to 16384: k0 = 264 fits 7 rows within 1.2%")
SHORT_K_HOPPER = {"fp8": 774.0, "bf16": 264.0, "fp16": 264.0}

# Our H200 run (shared/gpu-runs/2026-11-28-h200/profiles/prof-harness.txt, torch.profiler over the llama3-8b
# slice's steps, 1,923,125,248 parameters (peers.json `params`) in one flat fp32 master buffer):
# - aten::_fused_adam_ (fp32 params, grads and both moments: reads 16 B, writes 12 B per parameter), 223.266 ms of
#   self CUDA time in 1196 multi_tensor_apply launches: 13 steps of 92 (ceil(ceil(n / 65536 elements a chunk) /
#   320 chunks a launch) = 92). The table counts 14 calls: the profile holds 14 steps' CPU ops but 13 steps'
#   kernels (aten::mm 714 calls = 14 x 51, its nvjet kernels 663 = 13 x 51), so the 14th launched nothing in
#   the window and is not a step: 28 B x n x 13 / 223.266 ms = 3.14 TB/s, 0.74 of the 4.23 TB/s copy;
# - aten::_foreach_copy_ (the fp32 master into the bf16 weights, 6 B per parameter), 41.310 ms in the same 1196
#   launches: 3.63 TB/s, 0.86 of the copy.
# prof-plain.txt: aten::_fused_adamw_ on bf16 weights, grads and moments (14 B per parameter, in ~39 tensors),
# 165.038 ms over 13 calls: 2.12 TB/s, 0.50 of the copy; Megatron's Adam runs on fp32 state, so the fp32 kernel
# is the one the model prices at.
ADAM_H200_BYTES_PER_S = 28 * 1_923_125_248 * 13 / 223.266e-3
MULTI_TENSOR_COPY_H200_BYTES_PER_S = 6 * 1_923_125_248 * 13 / 41.310e-3
MULTI_TENSOR_SHARE = {"adam": ADAM_H200_BYTES_PER_S / 4.23e12, "multi_tensor": MULTI_TENSOR_COPY_H200_BYTES_PER_S / 4.23e12}
"""The share of the measured copy bandwidth the multi-tensor-apply kernels reached on our H200: fused Adam over
fp32 state (0.74) and a multi-tensor copy (0.86, the rate of Megatron's multi-tensor L2 norm, scale and unscale
passes); the kinds take the same shares of their copy rate (`analysis.gpu_rates.GpuRates.memory_rate`)."""
MULTI_TENSOR_SOURCE = ("our H200 run 2026-11-28 (profiles/prof-harness.txt: aten::_fused_adam_ fp32, 28 B/param x "
                       "1,923,125,248 params x 13 steps in 223.266 ms; aten::_foreach_copy_ fp32 -> bf16, 6 B/param, 41.310 ms)")

_A100 = _dense(624, 312, None, 19.5)
_H100 = _dense(1979, 989, 3958, 67)
_B200 = _dense(4500, 2250, 9000, 296 / 8)
_GB200 = _dense(5000, 2500, 10000, 3240 / 72)

GPUS: tuple[Gpu, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16/FP16 624 TFLOPS*, TF32 312* (* sparsity), no
    # FP8, FP64 Tensor Core 19.5; 2,039 GB/s; NVLink 600 GB/s; PCIe Gen4 64 GB/s. DGX A100 datasheet: 8 GPUs
    # on NVSwitch, a 200 Gb/s HDR InfiniBand port per GPU. 108 SMs (NVIDIA A100 whitepaper).
    # MAMF: A100 SXM bf16 271.2 TFLOPS (best shape 1024x10240x5120).
    Gpu("a100", "A100 SXM4 80GB", 80, ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"), "A100 SXM", _A100,
        2039e9, 600e9 / 2, 64e9 / 2, 200 * GBIT, 8, 108, "NVIDIA A100 datasheet (SXM4 80GB); network: DGX A100 datasheet",
        {"bf16": 271.2e12, "fp16": 271.2e12}, MAMF_SOURCE, None, "", 200e9, NCCL_A100_PLATEAU, 24, NCCL_CHANNELS_A100,
        nccl=NCCL_A100, mamf_k={"bf16": 5120, "fp16": 5120}),
    Gpu("a100", "A100 PCIe", 80, ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"), "A100 PCIe", _A100,
        source="NVIDIA A100 datasheet (PCIe)"),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP8 3,958 TFLOPS*, BF16 1,979*, TF32 989*, FP64 TC 67;
    # 3.35 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s. DGX H100 datasheet: a 400 Gb/s ConnectX-7 port per GPU.
    # 132 SMs (NVIDIA H100 whitepaper, SXM5). MAMF: H100 SXM bf16 794.5 (2048x2048x13312), fp8 1,402.6
    # (1024x9216x14336) TFLOPS. Collectives by size: the published 8-H100 nccl-tests sweep (`NCCL_H100`); its
    # all_gather plateau prices what has no table.
    Gpu("h100", "H100 SXM5 80GB", 90, ("NVIDIA H100 80GB HBM3",), "H100 SXM", _H100, 3.35e12, 900e9 / 2, 128e9 / 2,
        400 * GBIT, 8, 132, "NVIDIA H100 datasheet (SXM5); network: DGX H100 datasheet",
        {"bf16": 794.5e12, "fp16": 794.5e12, "fp8": 1402.6e12}, MAMF_SOURCE,
        achieved_link_bytes_per_s=357.49e9, link_source="the all_gather busbw at 8 GiB", nccl=NCCL_H100,
        mamf_k={"bf16": 13312, "fp16": 13312, "fp8": 14336}, short_k=SHORT_K_HOPPER),
    Gpu("h100", "H100 PCIe", 90, ("NVIDIA H100 PCIe",), "H100 PCIe", _dense(1513, 756, 3026, 51), 2.0e12,
        source="NVIDIA H100 datasheet (PCIe)"),
    Gpu("h100", "H100 NVL", 90, ("NVIDIA H100 NVL",), "H100 NVL", _dense(1671, 835, 3341, 60), 3.9e12,
        source="NVIDIA H100 datasheet (NVL)"),
    # NVIDIA H200 datasheet, H200 SXM: tensor cores as H100 SXM; 4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s.
    # DGX H200 datasheet: a 400 Gb/s port per GPU. MAMF: H200 SXM fp8 1,453.4 TFLOPS (1280x4096x12032); bf16 ours, 771 at 8192^3.
    Gpu("h200", "H200 SXM 141GB", 90, ("NVIDIA H200",), "H200 SXM", _H100, 4.8e12, 900e9 / 2, 128e9 / 2, 400 * GBIT, 8,
        132, "NVIDIA H200 datasheet (SXM); network: DGX H200 datasheet",
        {"bf16": 771e12, "fp16": 771e12, "fp8": 1453.4e12}, f"bf16: {OURS_H200}; fp8: {MAMF_SOURCE}", 4.23e12, OURS_H200,
        attention_flops=ATTENTION_H200, mamf_k={"bf16": 8192, "fp16": 8192, "fp8": 12032}, short_k=SHORT_K_HOPPER,
        # the HGX H200 board has the HGX H100's NVLink 4 and NVSwitch: H100's collectives by size
        achieved_link_bytes_per_s=357.49e9, link_source="H100's all_gather busbw at 8 GiB (the same NVLink board)",
        nccl=NCCL_H100),
    Gpu("h200", "H200 NVL", 90, ("NVIDIA H200 NVL",), "H200 NVL", _dense(1671, 835, 3341, 60), 4.8e12,
        source="NVIDIA H200 datasheet (NVL)"),
    # NVIDIA HGX B200 datasheet, per GPU (the 8-GPU board / 8): FP8 9 PFLOPS*, BF16 4.5*, TF32 2.25*, FP64 TC 296
    # TFLOPS for the 8; 8 TB/s; NVLink 1.8 TB/s (no per-GPU host link). DGX B200: a 400 Gb/s port per GPU.
    # 148 SMs (NVIDIA Blackwell architecture technical brief). MAMF: B200 SXM bf16 1,745.0 (1792x16128x3072), fp8
    # 3,432.5 (15360x4096x3072) TFLOPS. Collectives by size: nccl-tests' published B200 sweep (`NCCL_B200`); the
    # plateau (all_gather, 16 GiB) prices what has no table (point-to-point sends, all-to-all).
    Gpu("b200", "B200 (HGX)", 100, ("NVIDIA B200",), "B200", _B200, 8e12, 1.8e12 / 2, None, 400 * GBIT, 8, 148,
        "NVIDIA HGX B200 datasheet, per GPU; network: DGX B200 datasheet",
        {"bf16": 1745e12, "fp16": 1745e12, "fp8": 3432.5e12}, MAMF_SOURCE,
        achieved_link_bytes_per_s=672.38e9, link_source="the all_gather busbw at 16 GiB",
        nccl=NCCL_B200, mamf_k={"bf16": 3072, "fp16": 3072, "fp8": 3072}),
    # NVIDIA GB200 NVL72 datasheet, per GPU (the rack / 72): FP8 10 PFLOPS*, BF16 5*, TF32 2.5*, FP64 TC 3,240
    # TFLOPS for the 72; 8 TB/s; NVLink 1.8 TB/s in one 72-GPU domain; NVLink-C2C to Grace 900 GB/s. DGX GB200:
    # a 400 Gb/s port per GPU. 148 SMs. MAMF: GB200 SXM bf16 1,822.0 (4096x9728x2048), fp8 3,615.6 (19456x5120x1536) TFLOPS.
    # Collectives by size: the HGX B200 board's sweep (`NCCL_B200`), the same NVLink 5 at 1.8 TB/s a GPU through
    # NVSwitch; an NVL72 rack's own all_reduce_perf over its 72 GPUs (coreweave/nccl-tests README, "Expected
    # Performance / GB200 / Single Rack", NCCL 2.26.2, 512 MiB to 8 GiB) plateaus where B200's 8 do: 839.16 GB/s
    # at 4 GiB and 834.57 at 8 GiB against 832.66 and 838.86. Groups of 8 or fewer (tensor, context, expert
    # parallel) are what the table measured; 72 ranks priced by the ring rule from 8 (`GpuRates.collective_seconds`)
    # come out 14% (8 GiB) to 30% (512 MiB) under the rack's measured busbw, whose all-reduce runs NVLink SHARP.
    Gpu("gb200", "GB200 (NVL72)", 100, ("NVIDIA GB200",), "GB200", _GB200, 8e12, 1.8e12 / 2, 900e9 / 2, 400 * GBIT, 72,
        148, "NVIDIA GB200 NVL72 datasheet, per GPU; network: DGX GB200 datasheet",
        {"bf16": 1822e12, "fp16": 1822e12, "fp8": 3615.6e12}, MAMF_SOURCE,
        achieved_link_bytes_per_s=672.38e9, link_source="B200's all_gather busbw at 16 GiB (the same NVLink 5 and NVSwitch)",
        nccl=NCCL_B200, mamf_k={"bf16": 2048, "fp16": 2048, "fp8": 1536}),
    # NVIDIA L40S datasheet: BF16 733 TFLOPS*, TF32 366*.
    Gpu("l40s", "L40S", 89, ("NVIDIA L40S",), "L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "fp32": 183e12},
        source="NVIDIA L40S datasheet"),
    # Kinds Megatron runs on that the time model has no rates for: their compute capability only.
    Gpu("v100", "V100", 70), Gpu("t4", "T4", 75), Gpu("a10", "A10", 86), Gpu("a40", "A40", 86), Gpu("l4", "L4", 89),
    Gpu("h20", "H20", 90), Gpu("gh200", "GH200", 90), Gpu("b300", "B300", 103), Gpu("gb300", "GB300", 103),
)

KINDS: dict[str, Gpu] = {}
"""Each kind's reference product (the first listed: the SXM board the vendor's DGX system holds)."""
for _gpu in GPUS:
    KINDS.setdefault(_gpu.kind, _gpu)

COMPUTE_CAPABILITY: dict[str, int] = {kind: gpu.compute_capability for kind, gpu in KINDS.items()}

# The kinds a device name is searched for, longest first so that "gb200" is not read as "b200".
NAMED_KINDS = tuple(sorted(("gb300", "gb200", "b300", "b200", "h200", "h100", "a100", "l40s"), key=len, reverse=True))


def by_device_name(device_name: str) -> Gpu | None:
    """The product CUDA names exactly `device_name`, or None."""
    name = device_name.strip()
    return next((gpu for gpu in GPUS if name in gpu.device_names), None)
