"""One rank's side of the fault matrix (scenarios/fault_matrix.py): the switches, a tiny GPT on
the engine, and the checks each cell of the matrix runs (a cell returns "" when it holds, else
what went wrong). Every rank runs every check: they are collective."""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import io
import json
import time

import torch
import torch.distributed as dist

import zeropp
from common import ConfigError
from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import topology_from_env

MODEL = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
             hidden_dropout=0.0, attention_dropout=0.0)
# Every value a switch key can take in the matrix (hpZ sizes up to the world).
SWITCH_VALUES = {
    "stage": [0, 1, 2, 3],
    "zero_quantized_weights": [False, True],
    "zero_hpz_partition_size": [1, 2, 4],
    "zero_quantized_gradients": [False, True],
    "zeropp_loco_param": [None, {"err_beta": 0.8, "reset_T": 3}],   # reset every 3: the count is carried state
    "zero_hadamard_gradients": [False, True],
    "zero_quantized_weight_deltas": [False, True],
    "zero_quantized_gradients_bits": [None, 2],   # None: the default, 4
    "zero_quantized_weight_deltas_bits": [None, 2],
}
SHORT = {"zero_quantized_weights": "qwZ", "zero_quantized_gradients": "qgZ", "zeropp_loco_param": "LoCo",
         "zero_hadamard_gradients": "Hadamard", "zero_quantized_weight_deltas": "deltas",
         "zero_quantized_gradients_bits": "INT2", "zero_quantized_weight_deltas_bits": "deltas2bit"}
STEPS, FAULT_AT = 5, 2          # steps of a run; the fault (and the save) after FAULT_AT steps
FAULTS = ("overflow", "nan", "resume", "reshard", "world", "toggle", "auto")


def accepted(zero: dict, world: int, ranks_per_node: int, sharding: str = "zero") -> bool:
    """Whether the config validator (and with `sharding` "fsdp2", FSDP2's) takes this
    zero_optimization section on this layout."""
    from zeropp.fsdp.engine import check_fsdp2_config
    try:
        cfg = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": zero})
        cfg.zero_optimization.validate_topology(ranks_per_node, world)
        if sharding == "fsdp2":
            check_fsdp2_config(cfg.zero_optimization, ranks_per_node, world)
    except ConfigError:
        return False
    return True


def name(zero: dict) -> str:
    parts = [f"s{zero['stage']}"]
    for k, v in zero.items():
        if k == "zero_hpz_partition_size" and v > 1:
            parts.append(f"hpZ{v}")
        elif k in SHORT and v not in (False, None, 4):   # 4: the default bits
            parts.append(SHORT[k])
    return "+".join(parts)


def ds_config(zero: dict, precision: str, sharding: str = "zero") -> dict:
    zero = dict(zero)
    if zero.get("zero_quantized_weight_deltas"):
        zero["zero_quantized_weight_deltas_refresh_interval"] = 3   # a refresh inside the run
    # A few buckets of the tiny GPT, not dozens: each bucket is gloo collectives,
    # and a collective costs more than the arithmetic here.
    buckets = {"reduce_bucket_size": 8000, "stage3_param_persistence_threshold": 0,
               "stage3_prefetch_bucket_size": 20000, "stage3_max_reuse_distance": 0}
    cfg = {"gradient_clipping": 1.0,   # FSDP2 refuses bucket sizes: it has units instead
           "zero_optimization": {**(buckets if sharding == "zero" else {}), **zero}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 1024}   # static: a skip changes nothing at all
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


_GROUPS: dict[tuple | None, list] = {}   # ranks -> the process groups made for them, in order


@contextlib.contextmanager
def pooled_groups():
    """Engines built in here take the process groups earlier engines made (the k-th group an
    engine asks for over some ranks is the k-th made for them), so hundreds of engines in one
    process do not make hundreds of gloo groups, each with threads of its own. Only one engine
    runs collectives at a time in the matrix, so sharing is safe."""
    asked: dict[tuple | None, int] = collections.Counter()
    new_group = dist.new_group

    def pooled(ranks=None, *args, **kwargs):
        key = tuple(ranks) if ranks is not None else None
        made = _GROUPS.setdefault(key, [])
        if asked[key] == len(made):
            made.append(new_group(ranks, *args, **kwargs))
        asked[key] += 1
        return made[asked[key] - 1]
    dist.new_group = pooled
    try:
        yield
    finally:
        dist.new_group = new_group


def rank_entry(fn):
    """A rank's entry to a matrix: the groups pooled_groups() made die with it, so a process that
    runs several matrices (the tests' pooled ranks, which destroy a call's groups) starts each
    on new ones and lets the old ones go."""
    @functools.wraps(fn)
    def entry(*args, **kwargs):
        _GROUPS.clear()
        try:
            return fn(*args, **kwargs)
        finally:
            _GROUPS.clear()
    return entry


