"""The package's layers, read from its import statements (every one, function bodies included).

Fails on a cycle between subpackages of ``splitlab`` (a subpackage is the first component under
``splitlab/``; a top-level module counts as its own), on hydra/omegaconf imported outside
``splitlab/cli.py`` and ``splitlab/config/``, on ``splitlab.cli`` imported by the library (only
``splitlab/__main__.py`` may), and on ``splitlab/analysis/`` importing ``splitlab.wire``,
``splitlab.launch`` or ``subprocess`` (analysis reads files only), and on production code
importing the oracles of ``splitlab/reference/`` (tests and tools use them); and, in a fresh
process, on torch or transformers loaded by the config path (``import splitlab.cli``, composing
and validating a config, the CLI's refusals): a config error must not pay for a model import;
and on transformers loaded by what a model-free process runs (node entry, echo stage runtime).

    pytest tests/unit/test_layering.py -q
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "splitlab"
CONFIG_LAYER = ("splitlab.cli", "splitlab.config")
ANALYSIS_FORBIDDEN = ("splitlab.wire", "splitlab.launch", "subprocess")
REFERENCE = ("splitlab.reference",)
HEAVY = ("torch", "transformers")  # what only a computing process may import


@dataclass(frozen=True, kw_only=True)
class Import:
    """One imported module name, where it is imported and on which line."""

    importer: str  # dotted module name of the importing file
    path: str  # file, relative to the repository
    line: int
    target: str  # dotted module name imported (``from a import b`` gives ``a.b`` when a.b exists)

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.importer} -> {self.target}"


def module_name(path: Path) -> str:
    """``splitlab/train/owner.py`` -> ``splitlab.train.owner``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    root = PACKAGE_DIR.parent
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_in(source: str, *, importer: str, path: str, is_package: bool) -> Iterator[Import]:
    """Every module a source text imports, at any depth of its syntax tree."""
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(importer=importer, path=path, line=node.lineno, target=alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(importer, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if base.startswith("splitlab") and _is_module(sub) else base
                yield Import(importer=importer, path=path, line=node.lineno, target=target)


def imports_of(path: Path) -> Iterator[Import]:
    rel = str(path.relative_to(PACKAGE_DIR.parent))
    return imports_in(
        path.read_text(),
        importer=module_name(path),
        path=rel,
        is_package=path.name == "__init__.py",
    )


def all_imports() -> list[Import]:
    """Every import in the package, one per (file, line, target)."""
    found = {imp: None for path in sorted(PACKAGE_DIR.rglob("*.py")) for imp in imports_of(path)}
    return list(found)


def layer(dotted: str) -> str | None:
    """The subpackage (first component under splitlab) a module belongs to; None outside splitlab."""
    parts = dotted.split(".")
    if parts[0] != "splitlab" or len(parts) < 2:
        return None
    return parts[1]


def _within(dotted: str, prefixes: tuple[str, ...]) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in prefixes)


def layer_edges(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    edges: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        src, dst = layer(imp.importer), layer(imp.target)
        if src and dst and src != dst:
            edges.setdefault((src, dst), []).append(imp)
    return edges


def strongly_connected(nodes: set[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's components with more than one member, each sorted."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        succ[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for n in sorted(nodes):
        if n not in index:
            visit(n)
    return found


def test_strongly_connected_finds_a_cycle_and_ignores_a_chain() -> None:
    nodes = {"a", "b", "c", "d"}
    assert strongly_connected(nodes, {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [
        ["a", "b", "c"]
    ]
    assert strongly_connected(nodes, {("a", "b"), ("b", "c"), ("c", "d")}) == []


def test_function_level_and_relative_imports_are_seen() -> None:
    source = "def f():\n    from splitlab.cli import main\n    from ..wire import tcp\n"
    found = imports_in(source, importer="splitlab.analysis.x", path="x.py", is_package=False)
    assert [imp.target for imp in found] == ["splitlab.cli", "splitlab.wire.tcp"]
    assert layer("splitlab.wire.tcp") == "wire" and layer("splitlab.cli") == "cli"


def test_no_cycle_between_subpackages() -> None:
    edges = layer_edges(all_imports())
    nodes = {n for edge in edges for n in edge}
    cycles = strongly_connected(nodes, set(edges))
    report = []
    for comp in cycles:
        members = set(comp)
        report.append(f"cycle among {comp}:")
        for (a, b), imps in sorted(edges.items()):
            if a in members and b in members:
                report.extend(f"  {a} -> {b}: {imp}" for imp in imps)
    assert not cycles, "\n".join(report)


def test_hydra_and_omegaconf_only_in_cli_and_config() -> None:
    bad = [
        imp
        for imp in all_imports()
        if _within(imp.target, ("hydra", "omegaconf")) and not _within(imp.importer, CONFIG_LAYER)
    ]
    assert not bad, "hydra/omegaconf outside cli.py and config/:\n" + "\n".join(map(str, bad))


def test_library_never_imports_cli() -> None:
    bad = [
        imp
        for imp in all_imports()
        if _within(imp.target, ("splitlab.cli",))
        and imp.importer not in ("splitlab.__main__", "splitlab.cli")
    ]
    assert not bad, "library imports splitlab.cli:\n" + "\n".join(map(str, bad))


def test_analysis_reads_files_only() -> None:
    bad = [
        imp
        for imp in all_imports()
        if _within(imp.importer, ("splitlab.analysis",)) and _within(imp.target, ANALYSIS_FORBIDDEN)
    ]
    assert not bad, "analysis imports wire/launch/subprocess:\n" + "\n".join(map(str, bad))


def test_production_never_imports_the_reference_engines() -> None:
    bad = [
        imp
        for imp in all_imports()
        if _within(imp.target, REFERENCE) and not _within(imp.importer, REFERENCE)
    ]
    assert not bad, "production imports splitlab.reference:\n" + "\n".join(map(str, bad))


# Run in a fresh interpreter: what this test process imported itself must not count.
CONFIG_PATH_SCRIPT = """
import sys
from splitlab.cli import main
from splitlab.configure import compose_config, validate
from splitlab.errors import ConfigError

run_dir = sys.argv[1]
validate(compose_config())
validate(compose_config(["task=infer"]))
for overrides in (["transport=inproc"], ["task=infer", "control=rabbitmq"],
                  ["model.family=t5"], ["task=infer", "model=tiny_bert"]):
    try:
        validate(compose_config(overrides))
    except ConfigError:
        pass
    else:
        raise SystemExit(f"{overrides} was not refused")
for argv in (["transport.prot=1"], ["task=infer", "transport=rabbitmq"]):
    sys.argv = ["splitlab", *argv, f"hydra.run.dir={run_dir}"]
    try:
        main()
    except SystemExit as exc:
        assert exc.code == 2, (argv, exc.code)
    else:
        raise SystemExit(f"{argv} was not refused")
"""


def loaded_after(script: str, *args: str) -> set[str]:
    """Top-level module names in `sys.modules` once `script` has run in a fresh interpreter."""
    root = PACKAGE_DIR.parent
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    report = 'print("loaded:", " ".join(sorted({name.split(".")[0] for name in sys.modules})))'
    result = subprocess.run(
        [sys.executable, "-c", f"{script}\nimport sys\n{report}", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = set(result.stdout.rpartition("loaded: ")[2].split())
    assert "splitlab" in loaded, result.stdout[-2000:]
    return loaded


def test_config_path_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    heavy = sorted(set(HEAVY) & loaded_after(CONFIG_PATH_SCRIPT, str(tmp_path)))
    assert not heavy, (
        f"the config path imported {heavy}; find the chain with "
        "`python -X importtime -c 'import splitlab.cli'`"
    )


def test_model_free_processes_do_not_import_transformers() -> None:
    # The node entry (embedded bus host) and the stage runtime an echo stage runs.
    loaded = loaded_after("import splitlab.node, splitlab.infer.stage, splitlab.launch.ring")
    assert "transformers" not in loaded, (
        "find the chain with `python -X importtime -c 'import splitlab.infer.stage'`"
    )
