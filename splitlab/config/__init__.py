"""Config schemas (schema.py), enums (enums.py) and cross-field validation (validate.py).

Nothing here imports hydra or omegaconf; cli.py composes and converts once.
"""

from splitlab.config.schema import Config
from splitlab.config.validate import validate_config

__all__ = ["Config", "validate_config"]
