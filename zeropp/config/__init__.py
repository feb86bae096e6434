"""DeepSpeed-style JSON configuration, with DeepSpeed's key names and defaults.

    cfg = DeepSpeedConfig.from_file("ds_zeropp_config.json")
    cfg.zero_optimization.stage, cfg.fp16.enabled, ...

Config honesty: every key does what DeepSpeed documents, or it is refused with
a ConfigError that names it and says what to do instead.
- Keys DeepSpeed has but this engine does not implement say "not supported"
  (the list is zeropp/config/keys.py). The value that means "off" (`"sparse_gradients": false`, a section with
  `"enabled": false`) is accepted: it asks for what happens anyway.
- Keys that choose between DeepSpeed implementations (contiguous_gradients,
  reduce_scatter, ...) accept only the value that describes this engine.
- Unknown keys (typos) are errors with a "did you mean" hint.
Sizes may be written `5e8`. Optimizer and scheduler sections are checked here;
the schedule formulas live in training/lr_schedule.py. `zero_optimization` is ZeRO's
keys and each technique's, composed (zeropp/config/zero.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from common import ConfigError, Problems, parse_int, parse_number, refuse_value
from zeropp.config.keys import BUCKET_DEFAULTS, UNSUPPORTED
from zeropp.config.monitor import ActivationCheckpointingConfig, TensorBoardConfig
from zeropp.config.optim import OptimizerConfig, OptimizerSettings, SchedulerConfig
from zeropp.config.precision import BF16Config, DataTypesConfig, FP16Config, normalize_dtype
from zeropp.config.zero import AUTO_KEYS, ZeroConfig, zero_config_type
from zeropp.techniques.technique import AUTO

__all__ = ["AUTO", "AUTO_KEYS", "ConfigError", "DeepSpeedConfig", "ZeroConfig", "OptimizerSettings", "load_json",
           "zero_config_type"]


@dataclass
class DeepSpeedConfig:
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    steps_per_print: int = 10            # the default of --log-interval when the file sets it
    wall_clock_breakdown: bool = False   # per-phase times in the log (zeropp/stages/wall_clock.py)
    # Dtype of gradient reductions: "fp32", "fp16", "bf16"; None = the compute dtype.
    communication_data_type: str | None = None
    # Gradient averaging, as DeepSpeed does it (see gradient_scale_factors).
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = field(default_factory=lambda: zero_config_type()())
    # DeepSpeed refuses a client optimizer it has not tested with ZeRO unless this is
    # true. Here the optimizer is always one the engine builds and tests (Adam, AdamW,
    # SGD), so the check never applies and either value is honest.
    zero_allow_untested_optimizer: bool = False
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)

    @classmethod
    def from_file(cls, path: str) -> "DeepSpeedConfig":
        return cls.from_dict(load_json(path), where=path)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config", validate: bool = True,
                  problems: Problems | None = None) -> "DeepSpeedConfig":
        """validate=False: the keys' types only; the caller validates once it has merged its flags.
        Every refusal in `raw` is reported together, in one ConfigError, or added to `problems`."""
        found = Problems() if problems is None else problems
        cfg = _build(cls, raw, where, found)
        if validate:
            with found.collect():
                cfg.validate(where)
        if problems is None:
            found.raise_if_any()
        return cfg

    def validate(self, where: str = "config"):
        """The whole file's refusals in one error: its own keys', then each section's."""
        problems = Problems()
        with problems.collect():
            self._validate_top(where)
        for name in ("activation_checkpointing", "optimizer", "scheduler", "zero_optimization"):
            if getattr(self, name) is not None:
                with problems.collect():
                    getattr(self, name).validate(f"{where}: {name}")
        problems.raise_if_any()

    def _validate_top(self, where: str):
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(f"{where}: fp16 and bf16 are both enabled; pick one")
        if self.gradient_clipping < 0:
            raise ConfigError(f"{where}: gradient_clipping must be >= 0")
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "steps_per_print"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{where}: {name} must be > 0, got {getattr(self, name)}")
        if self.fp16.auto_cast:
            refuse_value(f"{where}: fp16.auto_cast", True, False,
                    "fp16 runs the model with fp16 weights; autocast over fp32 weights is not implemented")
        if self.communication_data_type is not None:
            dtype = normalize_dtype(self.communication_data_type)
            if dtype is None:
                raise ConfigError(f"{where}: communication_data_type {self.communication_data_type!r} must "
                                  f"be fp32, fp16 or bf16 (or null for the compute dtype)")
            self.communication_data_type = dtype
        accum = normalize_dtype(self.data_types.grad_accum_dtype or "fp32")
        if accum != "fp32":
            refuse_value(f"{where}: data_types.grad_accum_dtype", self.data_types.grad_accum_dtype, "fp32",
                    "gradients always accumulate in fp32")
        self.data_types.grad_accum_dtype = accum
        if self.gradient_predivide_factor <= 0:
            raise ConfigError(f"{where}: gradient_predivide_factor must be > 0, "
                              f"got {self.gradient_predivide_factor}")
        stage = self.zero_optimization.stage
        if stage > 0 and self.gradient_predivide_factor != 1.0:
            raise ConfigError(f"{where}: gradient_predivide_factor {self.gradient_predivide_factor} is not "
                              f"supported with ZeRO stage {stage} (nor by DeepSpeed): stages 1-3 divide "
                              f"gradients by the world size before reducing them; remove the key, or use "
                              f"stage 0")
        if stage > 0 and self.prescale_gradients:
            refuse_value(f"{where}: prescale_gradients", True, False,
                         f"ZeRO stage {stage} always divides gradients by the world size before reducing "
                         f"them (DeepSpeed refuses the key there too)")
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            raise ConfigError(f"{where}: gradient_predivide_factor {self.gradient_predivide_factor} has no "
                              f"effect with prescale_gradients true (DeepSpeed then divides by the world "
                              f"size before reducing); drop one of the two")

    def gradient_scale_factors(self, world_size: int) -> tuple[float, float]:
        """(before, after): multiply gradients by `before` ahead of the sum over ranks and by
        `after` once summed, which averages them, in DeepSpeed's order:
        - ZeRO stages 1-3 divide by the world size before the sum (DeepSpeed's
          `average_tensor` and `reduce_scatter_coalesced`), so a 16-bit sum stays in range
          whenever the mean does;
        - stage 0 (DeepSpeed's `allreduce_bucket`): prescale_gradients divides by the world
          size before; otherwise gradients are divided by gradient_predivide_factor f before
          and by world_size / f after (f = 1 by default: sum, then divide)."""
        if self.zero_optimization.stage > 0 or self.prescale_gradients:
            return 1.0 / world_size, 1.0
        factor = self.gradient_predivide_factor
        return 1.0 / factor, factor / world_size

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


