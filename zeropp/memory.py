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
parameters (`hpz_secondary_bytes` is that buffer alone). qgZ's error feedback
(`zeropp_loco_param`, on more than one node) adds an INT8 error (one fp32 scale per
256) for 1/L of the gradients and, pending until the step is applied, the next one:
2 x 1.016/L bytes per parameter under gradients (`error_feedback_bytes`). INT4
weight deltas (`zero_quantized_weight_deltas`) add the reconstruction of this
rank's chunk (w/N) and its INT4 delta (0.53/N) under parameters
(`weight_deltas_bytes`).

Padding to a multiple of N, stage 3's persistent (unpartitioned) small
parameters and Adam's scalar step counters make the measurement slightly
larger than the formula; `ratio` = measured / predicted shows by how much.

Besides model states, `peaks` gives what the engine measured during steps
(`engine.peak_buffers()`): for each pool of buffers it keeps, `<name>_peak`
(the most bytes allocated at once) and `<name>_bound` (what the configuration
allows). `buffers` pairs them generically, whatever pools an engine exposes
(gradient buckets, gathered weights, quantization buffers, ...):
{name: {"peak", "bound", "within"}}; a peak without a bound (or the reverse)
is listed with None on the missing side and within False, so a pool nobody
bounded shows up rather than passing. `buffer_bounds_bytes` is the sum of the
bounds: what the configuration lets buffers hold on top of model states.
"""
from __future__ import annotations

import torch

from zeropp import techniques


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


def buffer_bounds(peaks: dict) -> dict[str, dict]:
    """{name: {"peak", "bound", "within"}} for every `<name>_peak` / `<name>_bound` in `peaks`."""
    names = sorted({k[:-len(suffix)] for k in peaks for suffix in ("_peak", "_bound") if k.endswith(suffix)})
    out = {}
    for name in names:
        peak, bound = peaks.get(name + "_peak"), peaks.get(name + "_bound")
        within = peak is not None and bound is not None and peak <= bound
        out[name] = {"peak": peak, "bound": bound, "within": within}
    return out


def memory_report(engine) -> dict:
    """This rank's model-state bytes, measured and predicted, by category."""
    stage = engine.config.zero_optimization.stage
    world = engine.comm.topology.world_size
    psi = engine.num_trained_parameters()
    if world == 1:
        stage = 0  # every stage runs unsharded at world size 1
    per = predicted_bytes_per_param(stage, world, engine.dtype, _optimizer_bytes(engine))
    lines = engine.memory_lines()   # what the techniques keep: hpZ's copy, LoCo's errors, the deltas'
    for line in lines:
        per[line.kind] += line.bytes_per_param
    measured = measure(engine.model_state_tensors())
    predicted = {k: v * psi for k, v in per.items()}
    total_m, total_p = sum(measured.values()), sum(predicted.values())
    peaks = engine.peak_buffers()
    buffers = buffer_bounds(peaks)
    return {
        "stage": stage, "world_size": world, "dtype": str(engine.dtype).replace("torch.", ""),
        "num_parameters": psi,
        "measured_bytes": {**measured, "total": total_m},
        "predicted_bytes": {**predicted, "total": total_p},
        "predicted_bytes_per_param": {**per, "total": sum(per.values())},
        "ratio": {**{k: (measured[k] / predicted[k] if predicted[k] else float("nan")) for k in measured},
                  "total": total_m / total_p},
        "peaks": peaks,
        "buffers": buffers,
        "buffer_bounds_bytes": sum(b["bound"] or 0 for b in buffers.values()),
        **{key: 0 for key in techniques.memory_keys()},
        **{line.name: sum(t.untyped_storage().nbytes() for t in line.tensors) for line in lines},
    }


class AllocationTrace:
    """Tensor allocations on `device` while the block runs (torch.profiler with
    profile_memory and Python stacks): `peak_bytes`, the most bytes allocated
    above the level at entry (frees of older tensors count down), and
    `at_peak`, what was alive at that moment by allocation site, largest first:
    [(site, bytes, count)]. A site is the innermost functions of this
    repository's packages (file:line of their def, as the profiler names them)
    and the operator that allocated: the outermost aten op under them, or the
    autograd node in backward ("zeropp/kernels/quant.py:155 _torch_quantize <
    zeropp/kernels/quant.py:186 quantize [aten::to]").

        with AllocationTrace() as trace:
            step()
        trace.peak_bytes, trace.at_peak[:5]
    """
    PACKAGES = ("zeropp/", "model/", "parallel/", "training/", "planner/", "bench/", "tests/")

    def __init__(self, device: str = "cpu", frames: int = 2):
        self.device, self.frames = device, frames
        self.peak_bytes, self.at_peak = 0, []

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True,
                             record_shapes=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        events = []   # (time, ptr, signed bytes, site)
        for root in self._prof.profiler.kineto_results.experimental_event_tree():
            self._collect(root, [], events)
        self._prof = None
        events.sort(key=lambda e: e[0])
        alive, level, peak, snapshot = {}, 0, 0, {}
        for _, ptr, size, site in events:
            level += size
            if size > 0:
                alive[ptr] = (size, site)
            else:
                alive.pop(ptr, None)   # older than the trace: only the level goes down
            if level > peak:
                peak, snapshot = level, dict(alive)
        by_site: dict[str, list[int]] = {}
        for size, site in snapshot.values():
            acc = by_site.setdefault(site, [0, 0])
            acc[0] += size
            acc[1] += 1
        self.peak_bytes = peak
        self.at_peak = sorted(((s, b, n) for s, (b, n) in by_site.items()), key=lambda r: -r[1])
        return False

    def _collect(self, ev, stack: list[str], out: list, op: str = ""):
        fields = ev.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            if str(fields.device).startswith(self.device) and fields.alloc_size:
                out.append((ev.start_time_ns, fields.ptr, fields.alloc_size, self._site(stack, op)))
            return
        name = ev.name
        if "(" in name and "): " in name and name.startswith(self.PACKAGES):
            path, rest = name.split("(", 1)
            line, func = rest.split("): ", 1)
            stack, op = stack + [f"{path}:{line} {func}"], ""   # a function (its def line) in this repo
        elif name.startswith("autograd::engine::evaluate_function: "):
            op = name.rsplit(" ", 1)[1]     # the backward node names what backward allocated
        elif name.startswith("aten::") and not op:
            op = name                       # the outermost aten op under the innermost frame
        for child in ev.children:
            self._collect(child, stack, out, op)

    def _site(self, stack: list[str], op: str) -> str:
        frames = " < ".join(reversed(stack[-self.frames:])) if stack else "(outside this repository)"
        return f"{frames} [{op}]" if op else frames
