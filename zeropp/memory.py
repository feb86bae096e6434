"""Model-state memory per rank, measured next to ZeRO's formula.

Measured: the tensors `engine.model_state_tensors()` lists, by category
(parameters, gradients, optimizer). Tensors are grouped by the storage they
live in and each storage is counted once, in full (untyped_storage().nbytes(),
what the allocator actually holds), under the first category that lists it in
the order parameters, gradients, optimizer. So a view into a flat buffer
(gradient partitions, master slices, stage 3's weight shards) costs nothing
extra beyond its buffer, and an fp32 master that is a view of the fp32 weight
itself (fp32 training) is counted once, as a parameter. Empty placeholders
(released stage 3 weights) hold no storage. Call it between backward() and
step() after at least one step (Adam allocates its moments on the first
step, and gradients exist only between backward and step).

Predicted bytes per parameter, Psi = number of parameters, N = ranks. The
gradient partition accumulates in fp32 whatever the compute dtype (4 bytes,
DeepSpeed's grad_accum_dtype = fp32); in 16-bit training K = 12 (fp32 master
+ two Adam moments), in fp32 K = 8 (the master is the weight itself):

    16-bit:  stage 0: 2 + 4 + 12      stage 1, 2: 2 + (4 + 12)/N     stage 3: (2 + 4 + 12)/N
    fp32:    stage 0: 4 + 4 + 8       stage 1, 2: 4 + (4 + 8)/N      stage 3: (4 + 4 + 8)/N

Stages 1 and 2 hold the same at the measuring point; they differ between
micro-steps of gradient accumulation, where stage 1 keeps a full-size
accumulator (4 bytes per parameter in 16-bit) and stage 2 does not. SGD
without momentum has no optimizer state (K = 0, or 4 for the 16-bit master).

hpZ (ZeRO++) adds the secondary partition: the 16-bit weights again, split
over the h ranks of a node group, w/h bytes per parameter on top of stage 3's
parameters (`hpz_secondary_bytes` is that buffer alone).

Padding to a multiple of N, stage 3's persistent (unpartitioned) small
parameters and Adam's scalar step counters make the measurement slightly
larger than the formula; `ratio` = measured / predicted shows by how much.

Besides model states, `peaks` gives what the engine measured during steps:
the most bytes of gradient bucket buffers and (stage 3) of gathered weights
alive at once, next to the bounds the configuration sets.
"""
from __future__ import annotations

import torch


def predicted_bytes_per_param(stage: int, world: int, dtype: torch.dtype,
                              optimizer_bytes: float | None = None) -> dict[str, float]:
    """`optimizer_bytes`: K, the optimizer's fp32 bytes per parameter (default Adam's)."""
    w = 2 if dtype in (torch.float16, torch.bfloat16) else 4
    k = optimizer_bytes if optimizer_bytes is not None else (12 if w == 2 else 8)
    n = world
    table = {0: (w, 4, k), 1: (w, 4 / n, k / n), 2: (w, 4 / n, k / n), 3: (w / n, 4 / n, k / n)}
    p, g, o = table[stage]
    return {"parameters": p, "gradients": g, "optimizer": o}


def _optimizer_bytes(engine) -> float:
    s = engine.optim_settings
    moments = {"sgd": 1 if s.momentum else 0}.get(s.type, 2)
    master = 4 if engine.dtype != torch.float32 else 0
    return 4 * moments + master


def _storage_key(t: torch.Tensor):
    st = t.untyped_storage()
    return (t.device.type, t.device.index, st.data_ptr(), st.nbytes())


def measure(tensors_by_kind: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    seen = set()
    out = {}
    for kind in ("parameters", "gradients", "optimizer"):
        total = 0
        for t in tensors_by_kind.get(kind, []):
            if t is None or not torch.is_tensor(t):
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0:
                continue
            key = _storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
        out[kind] = total
    return out


def memory_report(engine) -> dict:
    """This rank's model-state bytes, measured and predicted, by category."""
    stage = engine.config.zero_optimization.stage
    world = engine.comm.topology.world_size
    psi = _num_params(engine)
    if world == 1:
        stage = 0  # every stage runs unsharded at world size 1
    per = predicted_bytes_per_param(stage, world, engine.dtype, _optimizer_bytes(engine))
    hpz = getattr(engine, "secondary_partition", None)   # stage 3 with hpZ
    secondary = hpz.flat if hpz is not None else None
    if hpz is not None:
        per["parameters"] += engine.dtype.itemsize / hpz.size
    measured = measure(engine.model_state_tensors())
    predicted = {k: v * psi for k, v in per.items()}
    total_m, total_p = sum(measured.values()), sum(predicted.values())
    return {
        "stage": stage, "world_size": world, "dtype": str(engine.dtype).replace("torch.", ""),
        "num_parameters": psi,
        "measured_bytes": {**measured, "total": total_m},
        "predicted_bytes": {**predicted, "total": total_p},
        "predicted_bytes_per_param": {**per, "total": sum(per.values())},
        "ratio": {**{k: (measured[k] / predicted[k] if predicted[k] else float("nan")) for k in measured},
                  "total": total_m / total_p},
        "peaks": engine.peak_buffers(),
        "hpz_secondary_bytes": 0 if secondary is None else secondary.untyped_storage().nbytes(),
    }


def _num_params(engine) -> int:
    shards = getattr(engine, "shards", None)
    if shards is not None:  # stage 3 weights are placeholders: use the recorded sizes
        return sum(s.numel for s in shards)
    return sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
