"""The plan of one configuration on one cluster, and its printout.

`plan_config` computes, for one ZeRO configuration: per-GPU memory (rank 0,
which owns the most), bytes per phase per rank and the time model.
`build_plan(args)` plans the configuration the flags describe and, next to
it, ZeRO-3 (when ZeRO++ switches are on) or ZeRO++ with all three switches
and hpZ = GPUs per node (when they are off, at stage 3). `print_plan(args)`
is what `train.py --dry-run` calls.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from model import GPTConfig, flops_per_iteration
from common import note
from planner.cluster import Cluster, load_cluster
from planner.comm import PHASES, Step, bytes_by_phase, iteration_collectives
from planner.memory import buffer_bytes, formula_bytes, model_state_bytes
from planner.timing import Timing, iteration_time
from planner.trace import ModelTrace, shard_layout, trace_model
from training.checkpoint import checkpoint_bytes, optimizer_moments
from zeropp import techniques
from zeropp.bucket_sizing import bucket_sizes
from zeropp.config import DeepSpeedConfig, OptimizerSettings, ZeroConfig
from zeropp.stages.engine import communication_dtype, compute_dtype

GPT2_VOCAB = 50257   # GPT-2's BPE vocabulary, when the tokenizer files are not at hand


@dataclass
class Job:
    """What the plan needs to know about the run."""
    cfg: GPTConfig
    ds: DeepSpeedConfig
    optimizer: OptimizerSettings
    world: int
    ranks_per_node: int
    micro_batch: int
    seq_length: int
    accumulation: int
    vocab_note: str = ""   # where the vocabulary size came from
    train_iters: int | None = None


@dataclass
class ConfigPlan:
    label: str
    zero: ZeroConfig
    step: Step
    memory: dict          # category -> bytes (rank 0); a technique's under its MemoryLine's name
    formula: dict         # ZeRO's closed form, same categories
    bytes_per_rank: list  # rank -> {phase: [intra, inter]}
    timing: Timing | None
    kept: list = dataclasses.field(default_factory=list)     # MemoryLines of the weight sources (hpZ's copy)
    carried: list = dataclasses.field(default_factory=list)  # ... of the carried parts (LoCo's errors, the deltas')
    saved: dict = dataclasses.field(default_factory=dict)    # carried-state key -> bytes a checkpoint holds

    def mean_bytes(self, phase: str) -> tuple[float, float]:
        n = len(self.bytes_per_rank)
        return (sum(b[phase][0] for b in self.bytes_per_rank) / n,
                sum(b[phase][1] for b in self.bytes_per_rank) / n)


def label(zero: ZeroConfig) -> str:
    if zero.stage != 3:
        return f"ZeRO-{zero.stage}"
    on = techniques.names(zero, detailed=True)
    return f"ZeRO++ ({', '.join(on)})" if on else "ZeRO-3"


def short(zero: ZeroConfig) -> str:
    """Column heading: ZeRO-1/2/3 or ZeRO++ (the switches are in the legend)."""
    return label(zero).split(" (")[0]


def ranks_to_plan(world: int, ranks_per_node: int) -> list[int]:
    """Every rank for small worlds; for large ones the ranks of one node (the
    per-rank pattern repeats node after node for rings and all-to-alls)."""
    return list(range(world)) if world <= 64 else list(range(ranks_per_node))


def plan_config(job: Job, zero: ZeroConfig, trace: ModelTrace, cluster: Cluster | None,
                ranks: list[int] | None = None) -> ConfigPlan:
    ds = copy.deepcopy(job.ds)
    ds.zero_optimization = zero = bucket_sizes(zero, trace.num_parameters)   # as zeropp.initialize does
    dtype = compute_dtype(ds)
    w, g = dtype.itemsize, communication_dtype(ds).itemsize
    world, rpn = job.world, job.ranks_per_node
    hpz = zero.zero_hpz_partition_size
    layouts = {r: shard_layout(trace, world, r, zero.stage, zero.stage3_param_persistence_threshold, hpz)
               for r in (ranks if ranks is not None else ranks_to_plan(world, rpn))}
    shards = layouts[min(layouts)]
    step = iteration_collectives(shards, trace, zero, world, rpn, job.accumulation, w, g, rank=min(layouts),
                                 backend=cluster.backend if cluster is not None else "nccl")
    opt = job.optimizer
    memory = model_state_bytes(shards, zero.stage, w, opt.type, opt.momentum)
    k = (8 if opt.type != "sgd" else (4 if opt.momentum else 0)) + (4 if w != 4 else 0)
    formula = formula_bytes(trace.num_parameters, zero.stage, world, dtype, k)
    # What the techniques' parts keep and carry, as each says (its MemoryLine, its checkpoint state)
    parts = step.parts
    kept = parts.sources.memory_lines() if parts is not None and parts.sources is not None else []
    carried = [part.memory() for part in parts.carried.values()] if parts is not None else []
    for line in kept + carried:
        memory[line.name] = line.planned_bytes()
        formula[line.name] = line.bytes_per_param * trace.num_parameters
    saved = {key: sum(s.numel * s.local.element_size() for s in part.checkpoint_state(world).values())
             for key, part in (parts.carried.items() if parts is not None else ())}
    memory.update(buffer_bytes(step, shards, zero, world, w, g))
    memory["activations"] = trace.activation_bytes(job.cfg.checkpoint_activations)
    memory["activations_other"] = trace.activation_bytes(not job.cfg.checkpoint_activations)
    per_rank = [bytes_by_phase(step, world, rpn, hpz, r) for r in sorted(layouts)]
    timing = None
    if cluster is not None:
        if dtype == torch.float32:
            cluster = dataclasses.replace(cluster, peak_flops=cluster.fp32_flops)
        flops = flops_per_iteration(job.cfg, job.micro_batch, job.seq_length, job.cfg.checkpoint_activations)
        owned = sum(s.valid for s in shards)
        timing = iteration_time(step, cluster, flops, job.cfg.checkpoint_activations, job.accumulation, owned,
                                world, rpn, hpz, overlap=cluster.overlap and zero.overlap)
    return ConfigPlan(label(zero), zero, step, memory, formula, per_rank, timing, kept, carried, saved)


def companion(zero: ZeroConfig, ranks_per_node: int) -> ZeroConfig | None:
    """The configuration to compare with: ZeRO-3 for ZeRO++, ZeRO++ for ZeRO-3."""
    if zero.stage != 3:
        return None
    if label(zero) != "ZeRO-3":
        return zero.techniques_off()
    return dataclasses.replace(zero, zero_quantized_weights=True, zero_quantized_gradients=True,
                               zero_hpz_partition_size=ranks_per_node)


def vocab_size(args) -> tuple[int, str]:
    """The tokenizer's vocabulary (its files were checked: training.preflight.missing_inputs);
    GPT-2's BPE vocabulary when the flags name no tokenizer file."""
    from data.tokenizer import build_tokenizer
    files = args.tokenizer_model or args.vocab_file
    if not files:
        return GPT2_VOCAB, "GPT-2's BPE vocabulary: no tokenizer file given"
    tok = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                          vocab_file=args.vocab_file, merge_file=args.merge_file)
    return tok.vocab_size, f"from {files}"