def build(zero: dict, precision: str, ranks_per_node: int, sharding: str = "zero", topology=None):
    """The tiny GPT on the engine (`sharding` "fsdp2": FSDP2 + the plug-in) over the topology
    `topology()` makes (default: every rank, nodes of `ranks_per_node`)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    with pooled_groups():
        comm = Communicator(topology() if topology else topology_from_env(ranks_per_node))
        cfg = zeropp.DeepSpeedConfig.from_dict(ds_config(zero, precision, sharding))
        return zeropp.initialize(model, cfg, comm, torch.device("cpu"), zeropp.OptimizerSettings(lr=1e-2),
                                 sharding=sharding)


def run_cell(fn, *args) -> dict:
    start = time.perf_counter()
    try:
        problem = fn(*args)
    except Exception as e:   # a cell's crash is its verdict, not the matrix's end
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return {"ok": not problem, "why": problem, "seconds": time.perf_counter() - start}


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, MODEL["vocab_size"], (2, MODEL["max_position_embeddings"] + 1), generator=g)


def replicated_digest(engine) -> str:
    """What every rank must hold the same copy of: scalar state and replicated tensors."""
    h = hashlib.sha256(json.dumps(engine.scalar_state(), sort_keys=True, default=str).encode())
    for k, v in sorted(engine.checkpoint_state().items()):
        if not v.sharded:
            h.update(k.encode())
            h.update(v.local.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def train(engine, batches: list[int], fault: dict[int, float] | None = None) -> list[bool]:
    """One optimizer step per entry of `batches` (a batch index); `fault[i]` multiplies step i's
    loss on rank 0. Returns which steps were skipped; checks the ranks agree after each."""
    skipped = []
    for i, b in enumerate(batches):
        x = batch(b)
        loss = engine(x[:, :-1], x[:, 1:])
        if fault and i in fault and dist.get_rank() == 0:
            loss = loss * fault[i]
        engine.backward(loss)
        skipped.append(engine.step().skipped)
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, replicated_digest(engine))
        if len(set(digests)) != 1:
            raise AssertionError(f"ranks disagree on their replicated state after step {i}")
    return skipped


def state(engine) -> tuple[dict, dict]:
    return ({k: v.local.detach().clone() for k, v in engine.checkpoint_state().items()},
            json.loads(json.dumps(engine.scalar_state(), default=str)))


def differences(a: tuple[dict, dict], b: tuple[dict, dict], ignore=("loss_scaler",)) -> list[str]:
    out = [k for k in a[0] if k not in b[0] or not torch.equal(a[0][k], b[0][k])]
    out += [k for k in a[1] if k not in ignore and a[1][k] != b[1].get(k)]
    return out


def nonfinite(engine) -> list[str]:
    return [k for k, v in engine.checkpoint_state().items()
            if v.local.is_floating_point() and not torch.isfinite(v.local).all()]


def check_skip(zero: dict, precision: str, value: float, ranks_per_node: int, sharding: str = "zero") -> str:
    """A fault at step FAULT_AT: skipped everywhere, nothing carried changed, and the run ends
    where the run without it ends."""
    ref = build(zero, precision, ranks_per_node, sharding)
    train(ref, list(range(STEPS)))
    want = state(ref)
    run = build(zero, precision, ranks_per_node, sharding)
    train(run, list(range(FAULT_AT)))
    x = batch(FAULT_AT)
    loss = run(x[:, :-1], x[:, 1:])
    run.backward(loss * value if dist.get_rank() == 0 else loss)
    before = state(run)   # forward and backward done: what the step may change
    if not run.step().skipped:
        return "the faulty step was applied"
    changed = differences(before, state(run), ignore=("loss_scaler", "global_step", "skipped_steps"))
    if changed:
        return f"a skipped step changed {changed[:3]}"
    if nonfinite(run):
        return f"non-finite state after the skip: {nonfinite(run)[:3]}"
    if any(train(run, list(range(FAULT_AT, STEPS)))):
        return "a step after the fault was skipped"
    diff = differences(want, state(run), ignore=("loss_scaler", "global_step", "skipped_steps"))
    return f"ends unlike the run without the fault: {diff[:3]}" if diff else ""


def save(engine, path: str):
    """Real files; the parameters' shapes in the meta, so tools/export_checkpoint.py reads them."""
    from training.checkpoint import save_checkpoint
    shapes = {n: list(p.shape) for n, p in engine.module.named_parameters()}
    with contextlib.redirect_stdout(io.StringIO()):
        save_checkpoint(path, FAULT_AT, engine, 0, {"model_config": MODEL, "param_shapes": shapes})


def load(engine, path: str) -> list[str]:
    """Load and return the notes the load printed, what it reset (rank 0 prints them; every rank gets
    them): every line but Megatron's progress line, which every load prints."""
    from training.checkpoint import load_checkpoint
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        load_checkpoint(path, engine, load_rng=False)
    lines = [out.getvalue()]
    dist.broadcast_object_list(lines, src=0)
    return [line for line in lines[0].splitlines() if line.strip() and not line.startswith("> loading checkpoint from")]


