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
the schedule formulas live in training/lr_schedule.py.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from common import ConfigError, Problems, parse_int, parse_number, refuse_value
from zeropp.config.bits import validate_bits
from zeropp.config.keys import BUCKET_DEFAULTS, UNSUPPORTED
from zeropp.config.monitor import ActivationCheckpointingConfig, TensorBoardConfig
from zeropp.config.optim import OptimizerConfig, OptimizerSettings, SchedulerConfig
from zeropp.config.precision import BF16Config, DataTypesConfig, FP16Config, normalize_dtype

__all__ = ["AUTO", "AUTO_KEYS", "ConfigError", "DeepSpeedConfig", "LocoConfig", "ZeroConfig", "OptimizerSettings", "load_json"]

# Smallest block sizes: a block's data bytes must be a multiple of 4 (INT8: 4 elements, INT4: 8), or
# the fp32 scales of the next row of a wire buffer start unaligned (zeropp/kernels/format.py, to_bytes).
_MIN_BLOCK = {"zero_quantized_weights_block_size": 4, "zero_quantized_gradients_block_size": 8}
_DEFAULT_REFRESH = 100   # ZeroConfig.zero_quantized_weight_deltas_refresh_interval
LOCO_ERR_BETA = {4: 0.8, 2: 0.95}   # unset err_beta by the bits across nodes (docs/results.md, convergence)


@dataclass
class LocoConfig:
    """`zeropp_loco_param` (DeepSpeed's spelling): error feedback for qgZ's INT4 hop
    (zeropp/techniques/qgz.py). The error carried to the next reduction is
    err_beta x the old one + (1 - err_beta) x this quantization's; every reset_T
    reductions of a bucket it starts again from zero (unset err_beta: LOCO_ERR_BETA)."""
    err_beta: float | None = None
    reset_T: int = 1024

    def validate(self, where: str):
        if not 0 <= self.err_beta < 1:
            raise ConfigError(f"{where}.err_beta must be in [0, 1) (0: carry the whole last error), "
                              f"got {self.err_beta}")
        if self.reset_T < 1:
            raise ConfigError(f"{where}.reset_T must be >= 1 (reductions between resets), got {self.reset_T}")


