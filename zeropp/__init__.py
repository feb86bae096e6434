"""ZeRO stages 0-3 (and ZeRO++) for any nn.Module."""
import dataclasses

from zeropp.bucket_sizing import bucket_sizes
from zeropp.config import ConfigError, DeepSpeedConfig, OptimizerSettings, ZeroConfig
from zeropp.stages.engine import Engine, StepResult
from zeropp.stages.init import ParamInit
from zeropp.stages.stage0 import DDPEngine


def initialize(module, config: DeepSpeedConfig, comm, device, optim: OptimizerSettings,
               gradient_accumulation_steps: int = 1, param_init: ParamInit | None = None,
               sharding: str = "zero", replicas: int = 1) -> Engine:
    """Wrap `module` in the engine for `config.zero_optimization.stage`.

    `module` may be built on the meta device; `param_init(name, tensor)` then
    fills each parameter (see zeropp/stages/init.py). Bucket sizes the config leaves
    unset are sized from the module (zeropp/bucket_sizing.py). A ZeRO++ switch set to "auto" must
    be resolved first (planner.auto.resolve). At world size 1 every stage
    takes the short path (DDPEngine without DDP): the shard is the weight,
    and ZeRO++ has nothing to send. Stages 1-3 are composed by zeropp/build.py.
    `sharding="fsdp2"`: torch's FSDP2 with ZeRO++ as its plug-in (zeropp/fsdp/engine.py); with
    `replicas` > 1 on HSDP's (replicas, world / replicas) mesh.
    """
    zero = config.zero_optimization
    if zero.auto_switches():
        raise ConfigError(f"zero_optimization {', '.join(k + ' = auto' for k in zero.auto_switches())} is "
                          f"not resolved: \"auto\" needs the links measured first; call "
                          f"planner.auto.resolve(config, model_config, comm, device, micro_batch, seq_length) "
                          f"and pass its .config here (train.py does this)")
    if sharding == "fsdp2":
        if comm.topology.world_size > 1:
            zero.validate_topology(comm.topology.ranks_per_node, comm.topology.world_size)
        from zeropp.fsdp.engine import FSDP2Engine
        return FSDP2Engine(module, config, comm, device, optim, gradient_accumulation_steps, param_init, replicas)
    zero = bucket_sizes(zero, sum(p.numel() for p in module.parameters()))   # those not set
    config = dataclasses.replace(config, zero_optimization=zero)
    if comm.topology.world_size > 1:
        zero.validate_topology(comm.topology.ranks_per_node, comm.topology.world_size)
    if zero.stage == 0 or comm.topology.world_size == 1:
        return DDPEngine(module, config, comm, device, optim, gradient_accumulation_steps, param_init=param_init)
    from zeropp.build import build_sharded_engine
    return build_sharded_engine(module, config, comm, device, optim, gradient_accumulation_steps, param_init)


__all__ = ["initialize", "ConfigError", "DeepSpeedConfig", "ZeroConfig", "Engine", "DDPEngine",
           "OptimizerSettings", "StepResult", "ParamInit"]
