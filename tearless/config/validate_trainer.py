"""Checks of the ``trainer`` section's run keys: resuming, the device and the loggers."""

from __future__ import annotations

import difflib
import importlib.util
import sys

from tearless.config.errors import DEVICES, RESUME_MODES, fail, one_of
from tearless.config.schema import Config, all_keys
from tearless.run.tracking import LOGGERS


def validate_resume(cfg: Config) -> None:
    """Raise ``ConfigError`` for an unknown resume mode, a key in ``resume_allow_changes`` that the config
    does not have, or ``resume_mode=resume_path`` without the path."""
    t = cfg.trainer
    one_of("trainer.resume_mode", t.resume_mode, RESUME_MODES)
    known = {key for key, _ in all_keys()}
    for key in t.resume_allow_changes:
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            fail(
                "trainer.resume_allow_changes",
                f"lists {key!r}, which is not a config key",
                f"Did you mean {close[0]}?"
                if close
                else "List full dotted keys, as `tearless config show` prints them.",
            )
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        fail(
            "trainer.resume_from_path",
            "resume_mode=resume_path needs a path",
            "Set trainer.resume_from_path=<run dir>/global_step_N.",
        )


def validate_device_and_loggers(cfg: Config) -> None:
    """Raise ``ConfigError`` for an unknown device or logger, or a logger whose package is missing (it is
    refused before any model loads; veRL scripts ask for wandb)."""
    one_of("trainer.device", cfg.trainer.device, DEVICES)
    loggers = cfg.trainer.logger
    for name in loggers:
        one_of("trainer.logger", name, LOGGERS)
    for name, package in (("wandb", "wandb"), ("tensorboard", "tensorboard"), ("mlflow", "mlflow")):
        # A module already imported (or put in sys.modules) counts as installed.
        if name in loggers and package not in sys.modules and importlib.util.find_spec(package) is None:
            fail(
                "trainer.logger",
                f"{name} is not installed",
                f"pip install 'tearless[logging]' (or {package}), or drop {name} from the list "
                "(metrics.jsonl is always written)",
            )
