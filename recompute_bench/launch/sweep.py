"""A sweep: the plan (which points), and running it point by point into `results/<run-id>/`.

The command-line flags expand into points as `expand` says (the rules and their order are
tabled once, in docs/sweeps.md, and `sweep --dry-run` prints the result).

`--grid FILE` lists the points instead (see `load_grid`). Points other than the baseline are named
"Exp 1", "Exp 2", ... in plan order, as the experiment tables of the field do.

Running: every point runs in its own worker process (`launch.run_isolated`) under a time limit;
each finished record is appended to `results.jsonl` at once; the plan is saved as `plan.json` with
how its points run (`RunSettings`: ranks, nodes, data-parallel engine, memory limit, device, time
limits, peak), so `--resume <run-id>` alone re-runs the saved plan the same way and skips points
with an ok or oom record (error and timeout points are tried again). A lock refuses a second sweep
on the same run id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import signal
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from recompute_bench.config.fields import fields, flagged, overrides_from_keys
from recompute_bench.config.presets import DEFAULT_WORKLOAD
from recompute_bench.workload import resolve
from recompute_bench.config.choices import SUPPORTED_RECOMPUTE_MODULES
from recompute_bench.config.schema import BadInput, Config, RecomputeConfig
from recompute_bench.config.labels import canonical_modules
from recompute_bench.launch.process import run_isolated
from recompute_bench.launch.torchrun import Launch, run_ranks
from recompute_bench.workload import config_from_dict
from recompute_bench.recompute.settings import all_settings, full_settings, selective_settings
from recompute_bench.results.rows import point_id
from recompute_bench.results.store import (PLAN_FILE, RESULTS_FILE, RunLock, append_record, load_records,
                                           write_json_atomic)

PLAN_SCHEMA = "recompute-bench/sweep-plan/v1"
OLD_PLAN_SCHEMAS = ("recompute-bench/plan/v1",)
"""What sweeps before 0.1.0's last release called their plan.json (the same content): still resumed."""
DONE_STATUSES = ("ok", "oom")
# Keys a [[point]] of a grid file may set, and the config field each one overrides.


@dataclass
class Point:
    """One measurement of a sweep: its name and its fully resolved config."""

    name: str
    cfg: Config

    @property
    def setting(self) -> str:
        return self.cfg.recompute.label


def recompute_overrides(setting: RecomputeConfig) -> dict[str, Any]:
    """A recompute setting as `resolve` overrides (the whole recompute table, nothing implied)."""
    return {f"recompute.{name}": value for name, value in dataclasses.asdict(setting).items()}


def expand(*, num_layers: int, modules: list[str] | None = None, methods: list[str] | None = None,
           num_layers_recompute: list[int] | None = None, baseline: bool = False,
           notes: list[str] | None = None, targets: tuple[str, ...] = SUPPORTED_RECOMPUTE_MODULES) -> list[RecomputeConfig]:
    """The recompute settings the flags ask for (the rules: docs/sweeps.md); a
    flagless sweep takes every subset of `targets`, the modules the model offers."""
    if modules is None and methods is None and num_layers_recompute is None and not baseline:
        return [RecomputeConfig()] + all_settings(num_layers, targets)
    settings = [RecomputeConfig()] if baseline else []
    if modules is not None:
        named = canonical_modules(modules)
        if not named:
            raise BadInput("--modules names no module, so it expands to no setting; pass for example "
                              f"--modules {' '.join(SUPPORTED_RECOMPUTE_MODULES)}, or use --baseline for no recompute")
        settings += selective_settings(named)
    if methods is not None and not num_layers_recompute:
        raise BadInput("--methods needs --num-layers-recompute (the N of each full setting); "
                          "pass for example --methods uniform block --num-layers-recompute 1 2")
    if num_layers_recompute:
        if methods is None:
            methods = ["block"]
            if notes is not None:
                notes.append("--num-layers-recompute without --methods means method block (as Megatron Bridge's -rl)")
        if not methods:
            raise BadInput("--methods names no method; pass --methods uniform, block or both")
        settings += full_settings(methods, num_layers_recompute)
    unique: dict[str, RecomputeConfig] = {}
    for s in settings:
        unique.setdefault(s.label, s)
    return list(unique.values())