@dataclass
class ZeroConfig:
    stage: int = 0
    contiguous_gradients: bool = True        # true only (see _ZERO_FIXED)
    reduce_scatter: bool = True              # true only
    reduce_bucket_size: int | None = None   # None (unset, "auto"): from the model (zeropp/bucket_sizing.py)
    allgather_bucket_size: int | None = None
    # DeepSpeed turns overlap_comm on by default for stage 3 only; None = that default.
    overlap_comm: bool | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    # Each ZeRO++ switch may also be "auto": planner.auto.resolve (called by train.py) measures
    # the links and picks; zeropp.initialize refuses an unresolved "auto".
    zero_hpz_partition_size: int | str = 1
    zero_quantized_weights: bool | str = False
    zero_quantized_gradients: bool | str = False
    # qgZ with error feedback (--zero-loco); None = off.
    zeropp_loco_param: LocoConfig | None = None
    # INT4 weight deltas across nodes (--zero-quantized-weight-deltas, zeropp/techniques/deltas.py;
    # needs hpZ), with a full gather of every weight each refresh_interval optimizer steps; their
    # bits (--zero-quantized-weight-deltas-bits): 4, or 2 (zeropp/config/bits.py).
    zero_quantized_weight_deltas: bool = False
    zero_quantized_weight_deltas_refresh_interval: int = _DEFAULT_REFRESH
    zero_quantized_weight_deltas_bits: int = 4
    # qgZ rotates each gradient block by a Walsh-Hadamard transform before INT4 quantization
    # (--zero-hadamard-gradients, zeropp/techniques/hadamard.py; block = zero_quantized_gradients_block_size).
    zero_hadamard_gradients: bool = False
    # This product's keys (DeepSpeed fixes these): elements per fp32 scale (zeropp/kernels/quant.py).
    zero_quantized_weights_block_size: int = 256      # qwZ, INT8
    zero_quantized_gradients_block_size: int = 128    # qgZ, INT4
    # Bits of qgZ's hop between nodes (--zero-quantized-gradients-bits): 4, or 2 (INT2 blocks,
    # zeropp/techniques/qgz.py); the hop inside a node stays INT4.
    zero_quantized_gradients_bits: int = 4
    allgather_partitions: bool = True        # true only
    round_robin_gradients: bool = False      # false only
    sub_group_size: int = 1_000_000_000      # the default only
    # true: every save also writes the whole model in the compute dtype, DeepSpeed's pytorch_model.bin
    # (training/checkpoint/rank0_files.py); the second key is its old name, as DeepSpeed still reads it.
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    # False: the engine raises when a parameter got no gradient in a step (DeepSpeed's check).
    ignore_unused_parameters: bool = True

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def auto_switches(self) -> list[str]:
        """The ZeRO++ keys set to "auto" (still to be resolved)."""
        return [k for k in AUTO_KEYS if getattr(self, k) == AUTO]

    def validate(self, where: str = "zero_optimization"):
        if self.stage3_gather_fp16_weights_on_model_save:   # the old name
            self.stage3_gather_16bit_weights_on_model_save = True
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"{where}.stage is {self.stage}; ZeRO stages are 0, 1, 2 and 3")
        fixed = Problems()   # every such key of the file in one error
        for name, (ok, why) in _ZERO_FIXED.items():
            if getattr(self, name) != ok:
                with fixed.collect():
                    refuse_value(f"{where}.{name}", getattr(self, name), ok, why)
        fixed.raise_if_any()
        for name in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_max_live_parameters"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{where}.{name} must be a positive number of elements "
                                  f"(e.g. 5e8), got {getattr(self, name)}")
        for name in ("stage3_param_persistence_threshold", "stage3_max_reuse_distance"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name} must be >= 0, got {getattr(self, name)}")
        if self.zero_hpz_partition_size != AUTO and self.zero_hpz_partition_size < 1:
            raise ConfigError(f"{where}.zero_hpz_partition_size must be >= 1 "
                              f"(1 turns hpZ off), got {self.zero_hpz_partition_size}")
        for name, least in _MIN_BLOCK.items():
            b = getattr(self, name)
            if b < least or b & (b - 1):
                raise ConfigError(f"{where}.{name} must be a power of two >= {least} (elements per fp32 scale; "
                                  f"smaller blocks misalign the scales on the wire), got {b}; the default is "
                                  f"{getattr(ZeroConfig, name)}")
        # "auto" is resolved later (below stage 3: off), so only explicit switches are checked here.
        zpp = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if getattr(self, k) is True]
        if self.zero_hpz_partition_size != AUTO and self.zero_hpz_partition_size > 1:
            zpp.append("zero_hpz_partition_size")
        if self.zeropp_loco_param is not None:
            if self.zeropp_loco_param.err_beta is None:
                self.zeropp_loco_param.err_beta = LOCO_ERR_BETA.get(self.zero_quantized_gradients_bits, 0.8)
            self.zeropp_loco_param.validate(f"{where}.zeropp_loco_param")
        if self.zero_hadamard_gradients is True:
            zpp.append("zero_hadamard_gradients")
        for key, flag, what, on in (  # qgZ's options need qgZ itself
                ("zeropp_loco_param", "--zero-loco", "is error feedback for qgZ's quantized gradients",
                 self.zeropp_loco_param is not None),
                ("zero_hadamard_gradients", "--zero-hadamard-gradients", "smooths qgZ's INT4 gradient blocks",
                 self.zero_hadamard_gradients is True)):
            if on and self.zero_quantized_gradients is not True:
                raise ConfigError(f"{where}.{key} ({flag}) {what}: set zero_quantized_gradients true "
                                  f"(--zero-quantized-gradients), got {self.zero_quantized_gradients!r}")
        validate_bits(self, where)
        if self.zero_quantized_weight_deltas is True:
            zpp.append("zero_quantized_weight_deltas")
            if self.zero_hpz_partition_size != AUTO and self.zero_hpz_partition_size <= 1:
                raise ConfigError(f"{where}.zero_quantized_weight_deltas (--zero-quantized-weight-deltas) sends "
                                  f"weights as differences from the copy hpZ keeps in each node: set "
                                  f"zero_hpz_partition_size (--zero-hpz-size) to the ranks per node")
        elif self.zero_quantized_weight_deltas_refresh_interval != _DEFAULT_REFRESH:
            raise ConfigError(f"{where}.zero_quantized_weight_deltas_refresh_interval has no effect without "
                              f"zero_quantized_weight_deltas (--zero-quantized-weight-deltas); remove it or turn "
                              f"the deltas on")
        if self.zero_quantized_weight_deltas_refresh_interval < 1:
            raise ConfigError(f"{where}.zero_quantized_weight_deltas_refresh_interval must be >= 1 (optimizer "
                              f"steps between full gathers), got {self.zero_quantized_weight_deltas_refresh_interval}")
        if zpp and self.stage != 3:
            raise ConfigError(f"{where}: {', '.join(zpp)} (ZeRO++) need stage 3, "
                              f"but stage is {self.stage}")

    def validate_topology(self, ranks_per_node: int, world_size: int):
        """Checks that need the job's shape (called when the engine starts)."""
        h = self.zero_hpz_partition_size
        if self.zero_quantized_weight_deltas and h != AUTO and h <= 1:   # auto picked no hpZ
            raise ConfigError("zero_quantized_weight_deltas (--zero-quantized-weight-deltas) needs hpZ, but "
                              "zero_hpz_partition_size is 1: set it (--zero-hpz-size) to the ranks per node")
        if h != AUTO and h > 1 and (ranks_per_node % h or h > world_size):
            raise ConfigError(
                f"zero_hpz_partition_size (--zero-hpz-size) {h} must divide the ranks per node "
                f"({ranks_per_node}): the secondary partition lives inside one node. "
                f"Use a divisor of {ranks_per_node}, ideally {ranks_per_node} itself")
        # Deltas replace the gather from the primary partition; an hpZ group of the whole world
        # (auto's only hpZ on one node) gathers everything from its secondary copy: nothing is sent.
        group = ranks_per_node if h == AUTO else h
        if self.zero_quantized_weight_deltas and self.stage == 3 and group >= world_size:
            raise ConfigError(f"zero_quantized_weight_deltas (--zero-quantized-weight-deltas) does nothing here: "
                              f"hpZ's group ({group} ranks{', auto' if h == AUTO else ''}) is the whole world "
                              f"of {world_size}, so no weight crosses a node; drop it, or run on more than one node")


