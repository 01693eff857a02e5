"""The JSON caches under `results/profiles/` (measured rates, measured recompute costs): a file
named after the device and a hash, read as JSON (None when absent, one line when unreadable),
written whole (through a temporary file), or measured and written when absent. Each reader keeps
its own schema check. Pure Python."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from recompute_bench.config.schema import BadInput


def cache_file(folder: Path, device_name: str, hashed: str, digits: int, prefix: str = "") -> Path:
    """<folder>/<prefix><device, lower case, runs of other characters as '-'>-<sha256 of `hashed`, `digits` long>.json."""
    digest = hashlib.sha256(hashed.encode()).hexdigest()[:digits]
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return Path(folder) / f"{prefix}{slug}-{digest}.json"


def read_json(path: Path, what: str) -> Any:
    """The JSON at `path`, or None when there is no file; BadInput naming `what` when it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BadInput(f"{what} {path} cannot be read ({e}); delete it to measure again") from None


def write_cached(path: Path, data: dict[str, Any]) -> None:
    """`data` written to `path` as indented JSON, whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def read_or_measure(path: Path, read: Callable[[Path], dict[str, Any] | None],
                    measure: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Path, bool]:
    """(what `read` finds at `path`, or what `measure` gives, then cached there; path; whether read)."""
    found = read(path)
    if found is not None:
        return found, path, True
    data = measure()
    write_cached(path, data)
    return data, path, False
