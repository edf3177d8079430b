"""The logger options, what each imports, and the pre-spawn check that it is installed.

Light on purpose: the launcher's preflight imports it, so it looks modules up with
`importlib.util.find_spec` and never imports a logger library itself.

    splitlab logger=[tensorboard]     # exit 2 naming the pip extra when tensorboard is missing
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from splitlab.config.schema import LoggerConfig, MlflowLoggerConfig
from splitlab.errors import ConfigError

EXTRA = "loggers"  # pyproject's optional dependencies that install every logger library

# option -> the top-level modules its writer imports
REQUIRES: dict[str, tuple[str, ...]] = {
    "csv": (),
    "tensorboard": ("tensorboard",),
    "mlflow": ("mlflow",),
}
SQL_MODULES = ("sqlalchemy", "alembic")  # MLflow's SQLite tracking store (the default store)


def selected(loggers: LoggerConfig) -> dict[str, Any]:
    """option name -> its config, for every option the run selected, in LoggerConfig order."""
    return {
        f.name: getattr(loggers, f.name)
        for f in dataclasses.fields(loggers)
        if getattr(loggers, f.name) is not None
    }


def required_modules(name: str, options: Any) -> tuple[str, ...]:
    modules = REQUIRES[name]
    if isinstance(options, MlflowLoggerConfig) and (
        options.tracking_uri is None or options.tracking_uri.startswith("sqlite:")
    ):
        modules += SQL_MODULES
    return modules


def check_loggers(loggers: LoggerConfig) -> None:
    """Every selected logger's library is installed.

    Raises:
        ConfigError: naming the logger, the missing module and the pip extra to install.
    """
    for name, options in selected(loggers).items():
        modules = required_modules(name, options)
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"logger={name}: {', '.join(missing)} is not installed; "
                f"pip install 'splitlab[{EXTRA}]' (or drop {name} from logger=[...])"
            )
