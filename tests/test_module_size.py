"""Small modules with one job: no module of the package, the router or the engines is over 400
lines (issue 12; scripts under ``scripts/`` and the tests are not held to it)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dynamo_zmq", "router", "engines")
MAX_LINES = 400


def test_no_module_is_over_400_lines() -> None:
    files = sorted(f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py"))
    assert files, f"no modules found under {ROOT}"
    sizes = {f.relative_to(ROOT).as_posix(): len(f.read_bytes().splitlines()) for f in files}
    offenders = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not offenders, (
        f"modules over {MAX_LINES} lines (split each into modules with one job): "
        + ", ".join(f"{path} ({n})" for path, n in sorted(offenders.items()))
    )