def check_resume(zero: dict, path: str, ranks_per_node: int, sharding: str = "zero") -> str:
    run = build(zero, "fp32", ranks_per_node, sharding)
    train(run, list(range(FAULT_AT)))
    save(run, path)
    train(run, list(range(FAULT_AT, STEPS)))
    want = state(run)
    again = build(zero, "fp32", ranks_per_node, sharding)
    notes = load(again, path)
    if notes:
        return f"a same-layout load reset state: {notes}"
    if any(train(again, list(range(FAULT_AT, STEPS)))):
        return "a step after the load was skipped"
    diff = differences(want, state(again), ignore=())
    return f"not bit-identical after the load: {diff[:3]}" if diff else ""


def carried(zero: dict, nodes: int) -> dict[str, bool]:
    """Which carried states a job of `zero` on `nodes` nodes keeps in its checkpoints."""
    return {"error feedback": "zeropp_loco_param" in zero and zero.get("zero_quantized_gradients") is True
            and zero["stage"] == 3 and nodes > 1,
            "weight deltas": bool(zero.get("zero_quantized_weight_deltas"))}


def check_load_elsewhere(saved: dict, saved_layout: tuple[int, int], zero: dict, path: str,
                         ranks_per_node: int) -> str:
    """`path` (saved by `saved` on `saved_layout` = (world, nodes)) loaded by `zero` on this
    layout: goes on, and names in one line each carried state that resets, and no other."""
    nodes = dist.get_world_size() // ranks_per_node
    run = build(zero, "fp32", ranks_per_node)
    notes = load(run, path)
    was, now = carried(saved, saved_layout[1]), carried(zero, nodes)
    same_layout = (dist.get_world_size(), nodes) == tuple(saved_layout)
    for what in was:
        expect = (was[what] or now[what]) and not (was[what] and now[what] and (
            what == "weight deltas" or (same_layout and saved.get("zero_hadamard_gradients", False)
                                        == zero.get("zero_hadamard_gradients", False))))
        named = [n for n in notes if what in n]
        if expect and len(named) != 1:
            return f"the {what} reset is not named in one line: {notes}"
        if not expect and named:
            return f"names a {what} reset that did not happen: {named}"
    skipped = train(run, list(range(FAULT_AT, STEPS)))
    if any(skipped) or nonfinite(run):
        return "the loaded run does not go on (skipped steps or non-finite state)"
    return ""


def check_auto(zero: dict, ranks_per_node: int) -> str:
    """The base ZeRO++ switches "auto" (qgZ only where nothing else needs it on), resolved on a
    fast and a slow link: the choice validates and trains a step, or, where no choice works
    with the other switches, auto says so in one line (ConfigError)."""
    from planner.auto import choose
    from planner.cluster import Cluster
    from planner.plan import Job
    auto = dict(zero, zero_quantized_weights="auto", zero_hpz_partition_size="auto")
    if "zeropp_loco_param" not in zero and not zero.get("zero_hadamard_gradients") \
            and "zero_quantized_gradients_bits" not in zero:
        auto["zero_quantized_gradients"] = "auto"
    world = dist.get_world_size()
    problems = []
    for gbps in (100.0, 0.1):
        cluster = Cluster(nodes=world // ranks_per_node, gpus_per_node=ranks_per_node, gpu_memory_gb=16.0,
                          peak_flops=1e12, intra_node_gbps=100.0, intra_node_latency_us=5.0,
                          inter_node_gbps=gbps, inter_node_latency_us=50.0, name=f"{gbps} Gbit/s")
        try:
            ds = zeropp.DeepSpeedConfig.from_dict(ds_config(auto, "bf16"))
            job = Job(cfg=GPTConfig(**MODEL), ds=ds, optimizer=zeropp.OptimizerSettings(), world=world,
                      ranks_per_node=ranks_per_node, micro_batch=2, seq_length=MODEL["max_position_embeddings"],
                      accumulation=1)
            with contextlib.redirect_stdout(io.StringIO()):
                chosen = choose(job, cluster)[0]
            chosen.validate()
            chosen.validate_topology(ranks_per_node, world)
        except ConfigError as e:   # no candidate works with the other switches: one line is the answer
            if "\n" in str(e) or not str(e):
                problems.append(f"{cluster.name}: not one line: {e!r}")
            continue
        keys = list(SWITCH_VALUES) + ["zero_quantized_weight_deltas_refresh_interval"]
        picked = {k: getattr(chosen, k) for k in keys if k != "zeropp_loco_param" and hasattr(chosen, k)}
        if "zeropp_loco_param" in zero:
            picked["zeropp_loco_param"] = zero["zeropp_loco_param"]
        picked.pop("zero_quantized_weight_deltas_refresh_interval", None)
        if any(train(build(picked, "bf16", ranks_per_node), [0])):
            problems.append(f"{cluster.name}: the chosen {name(picked)} skipped its step")
    return "; ".join(problems)


