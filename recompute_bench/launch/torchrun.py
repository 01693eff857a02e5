"""A multi-rank point: launched with torchrun, one record merged from every rank's piece.

`run_ranks` starts torchrun (`torch.distributed.run`, through `launch.rank agent`, which dies with
this process) in a session of its own with c10d rendezvous: `--nproc-per-node`, `--nnodes`,
`--node-rank`, `--rdzv-endpoint` and `--rdzv-id` are passed through (one node: `localhost:0`, a
free port). Each rank (`launch.rank measure`) writes `rank<N>.json` in the point's pieces folder
after every step; when torchrun returns, or the point's time limit kills the whole group, the
pieces are merged into one record (`merge_pieces`) with every rank in `ranks`:

- a rank that finished: `ok`; that ran out of memory or failed: `oom` / `error` with its step,
  phase and message (a failing rank exits non-zero and torchrun stops its peers);
- a rank whose collective outlived `--watchdog-s`: `timeout`, naming the collective (gloo raises
  in Python; NCCL's watchdog writes its verdict to the rank's stderr and aborts the process, which
  torchrun's `--tee` keeps in the rank's own log file);
- a rank that torchrun saw end by a signal it did not send (SIGKILL from the host's OOM killer, a
  segfault): `killed`, with the signal and the step it was in;
- a rank still inside a step when the group was stopped (it waited for a failed or hung peer):
  `waiting`, with the last step it completed; a rank that left no piece: `error` with the message
  of torchrun's per-rank error file where there is one.

torchrun's own verdicts come from the agent (`launch.rank agent --exits`): each failed rank's exit
code and signal, and which failure it observed first; its per-rank logs and error files lie under
`torchrun/node<N>/` of the pieces folder, cleared when the node launches again.

Like `launch.process`, this module never imports torch: the sweep parent must hold no CUDA
context. A two-node point needs the pieces folder on a filesystem both nodes see to merge every
rank; each node's launcher merges the pieces it can read.
"""

from __future__ import annotations

import dataclasses

import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from recompute_bench.launch.process import innermost_frame, tail_of, failed_record, run_group, worker_env
from recompute_bench.measure.record import STATUS_ORDER, pipeline_summary, rank_summary, unmeasured_rank
from recompute_bench.config.choices import SPLIT_BACKWARD_SCHEDULES
from recompute_bench.config.schema import Config, BadInput
from recompute_bench.config.rules import check_expert_parallel_world

DATA_PARALLEL = ("ddp", "fsdp")
RANK_COMMAND = [sys.executable, "-m", "recompute_bench.launch.rank"]
PEER_GONE = ("closed by peer", "reset by peer", "communicator was aborted", "Broken pipe")
"""How a collective fails when a peer died: that rank was waiting for the peer, not failing itself."""
WATCHDOG = ("Timed out", "timed out", "Watchdog caught collective operation timeout")
"""How a collective fails when its time limit (--watchdog-s) passed: a peer hung."""
NCCL_WATCHDOG = re.compile(r"Rank (?P<rank>\d+)\] Watchdog caught collective operation timeout: WorkNCCL\("
                           r"SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+).*?\) ran for (?P<ms>\d+) milliseconds")
"""The verdict ProcessGroupNCCL's watchdog thread writes to the rank's stderr when a collective
outlives its timeout (`WorkNCCL::checkTimeout`, torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp).
Under torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING=3 the same thread then rethrows it
(`WorkNCCL::handleException`): the process ends by SIGABRT and Python never sees an exception, so
this line in the rank's own stderr file is where the verdict survives."""
C10D_FRAME = re.compile(r'File "[^"]*torch/distributed/distributed_c10d\.py", line \d+, in (\w+)')


@dataclass
class Launch:
    """How a point is spread over processes and nodes (recorded as the record's `launch`)."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None
    rdzv_id: Optional[str] = None
    data_parallel: str = "ddp"
    memory_limit_gb: Optional[float] = None
    watchdog_s: float = 300.0
    """Time limit of one collective: a rank waiting longer for its peers fails instead of hanging."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "world_size": self.world_size}