def name_points(configs: Iterable[Config], names: Iterable[str | None] | None = None) -> list[Point]:
    """Name points: a given name as is, the first point without recompute "Baseline", the rest
    "Exp 1", "Exp 2", ... in order. Duplicate names or settings are bad input."""
    configs = list(configs)
    names = list(names) if names is not None else [None] * len(configs)
    points, taken, seen, n = [], set(), {}, 0
    for cfg, given in zip(configs, names):
        if given:
            name = given
        elif cfg.recompute.granularity == "none" and not cfg.recompute.activation_offload_layers and "Baseline" not in taken:
            name = "Baseline"
        else:
            n += 1
            name = f"Exp {n}"
            while name in taken:
                n += 1
                name = f"Exp {n}"
        if name in taken:
            raise BadInput(f"two points are named {name!r}; give each [[point]] its own name")
        ident = point_id(cfg.record_fields())
        if ident in seen:
            raise BadInput(f"points {seen[ident]!r} and {name!r} are the same setting ({cfg.recompute.label}); "
                              "drop one of them")
        taken.add(name)
        seen[ident] = name
        points.append(Point(name, cfg))
    return points


def plan_from_flags(workload: str, *, overrides: dict[str, Any], sets: list[str], gpu: str | None,
                    modules: list[str] | None = None, methods: list[str] | None = None,
                    num_layers_recompute: list[int] | None = None, baseline: bool = False) -> tuple[list[Point], list[str]]:
    """Resolve every point the flags expand to; returns (points, notes). BadInput on bad input."""
    notes: list[str] = []
    base, base_notes = resolve(workload, overrides=overrides, sets=sets, gpu=gpu)
    settings = expand(num_layers=base.model.num_layers, targets=base.spec.recompute_targets,
                      modules=modules, methods=methods,
                      num_layers_recompute=num_layers_recompute, baseline=baseline, notes=notes)
    configs = []
    for setting in settings:
        cfg, point_notes = resolve(workload, overrides={**overrides, **recompute_overrides(setting)}, sets=sets, gpu=gpu)
        notes += point_notes
        configs.append(cfg)
    return name_points(configs), list(dict.fromkeys(base_notes + notes))


@dataclass
class Grid:
    """A grid file: the workload, `set` overrides for every point, and the points' own tables."""

    workload: str | None
    sets: list[str]
    points: list[dict[str, Any]]


def load_grid(path: Path) -> Grid:
    """Read a grid file (TOML):

        workload = "llama3-8b"              # optional; --workload on the command line wins
        set = ["model.num_layers=4"]        # optional; applied to every point
        [[point]]
        name = "Baseline"                   # optional; default Baseline / Exp N
        recompute_granularity = "none"
        [[point]]
        recompute_modules = ["core_attn", "mlp"]     # modules alone mean selective
        [[point]]
        recompute_granularity = "full"
        recompute_method = "uniform"
        recompute_num_layers = 1
        seq_length = 4096                   # any field, by its key (config/fields.py): the flag's name
        set = ["training.measured_steps=10"]

    A point without recompute keys measures no recompute.
    """
    try:
        with Path(path).open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise BadInput(f"grid file {path} does not exist; pass the path of a TOML file with [[point]] tables") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"grid file {path} is not valid TOML ({e}); fix the file") from None
    unknown = set(data) - {"workload", "set", "point", "description"}
    if unknown:
        raise BadInput(f"grid file {path} has unknown key(s) {', '.join(sorted(unknown))}; "
                          "use workload, set and [[point]] tables")
    points = data.get("point")
    if not isinstance(points, list) or not points:
        raise BadInput(f"grid file {path} lists no [[point]] table; add one per setting to measure")
    allowed = {f.key for f in fields()} | {"name", "set"}
    for i, point in enumerate(points, 1):
        bad = set(point) - allowed
        if bad:
            raise BadInput(f"point {i} of {path} has unknown key(s) {', '.join(sorted(bad))}; "
                              f"allowed: name, set and the field names, e.g. {', '.join(f.key for f in flagged())}")
    sets = data.get("set", [])
    if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
        raise BadInput(f'"set" in {path} must be a list of "section.key=value" strings')
    return Grid(data.get("workload"), sets, points)


def plan_from_grid(grid: Grid, workload: str, *, overrides: dict[str, Any], sets: list[str],
                   gpu: str | None) -> tuple[list[Point], list[str]]:
    """Resolve the points of a grid. Order of overrides: preset, the grid's `set`, --set, the
    dedicated flags, then the point's own keys and `set`."""
    configs, names, notes = [], [], []
    for i, point in enumerate(grid.points, 1):
        own = overrides_from_keys({k: v for k, v in point.items() if k not in ("name", "set")})
        if not any(k.startswith("recompute.") for k in own):
            own["recompute.granularity"] = "none"
        point_sets = point.get("set", [])
        if not isinstance(point_sets, list):
            raise BadInput(f'"set" of point {i} must be a list of "section.key=value" strings')
        try:
            cfg, point_notes = resolve(workload, overrides={**overrides, **own},
                                       sets=[*grid.sets, *sets, *point_sets], gpu=gpu)
        except BadInput as e:
            raise BadInput(f"point {point.get('name') or i} of the grid: {e}") from None
        configs.append(cfg)
        names.append(point.get("name"))
        notes += point_notes
    return name_points(configs, names), list(dict.fromkeys(notes))


