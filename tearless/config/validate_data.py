"""Checks of the ``data`` section's files and how prompts past ``max_prompt_length`` are cut."""

from __future__ import annotations

from tearless.config.errors import fail, one_of
from tearless.config.schema import Config


def validate_truncation(cfg: Config) -> None:
    """Raise ``ConfigError`` for a truncation mode the prompt datasets do not have."""
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.data import TRUNCATION_MODES

    one_of("data.truncation", cfg.data.truncation, list(TRUNCATION_MODES))


def validate_data_files(cfg: Config) -> None:
    """Raise ``ConfigError`` when only one of the train and validation files is given."""
    data = cfg.data
    if (data.train_files is None) != (data.val_files is None):
        fail(
            "data.val_files" if data.val_files is None else "data.train_files",
            "train and validation files must both be given or both be null (the embedded task)",
            "Give both data.train_files and data.val_files.",
        )
