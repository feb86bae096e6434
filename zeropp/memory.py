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

Predicted bytes per parameter, Psi = number of parameters, N = ranks:

    16-bit (fp16/bf16) training, K = 12 (fp32 master + Adam m + v):
        stage 0: 2 + 2 + K          stage 1: 2 + 2 + K/N
        stage 2: 2 + (2 + K)/N      stage 3: (2 + 2 + K)/N
    fp32 training, the master is the weight itself, K = 8 (Adam m + v):
        stage 0: 4 + 4 + 8          stage 1: 4 + 4 + 8/N
        stage 2: 4 + (4 + 8)/N      stage 3: (4 + 4 + 8)/N

Padding to a multiple of N, stage 3's persistent (unpartitioned) small
parameters and Adam's scalar step counters make the measurement slightly
larger than the formula; `ratio` = measured / predicted shows by how much.
"""
from __future__ import annotations

import torch


def predicted_bytes_per_param(stage: int, world: int, dtype: torch.dtype) -> dict[str, float]:
    w = 2 if dtype in (torch.float16, torch.bfloat16) else 4
    k = 12 if w == 2 else 8
    n = world
    table = {0: (w, w, k), 1: (w, w, k / n), 2: (w, w / n, k / n), 3: (w / n, w / n, k / n)}
    p, g, o = table[stage]
    return {"parameters": p, "gradients": g, "optimizer": o}


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
    per = predicted_bytes_per_param(stage, world, engine.dtype)
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
    }


def _num_params(engine) -> int:
    shards = getattr(engine, "shards", None)
    if shards is not None:  # stage 3 weights are placeholders: use the recorded sizes
        return sum(s.numel for s in shards)
    return sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
