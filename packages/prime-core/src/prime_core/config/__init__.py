"""Config loading (CLI > TOML > env > defaults) and every config schema."""

from prime_core.config.base import BaseConfig
from prime_core.config.cli import config_to_toml, format_help, parse_cli, write_config
from prime_core.config.loader import ConfigError, load_config

__all__ = ["BaseConfig", "ConfigError", "config_to_toml", "format_help", "load_config", "parse_cli", "write_config"]
