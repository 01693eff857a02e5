"""A Megatron-LM command line kept in a text file, as launch scripts hold one:

    export CUBLAS_WORKSPACE_CONFIG=:4096:8
    torchrun --nproc-per-node 8 --nnodes 4 pretrain_gpt.py \\
        --num-layers 80 --hidden-size 8192 ... --recompute-modules core_attn mlp

Words are split as a POSIX shell splits them (shlex: quotes, `#` comments, a backslash at the end
of a line continuing it). `NAME=value` words before the command (or after `export`) are the run's
environment; the words after the training script (`*.py`), or from the first `--flag` when there is
no script, are Megatron's arguments (`megatron_argv.read_argv`); torchrun's `--nproc-per-node` and
`--nnodes` before the script give the GPU count. Pure Python.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from recompute_bench.ingest.megatron_argv import read_argv
from recompute_bench.ingest.parsed import ParsedRun, bad
from recompute_bench.config.schema import BadInput

FORMAT = "megatron-args"
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = ("&&", "||", ";", "|")
# torchrun's flags (torch/distributed/run.py get_args_parser): both spellings are accepted.
NPROC = ("--nproc-per-node", "--nproc_per_node")
NNODES = ("--nnodes",)


def words(text: str) -> list[tuple[str, int]]:
    """The shell words of `text` with the line (from 1) each is on. A line ending in a backslash
    continues on the next; a quote left open does too (its words take the line it opened on)."""
    out: list[tuple[str, int]] = []
    carry, start = "", None
    for n, line in enumerate(text.splitlines(), 1):
        body = (carry + line).rstrip()
        if body.endswith("\\") and not body.endswith("\\\\"):
            body = body[:-1]
        lexer = shlex.shlex(body, posix=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        try:
            tokens = list(lexer)
        except ValueError:  # a quote still open: read on with the next line
            carry, start = body + "\n", start or n
            continue
        out += [(t, start or n) for t in tokens]
        carry, start = "", None
    if carry:
        raise BadInput(f"line {start}: a quote is never closed")
    return out


def detect(text: str) -> bool:
    """Whether text reads as a command line of Megatron-LM (it sets --num-layers, as every run must)."""
    return command_words(text) is not None


def command_words(text: str) -> list[tuple[str, int]] | None:
    """The shell words of `text` (`words`) when it reads as a command line of Megatron-LM (it sets
    --num-layers, as every run must); None when it does not."""
    try:
        tokens = words(text)
    except BadInput:
        return None
    return tokens if any(w in ("--num-layers",) or w.startswith("--num-layers=") for w, _ in tokens) else None


def _command(path: Path, tokens: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], dict, int]:
    """The training command's words, the environment assigned before it, and where Megatron's
    arguments start in those words."""
    env: dict[str, str] = {}
    commands: list[list[tuple[str, int]]] = [[]]
    for word, line in tokens:
        if word in SEPARATORS:
            commands.append([])
        elif word == "export" and not commands[-1]:
            continue
        elif ASSIGNMENT.match(word) and not commands[-1]:
            name, _, value = word.partition("=")
            env[name] = value
        else:
            commands[-1].append((word, line))
    runs = [c for c in commands if any(w.endswith(".py") for w, _ in c)]
    if len(runs) > 1:
        raise bad(path, runs[1][0][1], "holds more than one training command (*.py); keep the one to estimate")
    command = runs[0] if runs else next((c for c in commands if any(w.startswith("--") for w, _ in c)), [])
    script = next((i for i, (w, _) in enumerate(command) if w.endswith(".py")), None)
    flags = [i for i, (w, _) in enumerate(command) if w.startswith("--")]
    if script is None and not flags:
        raise bad(path, None, "holds no command with --arguments; pass a file holding the Megatron-LM command line")
    return command, env, script + 1 if script is not None else flags[0]


def _launcher_gpus(path: Path, launcher: list[tuple[str, int]]) -> int | None:
    """torchrun's GPU count: --nproc-per-node x --nnodes (1 node when it is not given)."""
    values: dict[str, str] = {}
    for i, (word, _) in enumerate(launcher):
        name, eq, value = word.partition("=")
        if name in NPROC + NNODES:
            values[name.replace("_", "-")] = value if eq else (launcher[i + 1][0] if i + 1 < len(launcher) else "")
    nproc, nnodes = values.get("--nproc-per-node"), values.get("--nnodes", "1")
    if nproc is None:
        return None
    if not (nproc.isdigit() and nnodes.isdigit()):
        return None  # gpu, auto, an elastic range "1:4" or a shell variable: no count stated
    return int(nproc) * int(nnodes)


def read(path: Path, tokens: list[tuple[str, int]] | None = None) -> ParsedRun:
    """Read a command line: Megatron's arguments with their lines, the environment, the GPU count.
    `tokens`: the file's shell words (`words`), where they are already split."""
    path = Path(path)
    if tokens is None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise bad(path, None, f"cannot be read ({e}); pass a text file holding the command line") from None
        try:
            tokens = words(text)
        except BadInput as e:
            raise bad(path, None, f"{e}; close the quote") from None
    command, env, first = _command(path, tokens)
    argv = command[first:]
    try:
        arguments = read_argv([w for w, _ in argv])
    except BadInput as e:
        raise bad(path, None, f"{e}") from None
    lines = {}
    for word, line in argv:
        if word.startswith("--"):
            lines.setdefault(word[2:].split("=", 1)[0].replace("-", "_"), line)
    run = ParsedRun(FORMAT, path, timing="megatron", complete=True, arguments=arguments, argument_lines=lines, env=env)
    run.world_size = _launcher_gpus(path, command[:first])
    return run
