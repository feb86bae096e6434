"""DeepSpeed-style JSON configuration, with DeepSpeed's key names and defaults.

    cfg = DeepSpeedConfig.from_file("ds_zeropp_config.json")
    cfg.zero_optimization.stage, cfg.fp16.enabled, ...

Every key is checked: an unknown one is an error that names it and suggests
the closest known key; sizes may be written `5e8`; keys DeepSpeed has but we
do not implement are refused by name rather than silently ignored.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    pass


@dataclass
class ZeroConfig:
    stage: int = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    # DeepSpeed turns overlap_comm on by default for stage 3 only; None = that default.
    overlap_comm: bool | None = None
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    zero_hpz_partition_size: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    # Accepted for compatibility with existing configs; they change nothing here.
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    sub_group_size: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    ignore_unused_parameters: bool = True

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def validate(self, where: str = "zero_optimization"):
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"{where}.stage is {self.stage}; ZeRO stages are 0, 1, 2 and 3")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_max_live_parameters", "sub_group_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be a positive number of elements "
                                  f"(e.g. 5e8), got {getattr(self, name)}")
        for name in ("stage3_param_persistence_threshold", "stage3_max_reuse_distance"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name} must be >= 0, got {getattr(self, name)}")
        if self.zero_hpz_partition_size < 1:
            raise ConfigError(f"{where}.zero_hpz_partition_size must be >= 1 "
                              f"(1 turns hpZ off), got {self.zero_hpz_partition_size}")
        zpp = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if getattr(self, k)]
        if self.zero_hpz_partition_size > 1:
            zpp.append("zero_hpz_partition_size")
        if zpp and self.stage != 3:
            raise ConfigError(f"{where}: {', '.join(zpp)} (ZeRO++) need stage 3, "
                              f"but stage is {self.stage}")

    def validate_topology(self, ranks_per_node: int, world_size: int):
        """Checks that need the job's shape (called when the engine starts)."""
        h = self.zero_hpz_partition_size
        if h > 1 and (ranks_per_node % h or h > world_size):
            raise ConfigError(
                f"zero_hpz_partition_size (--zero-hpz-size) {h} must divide the ranks per node "
                f"({ranks_per_node}): the secondary partition lives inside one node. "
                f"Use a divisor of {ranks_per_node}, ideally {ranks_per_node} itself")


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0          # 0 = dynamic loss scaling
    initial_scale_power: int = 16    # dynamic scaling starts at 2**initial_scale_power
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    auto_cast: bool = False


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class OptimizerConfig:
    type: str = "AdamW"
    params: dict = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    type: str = ""
    params: dict = field(default_factory=dict)


@dataclass
class DeepSpeedConfig:
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    # Accepted for compatibility with existing configs; they change nothing here.
    zero_allow_untested_optimizer: bool = False
    prescale_gradients: bool = False
    activation_checkpointing: dict = field(default_factory=dict)

    @classmethod
    def from_file(cls, path: str) -> "DeepSpeedConfig":
        return cls.from_dict(load_json(path), where=path)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "DeepSpeedConfig":
        cfg = _build(cls, raw, where)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "config"):
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(f"{where}: fp16 and bf16 are both enabled; pick one")
        if self.gradient_clipping < 0:
            raise ConfigError(f"{where}: gradient_clipping must be >= 0")
        self.zero_optimization.validate(f"{where}: zero_optimization")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed_config: no such file {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON: {e}") from None


# Keys DeepSpeed knows that this product does not implement: refuse them by name.
_UNSUPPORTED = {
    "offload_optimizer": "optimizer offload to CPU/NVMe is not implemented",
    "offload_param": "parameter offload to CPU/NVMe is not implemented",
    "cpu_offload": "optimizer offload to CPU is not implemented",
    "mics_shard_size": "MiCS sharding is not implemented; use zero_hpz_partition_size (hpZ)",
    "pipeline": "pipeline parallelism is not implemented",
    "amp": "apex AMP is not supported; use fp16 or bf16",
}


def _build(cls, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key in _UNSUPPORTED:
            raise ConfigError(f"{where}.{key}: {_UNSUPPORTED[key]}; remove the key")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"{where}: unknown key '{key}'{hint}")
        kwargs[key] = _coerce(fields[key], value, f"{where}.{key}")
    return cls(**kwargs)


def _coerce(f: dataclasses.Field, value: Any, where: str):
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if value is None and "None" in typ:
        return None
    for nested in (ZeroConfig, FP16Config, BF16Config, OptimizerConfig, SchedulerConfig):
        if typ.startswith(nested.__name__):
            return _build(nested, value, where)
    if typ.startswith("bool"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if typ.startswith("int"):
        return parse_int(value, where)
    if typ.startswith("float"):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if typ.startswith("str"):
        return str(value)
    if typ.startswith("dict"):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a JSON object")
        return value
    return value


def parse_int(value: Any, where: str) -> int:
    """Integers, also written as 5e8, 5E8 or "5e8"."""
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if number != int(number):
        raise ConfigError(f"{where} must be a whole number, got {value!r}")
    return int(number)
