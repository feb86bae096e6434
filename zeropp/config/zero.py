"""`zero_optimization`: ZeRO's own keys (`ZeroKeys`) and each technique's, composed into one
dataclass, `ZeroConfig`, with DeepSpeed's key names and defaults. A technique's keys and their
checks are its module's (its `Keys` and `validate`, zeropp/techniques/technique.py); nothing
here names one. `zero_config_type()` is the class a section is read into: `ZeroConfig`, or,
while a technique is registered for a while (zeropp.techniques.registered), `ZeroConfig` with
its keys too.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from common import ConfigError, Problems, refuse_value
from zeropp import techniques
from zeropp.techniques.technique import AUTO


@dataclass
class ZeroKeys:
    """ZeRO's own keys (the techniques' are theirs)."""
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
    allgather_partitions: bool = True        # true only
    round_robin_gradients: bool = False      # false only
    sub_group_size: int = 1_000_000_000      # the default only
    # true: every save also writes the whole model in the compute dtype, DeepSpeed's pytorch_model.bin
    # (training/checkpoint/rank0_files.py); the second key is its old name, as DeepSpeed still reads it.
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    # False: the engine raises when a parameter got no gradient in a step (DeepSpeed's check).
    ignore_unused_parameters: bool = True


# zero_optimization keys whose other values ask for a DeepSpeed implementation detail we lack.
_ZERO_FIXED = {
    "contiguous_gradients": (True, "gradients are always copied into contiguous buckets"),
    "reduce_scatter": (True, "ZeRO stages 1-3 always reduce-scatter gradient buckets"),
    "allgather_partitions": (True, "updated shards are always all-gathered"),
    "round_robin_gradients": (False, "gradients are partitioned in order, not round-robin"),
    "sub_group_size": (1_000_000_000, "the optimizer steps each rank's whole shard at once"),
}


@dataclass
class ZeroConfig(*reversed([t.keys for t in techniques.REGISTRY]), ZeroKeys):
    """ZeRO's keys, then every technique's in the registry's order. Each ZeRO++ switch may be
    "auto": planner.auto.resolve (called by train.py) measures the links and picks;
    zeropp.initialize refuses an unresolved "auto"."""

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def auto_switches(self) -> list[str]:
        """The keys set to "auto" (still to be resolved)."""
        return [f.name for f in dataclasses.fields(self) if f.metadata.get("auto") and getattr(self, f.name) == AUTO]

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
        for t in techniques.registry():
            t.validate(self, where)
        # "auto" is resolved later (below stage 3: off), so only the switches set on are checked here.
        on = [t.switch for t in techniques.enabled(self)]
        if on and self.stage != 3:
            raise ConfigError(f"{where}: {', '.join(on)} (ZeRO++) need stage 3, but stage is {self.stage}")

    def validate_topology(self, ranks_per_node: int, world_size: int):
        """Checks that need the job's shape (called when the engine starts)."""
        for t in techniques.registry():
            t.validate_topology(self, ranks_per_node, world_size)

    def techniques_off(self) -> ZeroConfig:
        """A copy with every technique's keys at their defaults: plain ZeRO."""
        keys = {f.name for t in techniques.registry() for f in dataclasses.fields(t.keys)}
        return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(self) if f.name in keys})


AUTO_KEYS = tuple(f.name for f in dataclasses.fields(ZeroConfig) if f.metadata.get("auto"))


def zero_config_type() -> type:
    """The class a zero_optimization section is read into: `ZeroConfig`, with the keys of the
    techniques registered for a while (zeropp.techniques.registered) when there are any."""
    extra = tuple(t.keys for t in techniques.registry() if t.keys not in ZeroConfig.__mro__)
    return _with_keys(extra) if extra else ZeroConfig


@functools.lru_cache(maxsize=None)
def _with_keys(extra: tuple) -> type:
    return dataclass(type("ZeroConfig", (*reversed(extra), ZeroConfig), {"__module__": __name__}))
