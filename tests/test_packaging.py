"""What a user of the installed package sees: --version, Typer's shell completion, and a wheel
(not an editable install) that carries the presets and runs every command from another folder."""

from importlib import metadata

from typer.testing import CliRunner

from recompute_bench.cli.app import app


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