def check_launch(cfg: Config, launch: Launch, device_type: str) -> Config:
    """The config a launch measures, its data-parallel size taken from the world when not given;
    BadInput (one line, the fix) for what cannot be launched."""
    from recompute_bench.launch.devices import check_torch
    check_torch()
    p = cfg.parallel
    if launch.nproc_per_node < 1 or launch.nnodes < 1:
        raise BadInput("--nproc-per-node and --nnodes must be 1 or more")
    if not 0 <= launch.node_rank < launch.nnodes:
        raise BadInput(f"--node-rank {launch.node_rank} must be between 0 and --nnodes {launch.nnodes} - 1")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise BadInput("--nnodes above 1 needs the rendezvous host of node 0: pass --rdzv-endpoint HOST:PORT")
    if launch.data_parallel not in DATA_PARALLEL:
        raise BadInput(f"--data-parallel {launch.data_parallel!r} is not one of {', '.join(DATA_PARALLEL)}")
    if launch.memory_limit_gb is not None:
        if device_type != "cuda":
            raise BadInput("--memory-limit-gb caps the CUDA allocator and there is no CUDA device here; "
                              "drop --memory-limit-gb")
        if launch.memory_limit_gb <= 0:
            raise BadInput(f"--memory-limit-gb must be a positive number of GiB, got {launch.memory_limit_gb:g}")
    if cfg.training.framework != "recompute-bench":
        raise BadInput(f"framework {cfg.training.framework} is estimated, not run: this harness measures its own "
                          "layers; drop --framework (or use `estimate --framework megatron`)")
    if device_type == "cuda":
        from recompute_bench.launch.devices import visible_gpu_count
        gpus = visible_gpu_count()  # from NVML: the launcher holds no CUDA context
        if gpus is not None and launch.nproc_per_node > gpus:
            raise BadInput(f"--nproc-per-node {launch.nproc_per_node} needs one GPU per rank and this node shows "
                              f"{gpus}; pass --nproc-per-node {max(gpus, 1)}"
                              + (" (or --device cpu)" if gpus == 0 else " (or make more GPUs visible through CUDA_VISIBLE_DEVICES)"))
    world, tp, pp, cp = launch.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if world % (tp * pp * cp):
        raise BadInput(f"tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp}"
                       f"{f' x context_parallel_size {cp}' if cp > 1 else ''} does not divide the {world} rank(s) "
                       f"launched; pass --nproc-per-node (x --nnodes) as a multiple of {tp * pp * cp}")
    if pp > 1:
        _check_pipeline(cfg)
    dp = world // (tp * pp * cp)
    if tp > 1 and dp > 1 and launch.data_parallel == "ddp":
        raise BadInput("DDP does not take tensor-parallel (DTensor) parameters; pass --data-parallel fsdp to "
                          "combine data and tensor parallelism")
    if dp * cp > 1 and p.use_distributed_optimizer and launch.data_parallel == "ddp":
        raise BadInput("use_distributed_optimizer shards the optimizer state, which FSDP does here; pass "
                          "--data-parallel fsdp or drop --set parallel.use_distributed_optimizer=true")
    if dp * cp > 1 and (p.data_parallel_size == 1 or launch.data_parallel == "fsdp"):  # FSDP also shards over cp
        from recompute_bench.config.rules import validate
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
            p, data_parallel_size=p.data_parallel_size if p.data_parallel_size > 1 else dp,
            use_distributed_optimizer=p.use_distributed_optimizer or launch.data_parallel == "fsdp"))
        validate(cfg)  # the global batch must still split into micro-batches over the ranks
        p = cfg.parallel
    if p.expert_model_parallel_size > 1 and launch.data_parallel == "fsdp":
        raise BadInput("expert parallel with FSDP is not measured here (expert weights would need their own "
                          "sharding group); pass --data-parallel ddp, or --ep 1")
    check_expert_parallel_world(cfg)
    if p.data_parallel_size != dp:
        raise BadInput(f"data_parallel_size {p.data_parallel_size} x tensor_model_parallel_size {tp} x "
                          f"pipeline_model_parallel_size {pp}{f' x context_parallel_size {cp}' if cp > 1 else ''} "
                          f"does not match the {world} rank(s) launched (--nproc-per-node x --nnodes); pass "
                          f"--nproc-per-node {p.data_parallel_size * tp * pp * cp} or --data-parallel-size {dp}")
    if pp > 1 and p.schedule == "1F1B" and cfg.num_microbatches < pp:
        raise BadInput(f"torch's 1F1B schedule needs at least as many micro-batches as stages ({pp}), got "
                          f"{cfg.num_microbatches}; pass --global-batch-size "
                          f"{pp * cfg.training.micro_batch_size * p.data_parallel_size} or more, or --pp-schedule GPipe")
    return cfg


