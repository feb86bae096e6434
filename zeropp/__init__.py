"""ZeRO stages 0-3 (and ZeRO++) for any nn.Module."""
from zeropp.config import ConfigError, DeepSpeedConfig, ZeroConfig
from zeropp.engine import DDPEngine, Engine, OptimizerSettings, StepResult


def initialize(module, config: DeepSpeedConfig, comm, device, optim: OptimizerSettings,
               gradient_accumulation_steps: int = 1) -> Engine:
    """Wrap `module` in the engine for `config.zero_optimization.stage`."""
    zero = config.zero_optimization
    zero.validate_topology(comm.topology.ranks_per_node, comm.topology.world_size)
    zeropp_keys = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if getattr(zero, k)]
    if zero.zero_hpz_partition_size > 1:
        zeropp_keys.append("zero_hpz_partition_size")
    if zeropp_keys:
        raise ConfigError(f"{', '.join(zeropp_keys)}: ZeRO++ (qwZ, hpZ, qgZ) is not in this build yet; "
                          f"remove these keys to train with plain ZeRO stage 3")
    if zero.stage == 0:
        cls = DDPEngine
    elif zero.stage in (1, 2):
        from zeropp.stage12 import ShardedOptimizerEngine as cls
    else:
        from zeropp.stage3 import Stage3Engine as cls
    return cls(module, config, comm, device, optim, gradient_accumulation_steps)


__all__ = ["initialize", "ConfigError", "DeepSpeedConfig", "ZeroConfig", "Engine", "DDPEngine",
           "OptimizerSettings", "StepResult"]
