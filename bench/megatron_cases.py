"""Regenerate tests/data/megatron/cases.json from a checkout of Megatron-LM: the facts of its GPT,
MoE and Mixtral functional tests, not its code.

For each case under `tests/functional_tests/test_cases/{gpt,moe,mixtral}/<case>/`: the arguments and environment of
its `model_config.yaml`, the GPU count of each (environment, platform) its recipes under
`tests/test_utils/recipes/` run it on (`nodes` x `gpus`), and from each
`golden_values_{dev,lts}_dgx_{h100,a100,gb200}.json` the last step's `mem-allocated-bytes` (after the
step) and `mem-max-allocated-bytes` (the peak since the process started: training.py never resets
it). Megatron logs them on the last rank, world_size - 1 (megatron/training/global_vars.py
`_set_tensorboard_writer`: the writer exists on that rank only; training.py `training_log` writes
`mem-*` through it), so they describe the last pipeline stage. Cases without memory goldens are left
out. Needs PyYAML (`pip install pyyaml`); not run by the tests.

    python bench/megatron_cases.py /path/to/Megatron-LM          # a clone or the bare git dir
    python bench/megatron_cases.py REPO --output tests/data/megatron/cases.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import yaml

TEST_CASES = "tests/functional_tests/test_cases"
SUITES = ("gpt", "moe", "mixtral")
"""The folders of test cases read; each case records its folder as `suite`."""
RECIPE_MODELS = ("gpt", "moe")
RECIPES = "tests/test_utils/recipes"
GOLDEN = re.compile(r"golden_values_(dev|lts)_dgx_(h100|a100|gb200)\.json$")
OUTPUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "megatron" / "cases.json"


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout


def gpu_counts(repo: str) -> dict[str, dict[str, dict[str, object]]]:
    """{case: {folder: {"gpus": nodes x gpus, "recipe": path}}} over every GPT recipe at HEAD, by the
    recipe's folder: h100/ runs DGX nodes (platforms dgx_h100 and dgx_a100, 8 GPUs a node), gb200/
    GB200 nodes (4 GPUs a node)."""
    out: dict[str, dict[str, dict[str, object]]] = {}
    files = git(repo, "ls-tree", "-r", "--name-only", "HEAD", RECIPES).split()
    for path in sorted(f for f in files if f.endswith(".yaml")):
        recipe = yaml.safe_load(git(repo, "show", f"HEAD:{path}"))
        spec = (recipe or {}).get("spec") or {}
        if spec.get("model") not in RECIPE_MODELS or not spec.get("gpus"):
            continue
        folder = path.split("/")[-2]
        for product in recipe.get("products") or []:
            for variant in product.get("products") or [{}]:
                gpus = variant.get("gpus", spec["gpus"]) * variant.get("nodes", spec.get("nodes", 1))
                for case in product.get("test_case") or []:
                    held = out.setdefault(case, {}).get(folder)
                    if held and held["gpus"] != gpus:
                        raise SystemExit(f"{case}: {held['recipe']} runs {held['gpus']} GPUs, {path} {gpus}")
                    out[case][folder] = {"gpus": gpus, "recipe": path}
    return out


def suite_counts(repo: str, model: str) -> dict[str, dict[str, object]]:
    """The GPU count of the suite's recipe of each node kind for `model` (gpt, moe), for a case whose
    golden files stay but that no recipe at HEAD lists any more: h100/MODEL.yaml (DGX nodes, its
    `spec` count holds for every case it runs), gb200/MODEL.yaml, and gb200/MODEL-1node.yaml for
    `_1node` cases."""
    out = {}
    for key, path in (("h100", f"h100/{model}.yaml"), ("gb200", f"gb200/{model}.yaml"),
                      ("gb200_1node", f"gb200/{model}-1node.yaml")):
        spec = yaml.safe_load(git(repo, "show", f"HEAD:{RECIPES}/{path}"))["spec"]
        out[key] = {"gpus": spec["gpus"] * spec.get("nodes", 1), "recipe": f"{RECIPES}/{path} (spec; case not listed)"}
    return out


def mode_of(config: dict) -> str:
    """What the case runs: training unless its yaml says otherwise (MODE: inference, rl)."""
    return config.get("MODE", "training")


def last_step(golden: dict, metric: str) -> tuple[int, float] | None:
    entry = golden.get(metric)
    values = entry.get("values") if isinstance(entry, dict) else None  # some old files hold other layouts
    values = values or {}
    steps = [(int(k), v) for k, v in values.items() if isinstance(v, (int, float))]
    return max(steps) if steps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", help="a Megatron-LM checkout (work tree or bare git directory)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    commit = git(args.repo, "rev-parse", "HEAD").strip()
    folders = [f"{TEST_CASES}/{name}" for name in SUITES]
    files = git(args.repo, "ls-tree", "-r", "--name-only", "HEAD", *folders, RECIPES).split()
    counts = gpu_counts(args.repo)
    suites = {model: suite_counts(args.repo, model) for model in RECIPE_MODELS}
    cases = []
    for case_suite, case in sorted({tuple(f.split("/")[3:5]) for f in files if f.startswith(TEST_CASES + "/")}):
        folder = f"{TEST_CASES}/{case_suite}/{case}"
        suite = suites["gpt" if case_suite == "gpt" else "moe"]
        if f"{folder}/model_config.yaml" not in files:
            continue
        config = yaml.safe_load(git(args.repo, "show", f"HEAD:{folder}/model_config.yaml"))
        goldens = {}
        for path in sorted(f for f in files if f.startswith(folder + "/") and GOLDEN.search(f)):
            env, gpu = GOLDEN.search(path).groups()
            text = git(args.repo, "show", f"HEAD:{path}").strip()
            if not text:  # a few golden files are committed empty
                continue
            golden = json.loads(text)
            allocated, peak = last_step(golden, "mem-allocated-bytes"), last_step(golden, "mem-max-allocated-bytes")
            if not allocated or not peak:
                continue
            # A golden of a platform the recipes no longer list was measured on the same folder's nodes.
            nodes = "gb200" if gpu == "gb200" else "h100"
            placed = counts.get(case, {}).get(nodes)
            if placed is None and mode_of(config) == "training" and config.get("TEST_TYPE") != "release":
                placed = suite[nodes + ("_1node" if nodes == "gb200" and case.endswith("_1node") else "")]
            goldens[f"{env}_{gpu}"] = {"path": path, "step": peak[0], "allocated_bytes": int(allocated[1]),
                                       "max_allocated_bytes": int(peak[1]),
                                       "gpus": placed["gpus"] if placed else None,
                                       "recipe": placed["recipe"] if placed else None}
        if goldens:
            cases.append({"case": case, "suite": case_suite, "path": f"{folder}/model_config.yaml", "test_type": config.get("TEST_TYPE"),
                          "mode": mode_of(config), "env": config.get("ENV_VARS") or {},
                          "args": config.get("MODEL_ARGS") or {}, "goldens": goldens})
    data = {"source": "https://github.com/NVIDIA/Megatron-LM", "commit": commit,
            "generated_by": "bench/megatron_cases.py",
            "note": ("mem-allocated-bytes and mem-max-allocated-bytes of each golden's last step, logged on the last "
                     "rank (world_size - 1); gpus: nodes x gpus of the recipe that runs the case on that platform"),
            "cases": cases}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{len(cases)} cases with memory goldens from {commit[:7]} -> {args.output}")


if __name__ == "__main__":
    main()
