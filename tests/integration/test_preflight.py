"""Pre-spawn checks exit 2 within seconds, before any node process starts; a local model folder
under any preset brings its own layer count.

    pytest tests/integration/test_preflight.py -q
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from model_helpers import tiny_config

from splitlab.config.load import load_resolved_config
from splitlab.configure import compose_config
from splitlab.errors import ExitCode
from splitlab.launch.ring import run_infer
from splitlab.models.families import get_family
from splitlab.models.plan import even_cuts
from splitlab.preflight import check_data


def save_folder(folder: Path, family: str, *, num_layers: int, vocab_size: int = 96) -> Path:
    """A random tiny model of `family` saved as a transformers folder (no tokenizer)."""
    adapter = get_family(family)
    cfg = dataclasses.replace(tiny_config(family, num_layers=num_layers), vocab_size=vocab_size)
    config = adapter.make_config(cfg)
    adapter.model_class(config)(config).save_pretrained(folder)
    return folder


def _data_missing(tmp: Path) -> tuple[list[str], list[str]]:
    return ["data.source=file", "data.path=/nonexistent"], ["data.path='/nonexistent'"]


def _data_column(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "reviews.csv"
    path.write_text("sentence,label\ngood,1\nbad,0\n")
    return (["data.source=file", f"data.path={path}"],
            ["data.text_column='text'", "['sentence', 'label']"])  # fmt: skip


def _data_empty(tmp: Path) -> tuple[list[str], list[str]]:
    (tmp / "empty.csv").write_bytes(b"")
    return (["data.source=file", f"data.path={tmp / 'empty.csv'}"],
            [f"data.path='{tmp / 'empty.csv'}' is empty"])  # fmt: skip


def _data_not_utf8(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "latin1.csv"
    path.write_bytes(b"text,label\ngood,fresh\n" + b"caf\xe9 cr\xe8me,rotten\n" * 3)
    return (["data.source=file", f"data.path={path}"],
            [f"data.path='{path}' is not UTF-8 text", "0xe9"])  # fmt: skip


def _data_more_classes(tmp: Path) -> tuple[list[str], list[str]]:
    path = tmp / "three.csv"
    path.write_text("text,label\na,x\nb,y\nc,z\n")
    return (["data.source=file", f"data.path={path}", "data.labels=[]"],  # inferred; head of 2
            [f"data.path='{path}'", "3 classes", "model.num_labels=2"])  # fmt: skip


def _not_a_model(tmp: Path) -> tuple[list[str], list[str]]:
    (tmp / "empty").mkdir()
    return [f"model.id={tmp / 'empty'}"], ["model.id=", "not a model folder (no config.json)"]


def _cut_past_folder(tmp: Path) -> tuple[list[str], list[str]]:
    # The minilm preset says 6 blocks: cut_layers=4 fits it, but not this 3-block folder.
    folder = save_folder(tmp / "bert3", "bert", num_layers=3)
    return ([f"model.path={folder}", "architecture.cut_layers=4"],
            ["model.num_layers=3", "architecture.cut_layers=4"])  # fmt: skip


def _no_tokenizer(tmp: Path) -> tuple[list[str], list[str]]:
    folder = save_folder(tmp / "bert4", "bert", num_layers=4)  # no tokenizer saved
    return [f"model.path={folder}"], ["model.path=", "the folder has no tokenizer"]


def _tied_two_stage(tmp: Path) -> tuple[list[str], list[str]]:
    return (["architecture=two_stage", "model=tiny_gpt2", "data=gsm_symbolic"],
            ["architecture=two_stage", "tie_word_embeddings=true",
             "model.untie_embeddings=true"])  # fmt: skip


def _broker_down(tmp: Path) -> tuple[list[str], list[str]]:
    url = "amqp://guest:guest@127.0.0.1:1/%2F"
    return (["control=rabbitmq", "transport=rabbitmq", f"control.url={url}",
             f"transport.url={url}"], ["control.url=", "no broker at 127.0.0.1:1"])  # fmt: skip


CASES: dict[str, Callable[[Path], tuple[list[str], list[str]]]] = {
    "data-file-missing": _data_missing,
    "data-column-missing": _data_column,
    "data-file-empty": _data_empty,
    "data-file-not-utf8": _data_not_utf8,
    "data-more-classes-than-head": _data_more_classes,
    "not-a-model-folder": _not_a_model,
    "cut-past-folder-layers": _cut_past_folder,
    "folder-without-tokenizer": _no_tokenizer,
    "tied-two-stage": _tied_two_stage,
    "broker-unreachable": _broker_down,
}


def _cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _refused(overrides: list[str], named: list[str], tmp_path: Path) -> None:
    """`splitlab *overrides` exits 2 naming `named`, within 10 s of CPU, and starts no node.

    CPU seconds, not wall: on a shared 2-core box the wall clock measures the neighbours (the
    same refusal took 16 s of wall for 5.6 s of CPU at load 9)."""
    run_dir = tmp_path / "run"
    cpu_before = _cpu_s()
    done = subprocess.run(
        [sys.executable, "-m", "splitlab", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    cpu_s = _cpu_s() - cpu_before
    assert done.returncode == ExitCode.CONFIG, done.stderr[-2000:]
    assert cpu_s < 10.0, f"took {cpu_s:.1f} s of CPU"
    for text in named:
        assert text in done.stderr, done.stderr[-2000:]
    # No node started: nodes write RUN/logs and RUN/traces; the launcher saves config.yaml first
    for started in ("logs", "traces", "config.yaml"):
        assert not (run_dir / started).exists(), started


@pytest.mark.parametrize("case", sorted(CASES))
def test_prespawn_check_exits_2_before_any_node(case: str, tmp_path: Path) -> None:
    overrides, named = CASES[case](tmp_path)
    _refused(overrides, named, tmp_path)


def test_rows_with_blank_labels_are_said_once_with_their_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "reviews.csv"
    path.write_text("text,label\ngood,fresh\nmeh,\nbad,rotten\nok, \n")
    cfg = compose_config(["data.source=file", f"data.path={path}"])
    with caplog.at_level(logging.INFO, logger="splitlab"):
        check_data(cfg.data, cfg.model)
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert said == [f"data.path={str(path)!r}: dropped 2 of 4 rows with a blank text or label"]


def test_busy_data_port_exits_2_before_any_node(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        _refused([f"transport.port={port}"], [f"transport.port={port}", "cannot listen"],
                 tmp_path)  # fmt: skip


def test_local_folder_brings_its_own_layer_count(tmp_path: Path, capsys) -> None:
    # Prepare: 8 blocks where the tiny_llama preset says 4; its vocabulary fits the preset's
    # GPT-2 tokenizer (the folder has none of its own)
    folder = save_folder(tmp_path / "llama8", "llama", num_layers=8, vocab_size=50257)
    cfg = compose_config(["task=infer", "model=tiny_llama", f"model.id={folder}",
                          "task.max_new_tokens=4"])  # fmt: skip
    cfg.run_dir = str(tmp_path / "run")

    # Execute
    code = run_infer(cfg)

    # Assert: the resolved config records the folder's facts; the ring split its 8 blocks evenly
    assert code == 0
    saved = load_resolved_config(tmp_path / "run" / "config.yaml")
    assert saved.model.num_layers == 8
    assert saved.model.path == str(folder.resolve())
    assert saved.model.tie_word_embeddings is False
    assert saved.architecture.cuts == even_cuts(num_layers=8, stages=3)
    assert saved.architecture.cuts != even_cuts(num_layers=4, stages=3)
    assert capsys.readouterr().out.strip()


def test_check_equivalence_refuses_cuts_past_the_folder_before_the_reference(
    tmp_path: Path,
) -> None:
    # Prepare: 3 blocks; the tool's SmolLM2 preset says 30, where cuts [1,3] would fit
    folder = save_folder(tmp_path / "llama3", "llama", num_layers=3)
    tool = Path(__file__).resolve().parents[2] / "tools" / "check_equivalence.py"
    run_dir = tmp_path / "run"

    # Execute
    done = subprocess.run(
        [sys.executable, str(tool), f"model.path={folder}", "architecture.cuts=[1,3]",
         "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    # Assert: exit 2 naming the cut and the folder's count; no reference model was saved or run
    assert done.returncode == ExitCode.CONFIG, done.stderr[-2000:]
    assert "architecture.cuts[1]=3 out of range [1, 2] for model.num_layers=3" in done.stderr
    assert not run_dir.exists()


def test_check_equivalence_names_an_override_hydra_cannot_merge(tmp_path: Path) -> None:
    tool = Path(__file__).resolve().parents[2] / "tools" / "check_equivalence.py"
    done = subprocess.run(
        [sys.executable, str(tool), "model.dtype=float32", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == ExitCode.CONFIG, done.stderr[-2000:]
    assert "config error" in done.stderr and "model.dtype=float32" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("tool", "args", "named"),
    [("bench_adaptive", ["no_such_key=1"], "no_such_key=1"),
     ("bench_ring", ["no_such_key=1"], "no_such_key=1"),
     ("bench_ushape", ["--testbed", "no_such_testbed"], "testbed=no_such_testbed")],
)  # fmt: skip
def test_a_bench_names_a_bad_value_in_one_line(tool: str, args: list[str], named: str) -> None:
    """Every tool's SplitlabError (here Hydra refusing an override) is one line naming the
    tool, exit 2, not a traceback (`splitlab.errors.tool_exit`)."""
    path = Path(__file__).resolve().parents[2] / "tools" / f"{tool}.py"
    done = subprocess.run([sys.executable, str(path), *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == ExitCode.CONFIG, done.stderr[-2000:]
    assert done.stderr.startswith(f"{tool}: ") and named in done.stderr
    assert "Traceback" not in done.stderr
