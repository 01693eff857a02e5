"""Measured recompute costs for `plan --auto --profile`: the profile's shape key, its cache under
`results/profiles/`, and the solver's costs read from it. Pure Python (the measuring is
`measure/profile.py`, which imports torch).

A profile holds, for one layer of each kind the model has (dense, MoE), the median forward time of
every selective target on the device that measured it (`core_attn`, `layernorm` (both norms),
`mlp`, `moe`, `moe_act`, `shared_experts`) and of the whole layer, plus the bytes the saved-tensor
probe counted for the layer with no recompute and with each target recomputed. On CUDA it also
holds the host link's measured bandwidth (pinned copies both ways).

Recompute cost of a choice = the summed forward times of what it re-runs (a selective subset: its
modules'; full: the whole layer's), as the FLOPs model sums FLOPs.

Offload cost (CUDA only), a stated simple model: a layer's activations (B bytes) go to the host
while the next layer runs its forward and come back while the layer above runs its backward (about
twice a forward), so with link bandwidth W and the layer's forward time F the step waits
max(0, B/W - F) + max(0, B/W - 2F). Its memory: nothing kept on the device between forward and
backward; one layer's activations while it comes back (`stage.policy_activations`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recompute_bench.analysis.cache import cache_file, read_json
from recompute_bench.config.schema import Config

PROFILE_SCHEMA = "recompute-bench/profile/v1"
PROFILE_DIR = Path("results/profiles")


def shape_key(cfg: Config, device_name: str) -> dict[str, Any]:
    """What a profile depends on: the device's name and every field that shapes one layer's work
    (the model table, sequence length, micro-batch size, precision)."""
    tr = cfg.training
    return {"device_name": device_name, "model": cfg.to_dict()["model"],
            "training": {"seq_length": tr.seq_length, "micro_batch_size": tr.micro_batch_size, "precision": tr.precision}}


def cache_path(key: dict[str, Any], folder: Path = PROFILE_DIR) -> Path:
    """results/profiles/<device>-<hash of the key>.json."""
    return cache_file(folder, key["device_name"], json.dumps(key, sort_keys=True), 12)


def read_cached(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The profile cached at `path` for `key`, or None when there is none (or it is for another key)."""
    data = read_json(path, "profile cache")
    if data is None:
        return None
    if data.get("schema") != PROFILE_SCHEMA or data.get("key") != key:
        return None
    return data


class ProfileCosts:
    """The solver's costs (`auto.Costs`) from a measured profile, in seconds per micro-batch."""

    unit = "measured seconds"

    def __init__(self, profile: dict[str, Any], host_link_gbps: float | None = None):
        self.seconds = {kind: v["seconds"] for kind, v in profile["kinds"].items()}
        bandwidth = host_link_gbps * 1e9 if host_link_gbps else profile.get("host_link_bytes_per_s")
        self.bandwidth = bandwidth if profile["device"] == "cuda" else None
        if profile["device"] != "cuda":
            self.offload_note = "offload is not a choice on a CPU (CUDA only)"
        elif not self.bandwidth:
            self.offload_note = "offload is not a choice: the host link's bandwidth is unknown; pass --host-link-gbps"
        else:
            self.offload_note = (f"offload is a choice: host link {self.bandwidth / 1e9:.1f} GB/s, added time "
                                 "max(0, B/W - F) + max(0, B/W - 2F) per layer")

    def selective(self, kind: str, modules: frozenset[str]) -> float:
        """Summed forward times of `modules`; a module this kind lacks (a uniform setting's `mlp` on
        a MoE layer) runs nothing there."""
        return sum(self.seconds[kind].get(m, 0.0) for m in modules if m != "layer")

    def full(self, kind: str) -> float:
        return self.seconds[kind]["layer"]

    def offload(self, kind: str, nbytes: float) -> float | None:
        if not self.bandwidth:
            return None
        copy, forward = nbytes / self.bandwidth, self.full(kind)
        return max(0.0, copy - forward) + max(0.0, copy - 2 * forward)
