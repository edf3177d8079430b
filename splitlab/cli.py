"""The `splitlab` entry point: compose conf/ with Hydra, convert once, validate, dispatch.

    splitlab                        # the main job (task=finetune on embedded defaults)
    splitlab --cfg job              # print the composed config
    splitlab task=infer             # a local 3-stage SmolLM2 ring
    splitlab -m finetune.sft.rank=1,8,32   # a Hydra multirun sweep
    splitlab transport.prot=1       # a config error: one line naming the key, exit 2
    splitlab --help                 # every config group and option, one line each

This and `splitlab.config` are the only modules that import hydra; below them every function
takes dataclasses.

Hydra reports its own compose errors (bad key, unknown option, wrong type) and exits 1; `main`
runs Hydra with HYDRA_FULL_ERROR=1 so those errors reach it as exceptions instead, and turns
each into one line and exit 2 (`ExitCode.CONFIG`). The task function puts the user's own
HYDRA_FULL_ERROR back while a job runs, so a job's failures and its children are unchanged.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from splitlab.config.help import render_groups
from splitlab.config.load import (
    CONF_DIR,
    check_known_keys,
    closest_first,
    register_configs,
    to_config,
    unknown_key_line,
)
from splitlab.config.schema import Config
from splitlab.configure import validate
from splitlab.errors import ConfigError, ExitCode, SplitlabError, as_storage_error
from splitlab.telemetry.log import leave, setup_logging

# task name -> "module:function" taking (cfg: Config) and returning an exit code.
TASKS: dict[str, str] = {
    "finetune": "splitlab.launch.train:run_finetune",
    "infer": "splitlab.launch.ring:run_infer",
    "calibrate": "splitlab.measure.calibrate:run_calibrate",
    "analyze": "splitlab.analysis.report:run_analyze",
    "sft_rank": "splitlab.sft.study:run_sft_rank",
}

log = logging.getLogger("splitlab.cli")


def register_task(name: str, target: str) -> None:
    """Register the runner of `task=<name>` as "package.module:function" (imported lazily)."""
    TASKS[name] = target


def register_resolvers() -> None:
    """`${splitlab.num_processes:}` and `${splitlab.num_gpus:DEVICE}` for launcher presets
    (conf/hydra/launcher/slurm.yaml): a job's resources from its own config; and
    `${splitlab.config_help:}` for the --help page (conf/hydra/help/splitlab.yaml). Idempotent."""
    from splitlab.cluster.resources import num_gpus, num_processes

    def processes(*, _root_: DictConfig) -> int:
        task = _root_.task.name  # a TaskName member
        return num_processes(OmegaConf.to_object(_root_.architecture), getattr(task, "value", task))

    OmegaConf.register_new_resolver("splitlab.num_processes", processes, replace=True)
    OmegaConf.register_new_resolver("splitlab.config_help", lambda: render_groups(CONF_DIR),
                                    replace=True)  # fmt: skip
    OmegaConf.register_new_resolver("splitlab.num_gpus", lambda device: num_gpus(str(device)),
                                    replace=True)  # fmt: skip


def resolve_task(name: str) -> Callable[[Config], int]:
    target = TASKS.get(name)
    if target is None:
        raise ConfigError(f"task={name} has no runner in this build (registered: {sorted(TASKS)})")
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


PREFLIGHT_TASKS = frozenset({"finetune", "infer"})  # tasks that start node processes


def run(cfg: Config) -> int:
    """Validate and run one composed config; returns the process exit code. A task that starts
    nodes is preflighted before its launcher is imported: the launcher's import (torch,
    transformers) took 49 s at load 12, the checks themselves well under a second. Its runner
    is then told so, and does not check (and read the data file) a second time."""
    validate(cfg)
    name = cfg.task.name.value
    if name in PREFLIGHT_TASKS:
        from splitlab.preflight import preflight

        preflight(cfg)
        return int(resolve_task(name)(cfg, preflighted=True))
    return int(resolve_task(name)(cfg))


register_configs()
register_resolvers()


_FULL_ERROR = "HYDRA_FULL_ERROR"
_USER_FULL_ERROR = os.environ.get(_FULL_ERROR)


def _set_full_error(value: str | None) -> None:
    if value is None:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = value


@contextmanager
def _hydra_raises() -> Iterator[None]:
    """Make Hydra re-raise its errors (instead of printing them and exiting 1) while inside."""
    _set_full_error("1")
    try:
        yield
    finally:
        _set_full_error(_USER_FULL_ERROR)


@contextmanager
def _user_error_policy() -> Iterator[None]:
    """Inside a job: the user's own HYDRA_FULL_ERROR (also what child processes inherit).
    Left so when the job raises, so that Hydra reports a job's own failure as it always has."""
    _set_full_error(_USER_FULL_ERROR)
    yield
    _set_full_error("1")  # the next multirun job's compose errors reach `main` again