def job_from_args(args, cluster: Cluster) -> Job:
    from training.args import flag, resolve_batch
    from training.model_args import model_config
    world, rpn = cluster.world_size, cluster.gpus_per_node
    if args.ranks_per_node and args.ranks_per_node != rpn:
        note(f"{flag(args, 'ranks_per_node', args.ranks_per_node)} emulates nodes on one machine; the plan "
             f"has the cluster's nodes of {rpn} GPUs")
    zero = args.ds_config.zero_optimization
    zero.validate_topology(rpn, world)
    resolve_batch(args, world)
    vocab, vocab_note = vocab_size(args)
    cfg = model_config(args, vocab, args.seed)
    return Job(cfg=cfg, ds=args.ds_config, optimizer=args.optimizer_settings, world=world, ranks_per_node=rpn,
               micro_batch=args.micro_batch_size, seq_length=args.seq_length,
               accumulation=args.gradient_accumulation_steps, vocab_note=vocab_note, train_iters=args.train_iters)


def build_plan(args) -> tuple[Job, Cluster, ModelTrace, list[ConfigPlan]]:
    cluster = load_cluster(args.cluster)
    job = job_from_args(args, cluster)
    zero = job.ds.zero_optimization
    dtype = compute_dtype(job.ds)
    trace = trace_model(job.cfg, dtype, job.micro_batch, job.seq_length, zero.stage3_param_persistence_threshold)
    plans = [plan_config(job, zero, trace, cluster)]
    other = companion(zero, job.ranks_per_node)
    if other is not None:
        base = plan_config(job, other, trace, cluster)
        plans = [base] + plans if label(zero) != "ZeRO-3" else plans + [base]
    return job, cluster, trace, plans


