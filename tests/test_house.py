"""The house rules that code can check: no module of the package over 600 lines (STYLE.md)."""

from pathlib import Path

import recompute_bench

LIMIT = 600


def test_no_module_over_600_lines():
    root = Path(recompute_bench.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 50  # the whole package was read
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them along a seam): {over}"