def describe_compose_error(exc: Exception) -> str:
    """One line for a Hydra/OmegaConf compose error: the key (or override) and what is wrong;
    for an unknown option, the group's known options; for an unknown key, the known keys."""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        # Hydra leaves `options` empty for a list selection (logger=[csv,nope]): read conf/
        options = exc.options or sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        known = ", ".join(closest_first(option, options)) or "none"
        if group:
            return (f"{group}={option}: no config '{exc.missing_cfg_file}'; "
                    f"known options of {group}: {known}")  # fmt: skip
        return f"no config '{exc.missing_cfg_file}'"
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        schema = getattr(cause, "object_type", None)
        unknown_key = isinstance(cause, (ConfigKeyError, ConfigAttributeError))
        if unknown_key and dataclasses.is_dataclass(schema):
            return unknown_key_line(cause.full_key, [f.name for f in dataclasses.fields(schema)])
        reason = str(getattr(cause, "msg", "") or cause).splitlines()[0]
        return f"{cause.full_key}: {reason}"
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the override {exc.override!r}: {exc.message.splitlines()[0]}"
    # Hydra's own text, minus its "+key=value" hint (appending a key a schema lacks cannot work).
    hint = "To append to your config"
    lines = [ln for ln in str(exc).splitlines() if ln.strip() and hint not in ln]
    return "; ".join(ln.strip() for ln in lines[:2]) or type(exc).__name__


class _Refused(BaseException):
    """A config error raised inside a Hydra callback; a BaseException, because Hydra turns any
    Exception a callback raises into a warning and carries on."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(str(error))
        self.error = error


class KnownKeys(Callback):
    """Refuses a key no schema declares (`+transport.prot=1`) once Hydra has composed the
    config and before it creates the run folder (conf/config.yaml registers it). A multirun's
    jobs compose one by one; `to_config` checks each of them the same way."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        try:
            check_known_keys(config, ignore=("hydra",))
        except ConfigError as exc:
            raise _Refused(exc) from exc


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(dcfg: DictConfig) -> int:
    with _user_error_policy():
        return _run_job(dcfg)


def _run_job(dcfg: DictConfig) -> int:
    setup_logging("cli", 0)
    try:
        cfg = to_config(dcfg)
        cfg.run_dir = HydraConfig.get().runtime.output_dir
        code = run(cfg)
    except SplitlabError as exc:
        log.error("%s", exc)
        code = int(exc.exit_code)
    except OSError as exc:  # the launcher's own writes: config.yaml, metrics, plots, report
        storage = as_storage_error(exc, f"the run folder {HydraConfig.get().runtime.output_dir}")
        if storage is None:
            raise
        log.error("%s", storage)
        code = int(storage.exit_code)
    except KeyboardInterrupt:
        log.error("interrupted")
        code = 130
    if code != ExitCode.OK:
        # Hydra swallows return values; a non-zero exit must leave the process as one.
        sys.exit(code)
    return code


def main() -> None:
    """Console-script entry point (`splitlab`): a compose error is one line and exit 2."""
    try:
        with _hydra_raises():
            _hydra_main()
    except _Refused as refused:
        sys.stderr.write(f"config error: {refused.error}\n")
        sys.exit(ExitCode.CONFIG)
    except (CompactHydraException, OmegaConfBaseException) as exc:
        if _USER_FULL_ERROR:  # the user asked for Hydra's full trace
            raise
        sys.stderr.write(f"config error: {describe_compose_error(exc)}\n")
        sys.exit(ExitCode.CONFIG)
    except AssertionError as exc:
        # OmegaConf asserts (instead of raising) when an override sets a key under a None
        # node: a key of a logger the run did not select (logger.tensorboard.dir=x alone).
        if _USER_FULL_ERROR or "Unexpected type for root" not in str(exc):
            raise
        keys = [arg.partition("=")[0] for arg in sys.argv[1:] if arg.startswith("logger.")]
        sys.stderr.write(
            f"config error: {', '.join(keys) or 'an override'}: sets a key of a logger that is "
            "not selected; select it too, e.g. logger=[csv,tensorboard] logger.tensorboard.dir=tb\n"
        )
        sys.exit(ExitCode.CONFIG)


def console_main() -> NoReturn:
    """The `splitlab` console script and `python -m splitlab`: `main`, then leave with its code
    at once (`exit_now`), as nodes do. A launcher that loaded torch and transformers (a final
    evaluation) spent 1-4 s finalising their modules after its last line, and a fault's
    diagnosis waited on that exit. A job that left a non-daemon thread running exits the
    normal way, which waits for it. `main` itself raises SystemExit (tests call it in-process).
    """
    code = 0
    try:
        main()
    except SystemExit as exc:
        if isinstance(exc.code, str):  # what Python itself does with a message: say it, exit 1
            sys.stderr.write(exc.code + "\n")
            code = 1
        else:
            code = exc.code or 0
    leave(code)


if __name__ == "__main__":
    console_main()