# -- printing ----------------------------------------------------------------------------
def _technique_rows(plans: list[ConfigPlan], which: str) -> list[tuple[str, str]]:
    """(label, memory key) of the techniques' lines (`kept` or `carried`) that hold bytes in a plan."""
    rows = {}
    for p in plans:
        for line in getattr(p, which):
            rows.setdefault(line.name, line.label or line.name)
    return [(label, name) for name, label in rows.items() if any(p.memory.get(name) for p in plans)]


def _gib(x: float) -> str:
    return f"{x / 2**30:8.2f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:10.1f}"


def format_plan(job: Job, cluster: Cluster, trace: ModelTrace, plans: list[ConfigPlan]) -> str:
    cfg = job.cfg
    dtype = str(compute_dtype(job.ds)).replace("torch.", "")
    lines = []
    out = lines.append
    out(f"== Plan (--dry-run): GPT {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads} heads, seq {job.seq_length}, vocab {cfg.vocab_size} (padded "
        f"{cfg.padded_vocab_size}{', ' + job.vocab_note if job.vocab_note else ''})")
    out(f"   parameters: {trace.num_parameters:,} ({trace.num_parameters / 1e9:.2f} B)")
    out(f"   cluster {cluster.name}: {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs = {job.world}, "
        f"{cluster.gpu_memory_gb:g} GiB each, peak {cluster.peak_flops / 1e12:g} TFLOP/s (16-bit) at "
        f"{cluster.compute_efficiency:.0%} efficiency; inside a node {cluster.intra_node_gbps:g} Gbit/s per GPU, "
        f"{cluster.intra_node_latency_us:g} us; between nodes {cluster.inter_node_gbps:g} Gbit/s per node x "
        f"{cluster.link_efficiency:g}, {cluster.inter_node_latency_us:g} us")
    if cluster.description:
        out(f"   ({cluster.description.strip()})")
    out(f"   run: {dtype}, micro-batch {job.micro_batch} x {job.world} GPUs x {job.accumulation} accumulation "
        f"= global batch {job.micro_batch * job.world * job.accumulation}; activation checkpointing "
        f"{'on' if cfg.checkpoint_activations else 'off'}; overlap_comm "
        f"{'on' if plans[0].zero.overlap and cluster.overlap else 'off'}")
    width = 12
    head = "".join(f"{short(p.zero):>{width}}" for p in plans)
    for p in plans:
        if p.label != short(p.zero):
            out(f"   {short(p.zero)} = ZeRO-3 + {p.label[len('ZeRO++ ('):-1]}")

    out("")
    out(f"-- Memory per GPU (GiB, rank 0){'':11}{head}")
    rows = [("weights (16-bit shard + persistent)" if plans[0].zero.stage == 3 else "weights (whole, 16-bit)",
             "weights"), *_technique_rows(plans, "kept"),
            ("gradients (fp32, whole)" if plans[0].zero.stage == 0 else "gradients (fp32 partition)", "gradients"),
            ("optimizer (fp32 master + Adam)", "optimizer"), *_technique_rows(plans, "carried"),
            ("gradient bucket buffers", "gradient_buckets"),
            ("gathered-weight buffers", "gathered_weights")]
    ckpt = "on" if cfg.checkpoint_activations else "off"
    for name, key in rows:
        out(f"   {name:<41}" + "".join(f"{_gib(p.memory.get(key, 0)):>{width}}" for p in plans))
    out(f"   {'activations (checkpointing ' + ckpt + ')':<41}"
        + "".join(f"{_gib(p.memory['activations']):>{width}}" for p in plans))
    other = "off" if cfg.checkpoint_activations else "on"
    out(f"   {'  (with checkpointing ' + other + ': not in total)':<41}"
        + "".join(f"{_gib(p.memory['activations_other']):>{width}}" for p in plans))
    out(f"   {'framework reserve':<41}" + "".join(f"{_gib(cluster.reserved_bytes):>{width}}" for _ in plans))
    totals = []
    for p in plans:
        keys = [k for _, k in rows] + ["activations"]
        totals.append(sum(p.memory.get(k, 0) for k in keys) + cluster.reserved_bytes)
    out(f"   {'total':<41}" + "".join(f"{_gib(t):>{width}}" for t in totals))
    verdicts = []
    for t in totals:
        room = cluster.gpu_memory_bytes - t
        verdicts.append(f"fits +{room / 2**30:.2f}" if room >= 0 else f"NO -{-room / 2**30:.2f}")
    out(f"   {'fits in ' + format(cluster.gpu_memory_gb, 'g') + ' GiB? (+free / -short)':<41}"
        + "".join(f"{v:>{width}}" for v in verdicts))
    out(f"   {'model states by ZeRO formula':<41}"
        + "".join(f"{_gib(sum(p.formula.values())):>{width}}" for p in plans))
    opt = job.optimizer
    moments = optimizer_moments(opt)
    # the techniques' carried state is saved too (LoCo's errors, the deltas' references), sharded as it lives
    total = checkpoint_bytes(trace.num_parameters, moments) + max(sum(p.saved.values()) for p in plans)
    names = techniques.carried_names()
    carried = [names[k] for k in names if any(p.saved.get(k) for p in plans)]
    what = f"its fp32 masters, {moments} optimizer moment(s)" + "".join(f", {c}" for c in carried[:-1]) \
        + (f" and {carried[-1]}" if carried else "")
    out(f"   checkpoint (--save; training/checkpoint/): {total / 2**30:.1f} GiB per save, "
        f"{total / job.world / 2**30:.2f} GiB written by each GPU ({what}; no GPU gathers the model)")

    out("")
    out("-- Communication per iteration per GPU (MB sent, mean over ranks; NCCL ring charging)")
    out(f"   {'phase':<22}" + "".join(f"{short(p.zero):>24}" for p in plans))
    out(f"   {'':<22}" + "".join(f"{'intra':>12}{'inter':>12}" for _ in plans))
    for phase in PHASES:
        out(f"   {phase:<22}" + "".join(_mb(p.mean_bytes(phase)[0]).rjust(12) + _mb(p.mean_bytes(phase)[1]).rjust(12)
                                       for p in plans))
    tot = [(sum(p.mean_bytes(ph)[0] for ph in PHASES), sum(p.mean_bytes(ph)[1] for ph in PHASES)) for p in plans]
    out(f"   {'total':<22}" + "".join(_mb(a).rjust(12) + _mb(b).rjust(12) for a, b in tot))
    if len(plans) == 2 and tot[0][1]:
        out(f"   cross-node bytes {short(plans[1].zero)} / {short(plans[0].zero)}: {tot[1][1] / tot[0][1]:.3f}")

    out("")
    out("-- Time per iteration (s; planner/timing.py: compute at peak x efficiency, each collective at its "
        "link's bandwidth and latency, overlap as configured)")
    out(f"   {'':<41}" + head)

    def trow(name, f):
        out(f"   {name:<41}" + "".join(f"{f(p.timing):>{width}}" for p in plans))
    trow("compute forward + backward", lambda t: f"{t.compute_fwd + t.compute_bwd:.3f}")
    trow("(de)quantization", lambda t: f"{t.quant:.3f}")
    for phase in PHASES:
        trow(f"{phase} (unoverlapped)", lambda t, ph=phase: f"{t.comm[ph]:.3f}")
    trow("optimizer step", lambda t: f"{t.optimizer:.3f}")
    trow("exposed communication", lambda t: f"{t.exposed_comm:.3f}")
    trow("iteration time", lambda t: f"{t.iteration:.3f}")
    flops = flops_per_iteration(cfg, job.micro_batch, job.seq_length, cfg.checkpoint_activations) * job.accumulation
    trow("TFLOPs per GPU", lambda t: f"{flops / t.iteration / 1e12:.1f}")
    batch = job.micro_batch * job.world * job.accumulation
    trow("samples/s", lambda t: f"{batch / t.iteration:.2f}")
    if len(plans) == 2:
        base, zpp = (plans[0], plans[1]) if plans[0].label == "ZeRO-3" else (plans[1], plans[0])
        out(f"   predicted speedup of ZeRO++ over ZeRO-3: {base.timing.iteration / zpp.timing.iteration:.2f}x")
    if job.train_iters:
        out(f"   training: {job.train_iters:,} iterations x global batch {batch} x seq {job.seq_length} = "
            f"{job.train_iters * batch * job.seq_length / 1e9:.1f} B tokens; "
            + ", ".join(f"{short(p.zero)} {_duration(job.train_iters * p.timing.iteration)}" for p in plans))
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds / 86400:.1f} days" if seconds >= 2 * 86400 else f"{seconds / 3600:.1f} hours"


def print_plan(args) -> None:
    """`train.py --dry-run`: plan and print; no process group, no memory, no data."""
    job, cluster, trace, plans = build_plan(args)
    print(format_plan(job, cluster, trace, plans), flush=True)


__all__ = ["Job", "ConfigPlan", "plan_config", "build_plan", "format_plan", "print_plan"]
