"""Config schema (veRL key names), loading with dotted overrides, and validation."""

from tearless.config.load import ConfigError, describe, load_config, preset_path, presets, to_dict, to_yaml
from tearless.config.schema import Config

__all__ = ["Config", "ConfigError", "describe", "load_config", "preset_path", "presets", "to_dict", "to_yaml"]