AUTO = "auto"
AUTO_KEYS = ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")


# zero_optimization keys whose other values ask for a DeepSpeed implementation detail we lack.
_ZERO_FIXED = {
    "contiguous_gradients": (True, "gradients are always copied into contiguous buckets"),
    "reduce_scatter": (True, "ZeRO stages 1-3 always reduce-scatter gradient buckets"),
    "allgather_partitions": (True, "updated shards are always all-gathered"),
    "round_robin_gradients": (False, "gradients are partitioned in order, not round-robin"),
    "sub_group_size": (1_000_000_000, "the optimizer steps each rank's whole shard at once"),
}


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
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
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
    for section, cls in (("at the top level", DeepSpeedConfig), ("in zero_optimization", ZeroConfig),
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


_SECTIONS = (ZeroConfig, LocoConfig, FP16Config, BF16Config, DataTypesConfig, OptimizerConfig, SchedulerConfig,
             ActivationCheckpointingConfig, TensorBoardConfig)


def _coerce(f: dataclasses.Field, value: Any, where: str, problems: Problems):
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if (value is None and "None" in typ) or (f.name in BUCKET_DEFAULTS and value == AUTO):   # "auto": HF's
        return None
    if f.name in AUTO_KEYS and isinstance(value, str):
        if value != AUTO:
            kind = "a whole number of ranks (1 = off)" if typ.startswith("int") else "true or false"
            raise ConfigError(f'{where} must be {kind} or "auto" (measure the links and let the '
                              f'planner choose), got {value!r}')
        return value
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
