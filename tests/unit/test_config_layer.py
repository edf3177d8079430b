"""Hydra and omegaconf stay in `splitlab.cli` and `splitlab.config`; no library module imports
`splitlab.cli` (only the package's `__main__` does, to run it).

    .venv/bin/pytest tests/unit/test_config_layer.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "splitlab"
CONFIG_LAYER = ("hydra", "omegaconf")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def library_files() -> list[Path]:
    """Every module outside `splitlab.config`."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "config"]


def test_only_cli_and_config_import_hydra_or_omegaconf() -> None:
    offenders = {}
    for path in library_files():
        if path == PACKAGE / "cli.py":
            continue
        found = sorted(m for m in imported_modules(path) if m.split(".")[0] in CONFIG_LAYER)
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}


def test_no_library_module_imports_the_cli() -> None:
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE) not in (Path("__main__.py"), Path("cli.py"))
        and any(m == "splitlab.cli" or m.startswith("splitlab.cli.") for m in imported_modules(p))
    ]
    assert offenders == []