@dataclass
class SweepRequest:
    """What a sweep is asked to measure: the workload and its overrides, and where the points come
    from (the expansion flags, a grid file, or the saved plan of the run being resumed), plus the
    Auto point of a per-layer policy."""

    workload: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    sets: list[str] = dataclasses.field(default_factory=list)
    gpu: str | None = None
    """Hardware kind whose preset tables apply (h100, cpu, ...)."""
    modules: list[str] | None = None
    methods: list[str] | None = None
    num_layers_recompute: list[str] | None = None
    """As given (strings); integers are checked here."""
    baseline: bool = False
    grid: Path | None = None
    resume: Path | None = None
    """The run folder of the sweep to resume."""
    run_id: str | None = None
    policy: str | None = None
    """`auto` or a policy file: one more point named Auto."""
    memory_gb: float | None = None
    device: str | None = None

    def plan_flags(self) -> list[str]:
        """The flags that choose the points, as given."""
        return [n for n, v in (("--modules", self.modules), ("--methods", self.methods),
                               ("--num-layers-recompute", self.num_layers_recompute),
                               ("--baseline", self.baseline or None), ("--grid", self.grid)) if v is not None]


def plan_points(req: SweepRequest) -> tuple[list[Point], list[str]]:
    """The points a sweep measures and the notes to show; BadInput on bad input."""
    counts = None
    if req.num_layers_recompute is not None:
        try:
            counts = [int(n) for n in req.num_layers_recompute]
        except ValueError:
            raise BadInput(f"--num-layers-recompute takes integers, got {' '.join(req.num_layers_recompute)}; "
                              "pass for example --num-layers-recompute 1 2") from None
    workload = req.workload or DEFAULT_WORKLOAD
    notes: list[str] = []
    if req.resume is not None:
        given = req.plan_flags() + [n for n, v in (("--workload", req.workload), ("--set", req.sets),
                                                   ("--run-id", req.run_id), ("--policy", req.policy)) if v]
        given += [f"--{k.split('.')[1].replace('_', '-')}" for k, v in req.overrides.items() if v is not None]
        if given:
            raise BadInput(f"--resume reruns the plan saved in {req.resume}/plan.json, Auto point included; "
                              f"drop {', '.join(given)}")
        return load_plan(req.resume), notes
    if req.grid is not None:
        if len(req.plan_flags()) > 1:
            raise BadInput(f"--grid lists the points itself; drop {', '.join(f for f in req.plan_flags() if f != '--grid')}")
        grid = load_grid(req.grid)
        points, notes = plan_from_grid(grid, req.workload or grid.workload or DEFAULT_WORKLOAD, overrides=req.overrides,
                                       sets=req.sets, gpu=req.gpu)
    else:
        points, notes = plan_from_flags(workload, overrides=req.overrides, sets=req.sets, gpu=req.gpu,
                                        modules=req.modules, methods=req.methods, num_layers_recompute=counts,
                                        baseline=req.baseline)
    if req.policy is not None:
        points.append(auto_point(points, req))
    elif req.memory_gb is not None:
        raise BadInput("--memory-gb is the budget of --policy auto; add --policy auto or drop --memory-gb")
    return points, notes