def _section_of(key: str) -> str | None:
    """Where a key that is misplaced belongs (e.g. a top-level key inside zero_optimization)."""
    for section, cls in (("at the top level", DeepSpeedConfig), ("in zero_optimization", zero_config_type()),
                         ("in fp16", FP16Config)):
        if key in {f.name for f in dataclasses.fields(cls)} or key in UNSUPPORTED.get(cls.__name__, {}):
            return section
    return None


def _build(cls, raw: Any, where: str, problems: Problems):
    """`cls` from `raw`; each key that cannot be taken joins `problems` (the others are taken)."""
    if not isinstance(raw, dict):
        problems.add(f"{where} must be a JSON object, got {type(raw).__name__}")
        return cls()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unsupported: dict[str, tuple[Callable, str]] = UNSUPPORTED.get(cls.__name__, {})
    kwargs = {}
    for key, value in raw.items():
        if key in unsupported:
            is_off, advice = unsupported[key]
            if not is_off(value):   # the "off" value is exactly what this engine does
                problems.add(f"{where}.{key} is not supported: {advice}")
        elif key not in fields:
            home = _section_of(key)
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(fields)}"
            problems.add(f"{where}: '{key}' belongs {home}, not here; move it there" if home is not None
                         else f"{where}: unknown key '{key}'{hint}")
        else:
            with problems.collect():
                kwargs[key] = _coerce(fields[key], value, f"{where}.{key}", problems)
    return cls(**kwargs)


_SECTIONS = (FP16Config, BF16Config, DataTypesConfig, OptimizerConfig, SchedulerConfig,
             ActivationCheckpointingConfig, TensorBoardConfig)


def _coerce(f: dataclasses.Field, value: Any, where: str, problems: Problems):
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if (value is None and "None" in typ) or (f.name in BUCKET_DEFAULTS and value == AUTO):   # "auto": HF's
        return None
    if f.metadata.get("auto") and isinstance(value, str):
        if value != AUTO:
            kind = "a whole number of ranks (1 = off)" if typ.startswith("int") else "true or false"
            raise ConfigError(f'{where} must be {kind} or "auto" (measure the links and let the '
                              f'planner choose), got {value!r}')
        return value
    if typ.startswith("ZeroConfig"):   # with the keys of every technique registered now
        return _build(zero_config_type(), value, where, problems)
    if f.metadata.get("section") is not None:   # a technique's nested object (LoCo's parameters)
        return _build(f.metadata["section"], value, where, problems)
    for nested in _SECTIONS:
        if typ.startswith(nested.__name__):
            return _build(nested, value, where, problems)
    if typ.startswith("bool"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if typ.startswith("int"):
        return parse_int(value, where)
    if typ.startswith("float"):
        return parse_number(value, where)
    if typ.startswith("str"):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if typ.startswith("dict"):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a JSON object")
        return value
    return value
