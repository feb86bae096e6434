"""ZeRO++ switches set to "auto": measure this job's links and let the planner pick.

    from planner.auto import resolve
    res = resolve(ds_config, model_cfg, comm, device, micro_batch, seq_length, accumulation=1,
                  optimizer=None)
    engine = zeropp.initialize(model, res.config, comm, device, ...)
    for line in res.lines: print(line)

`ds_config` is a zeropp.DeepSpeedConfig or its JSON dict (not modified); `model_cfg` a
model.GPTConfig; `comm` the job's parallel.comm.Communicator (its topology says nodes and
ranks per node); `device` this rank's torch.device. Every rank calls it (it runs collectives)
after the process group is up and before zeropp.initialize. It returns a Resolution:
`config` (a copy with every "auto" replaced), `lines` (what it measured, the predicted step
time of each candidate, the choice and why), `predicted` ({label: seconds}) and `measured`
(planner.probe.Measurements, None when nothing was measured).

Rules
- Only switches set to "auto" are chosen; the others stay as set. qwZ and qgZ auto: off or
  on; hpZ auto: 1 (off) or the ranks per node. A candidate the config's own checks refuse
  with the other switches is never weighed (the INT4 weight deltas need hpZ); none left, or
  a switch that needs one auto turns off, is a ConfigError.
- Below stage 3, at world size 1 or on one node, the auto switches are set off without a
  probe, in one line saying why (ZeRO++ needs stage 3; with one node there is no slow link for
  quantization to save and hpZ's copy inside the node would be the primary partition itself).
- Otherwise planner.probe.measure times the links, one transformer block of the model, the
  quantization kernels and the optimizer (about 1 s; every figure is the MAX over ranks, so
  every rank decides the same), builds a planner Cluster from the figures, and predicts the
  iteration time of every candidate with the planner's own model (planner.plan.plan_config:
  the real model's trace, the engine's buckets and collectives, planner/timing.py). The
  fastest wins, except that a candidate with fewer techniques within PREFER_FEWER (2%) of the
  fastest is preferred: quantization costs accuracy and hpZ memory.
- The engine overlaps gathers and reductions with compute (planner/timing.py's overlap model),
  on CPU ranks too: `python -m bench.slow_link planner` fits the slow-link sweep with it.
- A probe that cannot run raises parallel.link_probe.LinkProbeError; nothing is guessed.

`train.py --dry-run --cluster FILE` with auto switches plans every candidate on the
described cluster instead of measuring (print_dry_run).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model import GPTConfig
from planner.cluster import Cluster, load_cluster
from planner.outer import format_outer_plan
from planner.plan import Job, job_from_args, label, plan_config, print_plan
from planner.probe import Measurements, measure
from planner.trace import trace_model
from common import ConfigError
from training.preflight import missing_inputs
from zeropp import techniques
from zeropp.config import DeepSpeedConfig, OptimizerSettings, ZeroConfig
from zeropp.stages.engine import compute_dtype

PREFER_FEWER = 0.02   # a candidate with fewer techniques within 2% of the fastest wins


@dataclass
class Resolution:
    config: DeepSpeedConfig
    lines: list[str]
    predicted: dict[str, float]          # candidate label -> predicted seconds per iteration
    measured: Measurements | None = None


def resolve(ds_config: DeepSpeedConfig | dict, model_cfg: GPTConfig, comm, device: torch.device,
            micro_batch: int, seq_length: int, accumulation: int = 1,
            optimizer: OptimizerSettings | None = None) -> Resolution:
    """Replace every "auto" ZeRO++ switch of `ds_config` (module docstring); collective on every rank."""
    ds = copy.deepcopy(ds_config) if isinstance(ds_config, DeepSpeedConfig) else DeepSpeedConfig.from_dict(ds_config)
    zero = ds.zero_optimization
    topo = comm.topology
    if not zero.auto_switches():
        return Resolution(ds, [], {})
    reason = trivial_reason(zero, topo.world_size, topo.num_nodes)
    if reason:
        return Resolution(ds, [switch_off(zero, reason, topo.ranks_per_node, topo.world_size)], {})
    dtype = compute_dtype(ds)
    m = measure(model_cfg, dtype, device, micro_batch, seq_length, topo,
                zero.zero_quantized_weights_block_size, zero.zero_quantized_gradients_block_size)
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    cluster = measured_cluster(m, topo.num_nodes, topo.ranks_per_node, overlap=True, gloo=backend == "gloo")
    job = Job(cfg=model_cfg, ds=ds, optimizer=optimizer or OptimizerSettings(), world=topo.world_size,
              ranks_per_node=topo.ranks_per_node, micro_batch=micro_batch, seq_length=seq_length,
              accumulation=accumulation)
    chosen, predicted, lines = choose(job, cluster)
    ds.zero_optimization = chosen
    head = [f"> ZeRO++ auto: measured on every rank in {m.seconds:.2f} s ({m.timing()}), the slowest rank's "
            f"figures: {m.links.summary()}", f"> ZeRO++ auto: {m.summary()}"]
    return Resolution(ds, head + lines, predicted, m)


def trivial_reason(zero: ZeroConfig, world: int, nodes: int) -> str | None:
    """Why the auto switches are simply off here, or None when the links decide."""
    if zero.stage != 3:
        return f"ZeRO stage {zero.stage}: qwZ, hpZ and qgZ act on stage 3 only"
    if world == 1:
        return "world size 1: nothing is sent"
    if nodes == 1:
        return ("one node: no slow inter-node link for quantization to save, and hpZ's copy inside the node "
                "would be the primary partition itself")
    return None


def _name(key: str) -> str:
    """The technique an "auto" key switches (its name in run labels)."""
    return next(t.name for t in techniques.registry() if t.switch == key)


def switch_off(zero: ZeroConfig, reason: str, ranks_per_node: int, world: int) -> str:
    """Set the auto switches off; the one line that says so. A ConfigError if another switch
    needs one of them (the INT4 weight deltas need hpZ)."""
    auto = zero.auto_switches()
    for key in auto:
        setattr(zero, key, 1 if key == "zero_hpz_partition_size" else False)
    names = ", ".join(_name(k) for k in auto)
    if zero.zero_quantized_weight_deltas and "zero_hpz_partition_size" in auto:
        raise ConfigError(f"zero_quantized_weight_deltas (--zero-quantized-weight-deltas) needs hpZ across nodes, "
                          f"and --zeropp auto turns hpZ off here ({reason}); drop the deltas")
    _check(zero, ranks_per_node, world, f"--zeropp auto turns {names} off here ({reason}), but")
    return f"> ZeRO++ auto: {names} off ({reason}); now {label(zero)}"


def candidates(zero: ZeroConfig, ranks_per_node: int, world: int) -> list[ZeroConfig]:
    """Every resolution of the auto switches (the others as set) that the config's own checks
    accept with the other switches on this shape, fewest techniques first (none: ConfigError)."""
    options = {
        "zero_quantized_weights": [False, True],
        "zero_hpz_partition_size": [1, ranks_per_node] if ranks_per_node > 1 else [1],
        "zero_quantized_gradients": [False, True],
    }
    auto = zero.auto_switches()
    out, refused = [], []
    for values in itertools.product(*(options[k] for k in auto)):
        candidate = dataclasses.replace(zero, **dict(zip(auto, values)))
        try:
            _check(candidate, ranks_per_node, world, "")
            out.append(candidate)
        except ConfigError as e:
            refused.append(str(e))
    if not out:
        raise ConfigError(f"--zeropp auto: no choice of {', '.join(_name(k) for k in auto)} works with the "
                          f"other switches on {world} ranks ({ranks_per_node} per node): {refused[-1]}")
    return sorted(out, key=technique_count)


def _check(zero: ZeroConfig, ranks_per_node: int, world: int, context: str):
    """The checks every explicit configuration passes (ZeroConfig's: ZeRO's own and each technique's),
    for a resolved one."""
    try:
        zero.validate("zero_optimization")
        zero.validate_topology(ranks_per_node, world)
    except ConfigError as e:
        if not context:
            raise
        raise ConfigError(f"{context} {e}") from None


def technique_count(zero: ZeroConfig) -> int:
    return len(techniques.enabled(zero))


def choose(job: Job, cluster: Cluster) -> tuple[ZeroConfig, dict[str, float], list[str]]:
    """The candidate to run on `cluster` (module docstring's rule), every candidate's predicted
    iteration time, and the log lines saying so."""
    zero = job.ds.zero_optimization
    trace = trace_model(job.cfg, compute_dtype(job.ds), job.micro_batch, job.seq_length,
                        zero.stage3_param_persistence_threshold)
    timed = [(c, plan_config(job, c, trace, cluster, ranks=[0]).timing.iteration)
             for c in candidates(zero, job.ranks_per_node, job.world)]
    fastest = min(t for _, t in timed)
    chosen, t_chosen = min(((c, t) for c, t in timed if t <= fastest * (1 + PREFER_FEWER)),
                           key=lambda ct: (technique_count(ct[0]), ct[1]))
    predicted = {label(c): t for c, t in timed}
    lines = [f"> ZeRO++ auto: predicted iteration time on {cluster.name} (planner/timing.py):"]
    lines += [f">   {label(c):<28}{t * 1e3:10.1f} ms" for c, t in timed]
    why = "the fastest" if t_chosen == fastest else (
        f"within {PREFER_FEWER:.0%} of the fastest ({fastest * 1e3:.1f} ms) with fewer techniques")
    lines.append(f"> ZeRO++ auto: chose {label(chosen)}, {t_chosen * 1e3:.1f} ms predicted, {why}")
    return chosen, predicted, lines


def measured_cluster(m: Measurements, nodes: int, ranks_per_node: int, overlap: bool, gloo: bool) -> Cluster:
    """A planner Cluster from the probe's figures (rates as measured: efficiencies 1)."""
    gbps = 8 / 1e9
    return Cluster(nodes=nodes, gpus_per_node=ranks_per_node, gpu_memory_gb=0.0,
                   peak_flops=m.flops_per_s, peak_flops_fp32=m.flops_per_s, compute_efficiency=1.0,
                   intra_node_gbps=max(m.links.intra_node_bytes_per_s, 1.0) * gbps,
                   intra_node_latency_us=m.links.intra_node_latency_s * 1e6,
                   inter_node_gbps=m.links.inter_node_bytes_per_s * gbps,
                   inter_node_latency_us=m.links.inter_node_latency_s * 1e6, link_efficiency=1.0,
                   memory_gbps=m.optimizer_bytes_per_s * gbps, int8_quantize_gelems=m.int8_elements_per_s / 1e9,
                   int4_quantize_gelems=m.int4_elements_per_s / 1e9, overlap=overlap,
                   backend="gloo" if gloo else "nccl", name="the measured links")


def print_dry_run(args) -> None:
    """`train.py --dry-run`: with auto switches, plan every candidate on --cluster, say which
    auto would pick there, then print the plan of that choice. First, the input paths the
    flags name: every one that is missing, in one line."""
    missing = missing_inputs(args)
    if missing:
        raise ConfigError(f"--dry-run: missing input(s): {'; '.join(missing)}; fix the path(s) (the dry run checks "
                          f"them on the machine it runs on)")
    if args.groups is not None:   # groups of nodes synchronizing rarely
        print(format_outer_plan(args), flush=True)
        return
    zero = args.ds_config.zero_optimization
    if zero.auto_switches():
        cluster = load_cluster(args.cluster)
        reason = trivial_reason(zero, cluster.world_size, cluster.nodes)
        if reason:
            print(switch_off(zero, reason, cluster.gpus_per_node, cluster.world_size), flush=True)
        else:
            job = job_from_args(args, cluster)
            chosen, _, lines = choose(job, cluster)
            args.ds_config.zero_optimization = chosen
            print("\n".join(lines) + "\n", flush=True)
    print_plan(args)


__all__ = ["PREFER_FEWER", "Resolution", "candidates", "choose", "measured_cluster", "print_dry_run", "resolve",
           "switch_off", "trivial_reason"]