def _check_pipeline(cfg: Config) -> None:
    """What pipeline parallelism is measured with here; BadInput otherwise."""
    p = cfg.parallel
    if p.expert_model_parallel_size > 1:
        raise BadInput("expert parallel with pipeline parallel is not measured here; pass --ep 1 or --pp 1")
    check_schedule_recompute(p.schedule, cfg.recompute)


def check_schedule_recompute(schedule: str, recompute) -> None:
    """BadInput when `schedule` splits its backward (input gradients, then weight gradients) and
    `recompute` recomputes anything: the harness's checkpoints are re-entrant, as Megatron's, and
    torch.utils.checkpoint refuses a re-entrant checkpoint under `autograd.grad(..., inputs=...)`,
    which torch's `stage_backward_input` runs (torch/distributed/pipelining/_backward.py)."""
    if schedule in SPLIT_BACKWARD_SCHEDULES and recompute.recomputes:
        raise BadInput(f"{schedule} splits each backward into input and weight gradients (autograd.grad with "
                          "inputs), which re-entrant checkpoints (Megatron's, use_reentrant=True) refuse; pass "
                          "--pp-schedule 1F1B or Interleaved1F1B to recompute, or --recompute-granularity none")


def torchrun_command(launch: Launch, pieces: Path, *, device: str | None = None,
                     peak_tflops: float | None = None, program: str = "measure") -> list[str]:
    """The command that launches every rank of this node (torchrun's own options, then the rank
    program: `measure` a point, or `verify`)."""
    endpoint = launch.rdzv_endpoint or "localhost:0"  # one node: c10d on a free local port
    logs = node_logs(pieces, launch.node_rank)
    command = [*RANK_COMMAND, "agent", "--exits", str(logs / "exits.json"),
               "--nproc-per-node", str(launch.nproc_per_node), "--nnodes", str(launch.nnodes),
               "--node-rank", str(launch.node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
               "--rdzv-id", launch.rdzv_id or "recompute-bench", "--max-restarts", "0",
               # each rank's stdout and stderr to its own file (a watchdog's verdict stays with its
               # rank) and to this node's log, lines prefixed "[default<local rank>]:"
               "--log-dir", str(logs), "--tee", "3",
               "-m", "recompute_bench.launch.rank", program, "--pieces", str(pieces),
               "--data-parallel", launch.data_parallel, "--watchdog-s", f"{launch.watchdog_s:g}"]
    if device:
        command += ["--device", device]
    if peak_tflops:
        command += ["--peak-tflops", str(peak_tflops)]
    if launch.memory_limit_gb:
        command += ["--memory-limit-gb", f"{launch.memory_limit_gb:g}"]
    return command


def node_logs(pieces: Path, node_rank: int) -> Path:
    """The folder of this node's torchrun logs: the agent's verdicts, each rank's stdout, stderr and
    error file (one folder per node, so nodes sharing the pieces folder keep their own)."""
    return pieces / "torchrun" / f"node{node_rank}"


def run_ranks(cfg: Config, launch: Launch, *, name: str, pieces: Path, log_path: Path, timeout_s: float,
              device: str | None = None, peak_tflops: float | None = None) -> dict:
    """Measure `cfg` over the ranks of `launch` and return the merged record (never raises for a
    failed, crashed or hung point; KeyboardInterrupt kills every rank and propagates)."""
    pieces.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    for old in pieces.glob("rank*.json"):
        old.unlink()
    logs = node_logs(pieces, launch.node_rank)
    shutil.rmtree(logs, ignore_errors=True)  # an earlier launch's error files are not this one's
    (pieces / "config.json").write_text(json.dumps(cfg.to_dict()))
    code = run_group(torchrun_command(launch, pieces, device=device, peak_tflops=peak_tflops), log_path,
                     worker_env(name), timeout_s, header=f"{name} {cfg.recompute.label} x{launch.world_size}")
    found = {}
    for path in pieces.glob("rank*.json"):
        try:
            piece = json.loads(path.read_text())
            found[piece["rank"]] = piece
        except (json.JSONDecodeError, KeyError):
            pass
    timeout = None
    if code is None:
        where = innermost_frame(tail_of(log_path, 80))
        timeout = (f"no result within the time limit of {timeout_s:g} s; every rank was killed"
                   + (f" (one was in {where})" if where else ""))
    return merge_pieces(cfg, launch, found, timeout=timeout, errors=_error_files(logs), exits=_exits(logs),
                        stderrs=_stderr_files(logs), log_tail=tail_of(log_path), device=device)


def verify_over_ranks(cfg: Config, settings: list, backends: list[str], launch: Launch, *, work: Path,
                      timeout_s: float, device: str | None = None) -> dict:
    """`verify` over the ranks of `launch` (`measure.distributed.verify_ranks`): rank 0's result, or
    BadInput naming the log when the ranks left none."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "verify.json").unlink(missing_ok=True)
    (work / "verify-in.json").write_text(json.dumps({"config": cfg.to_dict(), "settings": [asdict(s) for s in settings],
                                                     "backends": backends}))
    log = work / f"verify.node{launch.node_rank}.log"
    code = run_group(torchrun_command(launch, work, device=device, program="verify"), log, worker_env("verify"),
                     timeout_s, header=f"verify x{launch.world_size}")
    if not (work / "verify.json").is_file():
        how = "ran past the time limit" if code is None else f"ended with exit code {code}"
        raise BadInput(f"verify over {launch.world_size} ranks {how} without a result; see {log}")
    return json.loads((work / "verify.json").read_text())


def _rank_files(logs: Path, name: str) -> dict[int, Path]:
    """torchrun's per-rank files called `name` under a node's log folder, by local rank."""
    return {int(path.parent.name): path for path in logs.glob(f"*/attempt_*/*/{name}") if path.parent.name.isdigit()}


def _error_files(logs: Path) -> dict[int, str]:
    """Messages of torchrun's per-rank error files (written by `errors.record`), by local rank."""
    messages = {}
    for local_rank, path in _rank_files(logs, "error.json").items():
        try:
            message = json.loads(path.read_text())["message"]
            messages[local_rank] = message.get("message", str(message)) if isinstance(message, dict) else str(message)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return messages


def _stderr_files(logs: Path) -> dict[int, str]:
    """Each rank's stderr as torchrun's --tee kept it, by local rank."""
    texts = {}
    for local_rank, path in _rank_files(logs, "stderr.log").items():
        try:
            texts[local_rank] = path.read_text(errors="replace")
        except OSError:
            pass
    return texts


def _exits(logs: Path) -> dict:
    """The agent's verdicts on the failed ranks (`launch.rank.exits_of`); {} when none failed."""
    try:
        return json.loads((logs / "exits.json").read_text())
    except (OSError, ValueError):
        return {}


def nccl_watchdog_verdict(stderr: str) -> dict | None:
    """The collective ProcessGroupNCCL's watchdog timed out, read from a rank's stderr (`NCCL_WATCHDOG`):
    {"collective", "seq", "ran_s"}, or None when the watchdog said nothing."""
    match = NCCL_WATCHDOG.search(stderr or "")
    if match is None:
        return None
    return {"collective": match["op"], "seq": int(match["seq"]), "ran_s": int(match["ms"]) / 1e3}


def _collective(traceback: str | None) -> str | None:
    """The torch.distributed call a Python traceback ended in ("barrier", "all_reduce"), or None (a
    collective DDP or FSDP launched from inside backward has no such frame)."""
    calls = C10D_FRAME.findall(traceback or "")
    return calls[-1] if calls else None


def _killed(rank: int, exits: dict) -> str | None:
    """The signal that killed `rank` when torchrun did not send it: the rank torchrun saw fail first,
    or any other rank ended by a signal other than the SIGTERM torchrun stops the rest with."""
    ended = (exits.get("ranks") or {}).get(str(rank))
    if not ended or not ended.get("signal"):
        return None
    return ended["signal"] if exits.get("first") == rank or ended["signal"] != "SIGTERM" else None


def classify_rank(rank: int, piece: dict | None, *, exits: dict, error: str | None = None, stderr: str = "",
                  timeout: str | None = None, log_tail: str = "") -> dict:
    """One rank's entry of the merged record: its piece's own verdict, else torchrun's and the
    collective watchdog's (see the module docstring)."""
    watchdog = nccl_watchdog_verdict(stderr)
    signal = _killed(rank, exits)
    if piece is None:
        last = log_tail.splitlines()[-1] if log_tail else "no output"
        ended = "running" if watchdog or signal else None  # ended before its first piece: as one inside a step
        entry = unmeasured_rank(rank, "", ended or ("waiting" if timeout else "error"),
                                {"step": None, "phase": None,
                                 "message": error or (timeout or f"the rank left no result: {last}")})
    else:
        entry = dict(piece["rank_entry"])
    step = entry.get("step")
    message = (entry.get("failure") or {}).get("message", "")
    if watchdog and entry["status"] in ("running", "error"):
        entry.update(status="timeout", failure={
            "step": step, "phase": None, "collective": watchdog["collective"],
            "message": f"the NCCL watchdog timed out {watchdog['collective']} (collective {watchdog['seq']}) after "
                       f"{watchdog['ran_s']:g} s waiting for a peer, then aborted the rank"})
    elif entry["status"] == "error" and any(w in message for w in WATCHDOG):
        # its collective waited past --watchdog-s for a peer (gloo raises in Python)
        entry["status"] = "timeout"
        entry["failure"] = {**entry["failure"], "collective": _collective(entry["failure"].get("traceback"))}
    elif entry["status"] == "error" and any(w in message for w in PEER_GONE):
        entry["status"] = "waiting"  # in a collective when a peer died
    elif signal and entry["status"] == "running":
        entry.update(status="killed", failure={
            "step": step, "phase": None, "signal": signal,
            "message": f"killed by {signal}" + (f" while running step {step}" if step is not None else "")
                       + (" (the host's out-of-memory killer sends SIGKILL)" if signal == "SIGKILL" else "")})
    elif entry["status"] == "running":  # stopped inside a step: it waited for a peer, or hung
        entry.update(status="waiting", failure={
            "step": step, "phase": None,
            "message": f"still running step {step} when the group was stopped"
                       + (f": {timeout}" if timeout else " after another rank failed")})
    return entry


def merge_pieces(cfg: Config, launch: Launch, pieces: dict[int, dict], *, timeout: str | None = None,
                 errors: dict[int, str] | None = None, exits: dict | None = None, stderrs: dict[int, str] | None = None,
                 log_tail: str = "", device: str | None = None) -> dict:
    """One record from the ranks' pieces: every rank in `ranks` (`classify_rank`), the point's status
    and failure from them, the metrics of the lowest rank that has them, peaks the largest over the
    ranks. `errors` and `stderrs` are by local rank (this node's), `exits` the agent's verdicts."""
    errors, stderrs = errors or {}, stderrs or {}
    first_local = launch.node_rank * launch.nproc_per_node
    ranks = [classify_rank(r, pieces.get(r), exits=exits or {}, error=errors.get(r - first_local),
                           stderr=stderrs.get(r - first_local, ""), timeout=timeout, log_tail=log_tail)
             for r in range(launch.world_size)]

    statuses = [e["status"] for e in ranks]
    status = next((s for s in STATUS_ORDER if s in statuses), "ok")
    if timeout and status in ("waiting", "ok"):
        status = "timeout"
        for e in ranks:
            if e["status"] == "waiting":
                e["status"] = "timeout"
    first = next((e for e in ranks if e["status"] == status), None) if status != "ok" else None
    if first is None and status != "ok":
        first = next(e for e in ranks if e["status"] != "ok")
    record = failed_record(cfg, status, first["failure"] if first else None, device)
    base = next((pieces[r] for r in sorted(pieces) if "env" in pieces[r]), None) or next(iter(pieces.values()), None)
    if base is not None:
        record["env"] = base.get("env", record["env"])
        record["metrics"] = dict(base["metrics"])
    record["ranks"] = ranks
    record["status"] = status
    record["failure"] = None if first is None else {**first["failure"], "rank": first["rank"]}
    peaks = [e["peak_allocated_bytes"] for e in ranks if e.get("peak_allocated_bytes") is not None]
    record["metrics"]["peak_allocated_bytes"] = max(peaks) if peaks else None
    record["metrics"]["peak_allocated_spread_bytes"] = max(peaks) - min(peaks) if peaks else None
    reserved = [e["peak_reserved_bytes"] for e in ranks if e.get("peak_reserved_bytes") is not None]
    record["metrics"]["peak_reserved_bytes"] = max(reserved) if reserved else None
    record["launch"] = launch.record()
    pipeline = pipeline_summary(record)
    if pipeline:
        record["pipeline"] = pipeline
    if record["failure"] is not None:
        record["failure"]["summary"] = rank_summary(record)
    return record

