"""ZeRO++ as a plug-in to torch's FSDP2: `apply_zeropp` (apply.py) installs qwZ, hpZ, qgZ and
LoCo through FSDP2's public comm hooks (comms.py) and keeps their state (plugin.py), on HSDP
compressing the all-reduce across replicas (replicate.py);
`--sharding fsdp2` runs FSDP2 with the plug-in behind the engine's interface (engine.py)."""
from zeropp.fsdp.apply import NodeAwareGather, PluginError, UnitReduce, ZeroPP, apply_zeropp

__all__ = ["apply_zeropp", "PluginError", "ZeroPP", "NodeAwareGather", "UnitReduce"]
