"""Typed job configuration: dataclasses, YAML loading with overrides, validation in one place."""

from llmtrain.config.errors import ConfigError
from llmtrain.config.loader import (
    dump,
    dump_yaml,
    from_dict,
    load,
    load_yaml,
    parse_override,
    to_dict,
    with_overrides,
)
from llmtrain.config.schema import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
)
from llmtrain.config.validate import resolve_dp, validate, validate_world

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "WandbConfig",
    "dump",
    "dump_yaml",
    "from_dict",
    "load",
    "load_yaml",
    "parse_override",
    "resolve_dp",
    "to_dict",
    "validate",
    "validate_world",
    "with_overrides",
]
