"""Config schema, loading and the resolved parallel plan."""

from longctx_cli.config.load import config_from_dict, load_config
from longctx_cli.config.schema import Config, DatasetConfig

__all__ = ["Config", "DatasetConfig", "config_from_dict", "load_config"]
