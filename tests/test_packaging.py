"""What a user of the installed package sees: --version, Typer's shell completion, and a wheel
(not an editable install) that carries the presets and runs every command from another folder."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from typer.testing import CliRunner

from recompute_bench.cli.app import app

pytestmark = pytest.mark.slow  # builds and installs the wheel: `make test-all`

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), prog_name="recompute-bench", env=env)


def test_version_prints_the_package_version():
    result = cli("--version")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"recompute-bench {metadata.version('recompute-bench')}\n"
    import recompute_bench
    assert recompute_bench.__version__ == metadata.version("recompute-bench")


def test_typer_completion_completes_commands_and_options():
    """What bash asks on <TAB>: `recompute-bench sw` -> sweep; `recompute-bench sweep --res` -> its options."""
    def complete(words: str) -> list[str]:
        result = cli(env={"_RECOMPUTE_BENCH_COMPLETE": "complete_bash", "COMP_WORDS": words,
                          "COMP_CWORD": str(len(words.split()) - 1)})
        assert result.exit_code == 0, result.output
        return result.stdout.split()

    assert complete("recompute-bench sw") == ["sweep"]
    assert complete("recompute-bench golden up") == ["update"]
    assert complete("recompute-bench sweep --res") == ["--resume", "--results-dir"]


def test_show_and_install_completion(tmp_path, monkeypatch):
    # Typer's own switch: take the shell from the command line instead of detecting the parent shell.
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    shown = cli("--show-completion", "zsh")
    assert shown.exit_code == 0 and "compdef _recompute_bench_completion recompute-bench" in shown.stdout
    installed = cli("--install-completion", "bash", env={"HOME": str(tmp_path)})
    assert installed.exit_code == 0, installed.output
    script = tmp_path / ".bash_completions" / "recompute-bench.sh"
    assert "_RECOMPUTE_BENCH_COMPLETE=complete_bash" in script.read_text()
    assert f"source '{script}'" in (tmp_path / ".bashrc").read_text()


# ----- the wheel ----------------------------------------------------------------------------------


def test_pyproject_lists_every_package_and_maps_the_presets():
    """The wheel holds the packages pyproject.toml lists; a new folder of recompute_bench/ must be one."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "recompute_bench").rglob("__init__.py")}
    # two data packages beside them: the presets, and the GPU rate profiles we measured, which plan --profile
    # reads without a GPU (a folder of the package without __init__.py: setuptools wants it listed)
    assert sorted(setuptools["packages"]) == sorted(folders | {"recompute_bench.workloads", "recompute_bench.analysis.profiles"})
    assert setuptools["package-dir"] == {"recompute_bench.workloads": "workloads"}
    assert setuptools["package-data"] == {"recompute_bench.workloads": ["*.toml"],
                                          "recompute_bench.analysis.profiles": ["*.json"]}
    assert list((ROOT / "recompute_bench" / "analysis" / "profiles").glob("*.json"))


def _run(args, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def test_a_wheel_installed_elsewhere_runs_workloads_run_sweep_and_report(tmp_path):
    """`pip wheel .`, then a fresh venv holding that wheel (not an editable install) runs every
    command from a folder that is no checkout. To spare reinstalling torch, the venv sees this test
    environment's third-party packages (not its recompute-bench) through a .pth file."""
    src = tmp_path / "src"
    top_level = {".git", ".venv", "results", "build", "dist", ".pytest_cache", ".device"}

    def ignore(folder, names):  # the checkout's sources only: no environment, results or build output
        return [n for n in names if n == "__pycache__" or n.endswith(".egg-info") or
                (Path(folder) == ROOT and n in top_level)]

    shutil.copytree(ROOT, src, ignore=ignore)
    _run([sys.executable, "-m", "pip", "wheel", str(src), "-w", str(tmp_path / "dist"), "--no-deps",
          "--no-build-isolation", "-q"])
    wheel = next((tmp_path / "dist").glob("recompute_bench-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata_text = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    presets = sorted(p.name for p in (ROOT / "workloads").glob("*.toml"))
    assert sorted(n.split("/")[-1] for n in names if n.startswith("recompute_bench/workloads/")) == presets
    assert "recompute_bench/analysis/profiles/rates-nvidia-h200.json" in names  # plan --profile without a GPU
    assert "Requires-Dist: matplotlib>=3.7" in metadata_text.splitlines()

    # Third-party packages of this environment, without recompute-bench (pip would uninstall it).
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("recompute_bench", "__editable__", "_virtualenv")) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "zz_test_deps.pth").write_text(f"{deps}\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RECOMPUTE_BENCH_WORKLOADS")}
    cli = [str(venv / "bin" / "recompute-bench")]
    where = _run([str(python), "-c", "import recompute_bench.config.presets as p; print(p.__file__); print(p.WORKLOADS_DIR)"],
                 cwd=elsewhere, env=env).stdout.split()
    assert [Path(w).is_relative_to(site) for w in where] == [True, True]
    assert _run([*cli, "--version"], cwd=elsewhere, env=env).stdout.strip().startswith("recompute-bench ")
    assert "tiny" in _run([*cli, "workloads", "--json"], cwd=elsewhere, env=env).stdout
    fast = ["--set", "training.warmup_steps=0", "--set", "training.measured_steps=1"]
    _run([*cli, "run", "--workload", "tiny", *fast, "--no-save"], cwd=elsewhere, env=env)
    _run([*cli, "sweep", "--baseline", "--modules", "core_attn", *fast, "--run-id", "w1"], cwd=elsewhere, env=env)
    _run([*cli, "report", "w1"], cwd=elsewhere, env=env)
    run = elsewhere / "results" / "w1"
    assert [json.loads(line)["status"] for line in (run / "results.jsonl").read_text().splitlines()] == ["ok", "ok"]
    assert (run / "pareto.png").read_bytes().startswith(b"\x89PNG") and "Pareto-optimal" in (run / "report.md").read_text()
