"""Which reader a file needs: named with `--format`, or detected from the file's content."""

from __future__ import annotations

import json
from pathlib import Path

from recompute_bench.ingest import bridge_golden, bridge_log, megatron_golden, megatron_log, torchtitan_log
from recompute_bench.ingest.parsed import ParsedRun, bad

LOG_READERS = {megatron_log.FORMAT: megatron_log, bridge_log.FORMAT: bridge_log, torchtitan_log.FORMAT: torchtitan_log}
JSON_READERS = {megatron_golden.FORMAT: megatron_golden, bridge_golden.FORMAT: bridge_golden}
FORMATS = (*LOG_READERS, *JSON_READERS)
HEAD_BYTES = 1 << 20  # the argument dump, the Bridge summary and the first steps fit well inside


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(path, getattr(e, "lineno", None), f"is not valid JSON ({getattr(e, 'msg', e)}); restore the golden "
                                                    "file") from None


def read_head(path: Path) -> str:
    """The first HEAD_BYTES of a file as text; bad input when it cannot be read."""
    try:
        with Path(path).open("rb") as f:
            return f.read(HEAD_BYTES).decode("utf-8", errors="replace")
    except OSError as e:
        raise bad(path, None, f"cannot be read ({e.strerror}); pass a log or golden-values file") from None


def detect(path: Path) -> str:
    """The format of a file, from its content; bad input when it is in none of FORMATS."""
    return detect_head(path, read_head(path))[0]


def detect_head(path: Path, text: str) -> tuple[str, object]:
    """The format of a file whose first HEAD_BYTES are `text`, and its parsed JSON (None for a
    log); bad input when it is in none of FORMATS."""
    if text.lstrip().startswith("{"):
        data = _json(path)
        for name, reader in JSON_READERS.items():
            if reader.detect_json(data):
                return name, data
    else:
        # Bridge logs carry Megatron's iteration lines too, so Bridge's own lines are looked for first.
        for name in (bridge_log.FORMAT, megatron_log.FORMAT, torchtitan_log.FORMAT):
            if LOG_READERS[name].detect(text):
                return name, None
    raise bad(path, None, f"is in no known format (none of {', '.join(FORMATS)}); pass a Megatron-LM or Megatron "
                          "Bridge training log, a torchtitan log or a golden-values JSON, or name the format with --format")


def read(path: Path, fmt: str | None = None, data=None) -> ParsedRun:
    """Read one file with the reader of `fmt` (detected when None); `data`: a JSON file's content,
    where it is already parsed."""
    path = Path(path)
    if not path.is_file():
        raise bad(path, None, "does not exist; pass the path of a log or golden-values file")
    if fmt is None:
        fmt, data = detect_head(path, read_head(path))
    if fmt in JSON_READERS:
        return JSON_READERS[fmt].read(path, _json(path) if data is None else data)
    if fmt in LOG_READERS:
        return LOG_READERS[fmt].read(path)
    raise bad(path, None, f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