def auto_point(points: list[Point], req: SweepRequest) -> Point:
    """The sweep's Auto point: the policy `plan --auto` chooses for `req.memory_gb` (modelled for
    the sweep's device; a CPU has no allocator to allow for), or the policy file `req.policy`."""
    from recompute_bench.analysis.allowance import ALLOWANCE_BYTES, ALLOWANCE_FRACTION
    from recompute_bench.analysis.harness.auto import auto_plan
    from recompute_bench.launch.devices import default_device_type
    from recompute_bench.recompute.policy_file import with_policy

    if "Auto" in {p.name for p in points}:
        raise BadInput("a point is already named Auto; rename it in the grid file or drop --policy")
    base = points[0].cfg if points else resolve(req.workload or DEFAULT_WORKLOAD, overrides=req.overrides,
                                                sets=req.sets, gpu=req.gpu)[0]
    base = dataclasses.replace(base, recompute=RecomputeConfig())
    if req.policy != "auto":
        return Point("Auto", with_policy(base, Path(req.policy)))
    if req.memory_gb is None or req.memory_gb <= 0:
        raise BadInput(f"--policy auto needs the device memory per GPU; pass --memory-gb 80 (got {req.memory_gb})")
    modelled = "cuda" if (req.device or default_device_type()).startswith("cuda") else "cpu"
    allowance = (0.0, 0.0) if modelled == "cpu" else (ALLOWANCE_FRACTION, ALLOWANCE_BYTES)
    result = auto_plan(base, req.memory_gb * 2**30, modelled, *allowance)
    if result["policy"] is None:
        raise BadInput(f"--policy auto: no per-layer policy fits {req.memory_gb:g} GiB ({result['reason']}); "
                          "raise --memory-gb (see `recompute-bench plan --auto`)")
    return Point("Auto", dataclasses.replace(base, recompute=RecomputeConfig(layer_policy=result["policy"])))


@dataclass
class RunSettings:
    """How a sweep's points run, saved with its plan (`plan.json`'s "run") so that `--resume RUN`
    alone, the command a crash or Ctrl-C leaves a user with, launches them as the sweep did."""

    launch: Launch = dataclasses.field(default_factory=Launch)
    device: str | None = None
    timeout_s: float = 600.0
    peak_tflops: float | None = None

    FLAGS = {"device": "--device", "timeout_s": "--timeout", "peak_tflops": "--peak-tflops"}
    RETRY = ("timeout_s", "watchdog_s", "rdzv_endpoint", "rdzv_id")
    """What a resume may change: how long to wait, and where the nodes meet this time; everything
    else decides what is measured, and a resumed sweep measures its remaining points as its first
    ones were."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSettings":
        return cls(Launch(**data["launch"]), data["device"], float(data["timeout_s"]), data["peak_tflops"])

    def values(self) -> dict[str, Any]:
        """Every setting by its field name (the launch's own included)."""
        own = self.to_dict()
        return {**own.pop("launch"), **own}

    def resumed(self, given: "RunSettings", named: set[str], run: str) -> "RunSettings":
        """These saved settings with what a `--resume` command line `named` (field names) from
        `given`: the time limits and rendezvous replace the saved ones; anything else must agree
        with them (BadInput naming the flag to drop)."""
        saved, asked = self.values(), given.values()
        for name in sorted(named):
            if name not in self.RETRY and asked[name] != saved[name]:
                flag = self.FLAGS.get(name, f"--{name.replace('_', '-')}")
                was = f"{flag} {saved[name]}" if saved[name] is not None else f"no {flag}"
                raise BadInput(f"run {run} was launched with {was}, and a resumed sweep measures its remaining "
                               f"points as its first ones; drop {flag} {asked[name]}")
        retried = {name: asked[name] for name in named if name in self.RETRY}
        of_launch = {f.name for f in dataclasses.fields(Launch)}
        launch = dataclasses.replace(self.launch, **{k: v for k, v in retried.items() if k in of_launch})
        return dataclasses.replace(self, launch=launch, **{k: v for k, v in retried.items() if k not in of_launch})


def plan_to_dict(points: list[Point], settings: RunSettings | None = None) -> dict:
    """The plan as saved in `plan.json`, with how its points run where known."""
    plan = {"schema": PLAN_SCHEMA, "points": [{"name": p.name, "config": p.cfg.to_dict()} for p in points]}
    if settings is not None:
        plan["run"] = settings.to_dict()
    return plan


def load_run_settings(run_dir: Path) -> RunSettings | None:
    """How the sweep saved in `run_dir` ran its points; None for a plan saved before plans kept
    it (its resume takes the command line's). BadInput for a plan that cannot be read."""
    path = Path(run_dir) / PLAN_FILE
    try:
        data = json.loads(path.read_text()).get("run")
        return None if data is None else RunSettings.from_dict(data)
    except OSError:
        return None  # no plan: load_plan says so
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path} is not a sweep plan ({e}); start a new sweep instead of resuming") from None


