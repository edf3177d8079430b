"""The `splitlab --help` page: every config group and option of conf/, one line each.

    splitlab --help

An option's line is the parenthesised text that ends the first command line of its YAML
(`# splitlab transport=tcp   (direct TCP data plane ...)`), so the help and the file that it
describes cannot drift apart; a group's line is `GROUP_HELP` below. Groups under `schema/` are
internal (the dataclass schemas that options extend) and never listed. Pure: reads conf/ only.
"""

from __future__ import annotations

from pathlib import Path

# group (its folder under conf/) -> what choosing an option of it decides
GROUP_HELP: dict[str, str] = {
    "task": "what the run does: fine-tune, infer on a ring, calibrate cost models, analyze a run, the SFT rank study",
    "model": "the transformers model to split: packaged, random-init tiny, or a hub id/folder",
    "architecture": "how the model is split across processes: U-shape, two-stage or ring",
    "transport": "the data plane that carries activations and gradients between processes",
    "control": "the control bus for windows, barriers and round ends",
    "finetune": "what is trained and how: LoRA, full, or a low-rank (SFT) cut",
    "data": "the dataset and how it is split across owners",
    "drift": "slowdowns injected into (or observed on) devices and links",
    "planner": "when and how the ring moves blocks between stages",
    "testbed": "emulated hosts and shaped links on this machine (network namespaces, as root)",
    "logger": "where metrics and the resolved config go; several at once: logger=[csv,mlflow]",
    "experiment": "presets that reproduce one table or figure (splitlab experiment=NAME)",
    "sweep": "multirun grids (splitlab -m +sweep=NAME)",
    "hydra/launcher": "where multirun jobs run (splitlab -m hydra/launcher=NAME)",
    "hydra/help": "the text of this page",
}

INTERNAL_PREFIX = "schema/"


def option_help(yaml_text: str) -> str:
    """The one-liner of an option: the "(...)" ending its first comment line that is not a
    `# @package` directive; "" when that line has none."""
    for raw in yaml_text.splitlines():
        line = raw.strip()
        if not line.startswith("#") or line.lstrip("# ").startswith("@package"):
            continue
        if not line.endswith(")"):
            return ""
        depth = 0
        for i in range(len(line) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(line[i], 0)
            if depth == 0:
                return line[i + 1 : -1].strip()
        return ""
    return ""


def config_groups(conf_dir: Path) -> dict[str, dict[str, str]]:
    """group -> option -> one-liner, for every group folder of `conf_dir` (schema/ excluded)."""
    groups: dict[str, dict[str, str]] = {}
    for path in sorted(conf_dir.rglob("*.yaml")):
        group = path.parent.relative_to(conf_dir).as_posix()
        if group == "." or group.startswith(INTERNAL_PREFIX):
            continue
        groups.setdefault(group, {})[path.stem] = option_help(path.read_text())
    return groups


def render_groups(conf_dir: Path) -> str:
    """The groups section of the help page: a line per group, then a line per option."""
    lines: list[str] = []
    for group, options in config_groups(conf_dir).items():
        lines.append(f"{group}: {GROUP_HELP.get(group, '')}")
        width = max(len(name) for name in options)
        for name, text in options.items():
            lines.append(f"    {name:<{width}}  {text}")
    # string.Template substitutes the page afterwards: a literal "$" must be doubled.
    return "\n".join(lines).replace("$", "$$")