def load_plan(run_dir: Path) -> list[Point]:
    """The plan saved by an earlier sweep of this run (for --resume)."""
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise BadInput(f"{path} does not exist, so there is no sweep to resume; pass the run id of a sweep "
                          "(a folder under results/ with a plan.json)")
    try:
        data = json.loads(path.read_text())
        if data.get("schema") not in (PLAN_SCHEMA, *OLD_PLAN_SCHEMAS):
            raise ValueError(f"schema {data.get('schema')!r}")
        return [Point(p["name"], config_from_dict(p["config"])) for p in data["points"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{path} is not a sweep plan ({e}); start a new sweep instead of resuming") from None


def point_record_id(point: Point) -> tuple[str, ...]:
    """The identity a record of this point will have (see results.point_id)."""
    return point_id(point.cfg.record_fields())


def done_points(results_file: Path) -> dict[tuple[str, ...], dict]:
    """Records already in a run's results that count as done (ok or oom), by point identity."""
    if not results_file.is_file():
        return {}
    return {point_id(r): r for r in load_records(results_file) if r.get("status") in DONE_STATUSES}


def resume_command(run_dir: Path, *options: str) -> str:
    """The command that continues the sweep in `run_dir`, as a user types it: the run id, then
    --results-dir unless the run lies in the default results/, then `options`; shell-quoted."""
    run_dir = Path(run_dir)
    where = [] if run_dir.parent == Path("results") else ["--results-dir", str(run_dir.parent)]
    return shlex.join(["recompute-bench", "sweep", "--resume", run_dir.name, *where, *options])


@contextlib.contextmanager
def ctrl_c_interrupts():
    """While the sweep runs, Ctrl-C (SIGINT) raises KeyboardInterrupt, whatever the process was
    started with. A process started with SIGINT ignored (`nohup`, a background job of a script)
    inherits that, and Python then installs no handler of its own: the sweep would run on and never
    kill its worker. A handler the caller installed (any Python callable) is left alone."""
    if threading.current_thread() is not threading.main_thread() or callable(signal.getsignal(signal.SIGINT)):
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_sweep(points: list[Point], run_dir: Path, settings: RunSettings, *, resume: bool = False,
              on_start: Callable[[Point, int], None] | None = None,
              on_done: Callable[[Point, dict, float, bool], None] | None = None) -> list[dict]:
    """Measure every point of the plan into `run_dir` and return one record per point, in plan order.

    Holds the run's lock throughout (BadInput when another sweep holds it). A new run saves the
    plan; a run that already has results is only continued with `resume=True`. `on_start(point,
    index)` and `on_done(point, record, seconds, skipped)` let the caller show progress. Ctrl-C
    raises KeyboardInterrupt (even when SIGINT was ignored at start) once the running point's
    worker is killed; every finished record is already in `results.jsonl`. With a launch of more
    than one rank (`settings.launch`), each point runs under torchrun (`launch.torchrun.run_ranks`).
    """
    launch, device, timeout_s, peak_tflops = settings.launch, settings.device, settings.timeout_s, settings.peak_tflops
    run_dir = Path(run_dir)
    results_file = run_dir / RESULTS_FILE
    with ctrl_c_interrupts(), RunLock(run_dir):
        if not resume and (results_file.exists() or (run_dir / PLAN_FILE).exists()):
            raise BadInput(f"run {run_dir.name} already exists in {run_dir.parent}; continue it with "
                              f"`{resume_command(run_dir)}` or pass another --run-id")
        if not (run_dir / PLAN_FILE).exists() or load_run_settings(run_dir) is None:
            # a new plan, or one saved before plans kept their launch: from now on it does
            write_json_atomic(run_dir / PLAN_FILE, plan_to_dict(points, settings))
        done = done_points(results_file) if resume else {}
        records = []
        for index, point in enumerate(points):
            previous = done.get(point_record_id(point))
            if previous is not None:
                records.append(previous)
                if on_done:
                    on_done(point, previous, 0.0, True)
                continue
            if on_start:
                on_start(point, index)
            t0 = time.monotonic()
            safe = point.name.replace(" ", "_").replace("/", "_")
            if launch.world_size > 1:
                record = run_ranks(point.cfg, launch, name=point.name, pieces=run_dir / "work" / safe,
                                   log_path=run_dir / "logs" / f"{safe}.log", timeout_s=timeout_s,
                                   device=device, peak_tflops=peak_tflops)
            else:
                record = run_isolated(point.cfg, name=point.name, out_path=run_dir / "work" / f"{safe}.json",
                                      log_path=run_dir / "logs" / f"{safe}.log", timeout_s=timeout_s,
                                      device=device, peak_tflops=peak_tflops, memory_limit_gb=launch.memory_limit_gb)
                record["launch"] = launch.record()  # as `run` records it: the memory limit included
            record["point"] = {"name": point.name, "index": index, "run_id": run_dir.name}
            append_record(results_file, record)
            records.append(record)
            if on_done:
                on_done(point, record, time.monotonic() - t0, False)
        return records
