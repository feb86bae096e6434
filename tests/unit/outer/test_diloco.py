"""Streaming DiLoCo across groups of nodes (zeropp/outer/diloco.py) on 4 gloo ranks as 2 nodes x 2
(and 4 nodes x 1 for ZeRO++ across the nodes of a group), ZeRO-3 inside each group.

- an engine over a group of ranks trains as the same engine run alone on those ranks' data,
  bit for bit, with the same bytes inside and across nodes;
- one group (the whole job) with outer lr 1 and no momentum is the engine without the mode,
  bit for bit (the outer step then sets the masters to the mean of one local: itself);
- H = 1, outer lr 1, no momentum, exact exchange, SGD inside: synchronous data parallel over
  all 4 ranks, within the fp32 round-off the plain engine shows against fp64 (tests/numerics.py);
- H = 1 with AdamW inside: parameter averaging after every step, bit for bit;
- a warm-up: synchronous data parallel over all 4 ranks with the job's gradient clipping, the
  groups identical bit for bit, the global parameters theirs, the first exchange after it;
- INT4 outer gradients: the new global parameters within the block quantization's bound of
  the exact mean, the error feedback what quantization left;
- the streaming schedule: fragments at staggered steps (equal parts of each shard), applied one
  step later, the groups' global copies identical;
- a non-finite fragment in one group (INT4 and topk2 outer gradients): one outer step skipped everywhere, that group takes the
  global values, the next exchange is everyone's;
- fp16 with groups whose loss scalers differ: each group's scalar state comes back to it, and
  the resume is exact.
"""
import pytest
import torch
import torch.distributed as dist

import zeropp
from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import topology_from_env
from tests.distributed import run_distributed, train_ranks
from tests.numerics import EPS32, assert_state_within_roundoff, fp64_reference
from zeropp.collectives.partition import Partition
from planner.comm import rank_bytes
from zeropp.outer.diloco import PHASE, WARMUP, OuterSettings, attach, exchange_per_step
from zeropp.outer.edges import final_sync
from zeropp.kernels.format import QMAX

CFG = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
SEQ, PER_RANK, LR = 16, 2, 1e-2
BLOCK = 128


def batches(steps, ranks):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (ranks * PER_RANK, SEQ + 1), generator=g) for _ in range(steps)]


def build(topo, zero=None, optim=None, clip=0.0):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    ds = zeropp.DeepSpeedConfig.from_dict({"gradient_clipping": clip, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
        "stage3_param_persistence_threshold": 16, "stage3_prefetch_bucket_size": 20000, **(zero or {})}})
    return zeropp.initialize(model, ds, Communicator(topo), torch.device("cpu"), optim or zeropp.OptimizerSettings(lr=LR))


def train(engine, data, index, after_step=None):
    """Steps on rows [index * PER_RANK, ...) of each batch."""
    for batch in data:
        x = batch[index * PER_RANK:(index + 1) * PER_RANK]
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        if after_step is not None:
            after_step()
    return engine.module_state_dict()


def cross_partition(topo):
    return Partition(group=topo.across_group, size=topo.groups, rank=topo.offset // topo.world_size)


def diloco(job, nodes, settings, optim=None, zero=None, clip=0.0):
    topo = job.group_topology(nodes).build_groups()
    engine = build(topo, zero, optim, clip)
    return engine, attach(engine, cross_partition(topo), settings), topo


def local_flat(sync, f=0):
    return sync.local(f)


def scenarios(rank, world, tmp):
    """Every 4-rank scenario below in one set of processes (each its own groups and engines)."""
    out = {fn.__name__: fn(rank, world) for fn in (group_runs, one_group, sgd_runs, averaging_runs, warmup_runs,
                                                    warmup_faults, int4_runs, streaming_runs)}
    out["resume_runs"] = resume_runs(rank, world, tmp)
    out["delayed_resume"] = delayed_resume(rank, world, tmp)
    out["warmup_resume"] = warmup_resume(rank, world, tmp)
    out["nonfinite_runs"] = nonfinite_runs(rank, world)
    out["nonfinite_topk2"] = nonfinite_runs(rank, world, "topk2")
    out["fp16_resume"] = fp16_resume(rank, world, tmp)
    out["final_runs"] = final_runs(rank, world, tmp)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("diloco"))
    per_rank = run_distributed(scenarios, world_size=4, args=(tmp,))
    return {"tmp": tmp, **{name: [r[name] for r in per_rank] for name in per_rank[0]}}


# -- an engine over a group of ranks -------------------------------------------------------------

GROUP_CASES = [(2, 1, {}),   # 2 nodes x 2, a group per node: ZeRO-3
               (1, 2, {"zero_quantized_weights": True, "zero_quantized_gradients": True})]  # 4 x 1: ZeRO++


def group_runs(rank, world):
    out = []
    for per_node, nodes, zero in GROUP_CASES:
        topo = topology_from_env(per_node).group_topology(nodes).build_groups()
        engine = build(topo, zero)
        sd = train(engine, batches(3, topo.world_size), topo.rank)
        s = engine.comm.stats
        out.append((sd, s.intra_node_bytes, s.inter_node_bytes, topo.ranks))
    return out


def alone_runs(rank, world):
    out = []
    for per_node, _, zero in GROUP_CASES:
        engine = build(topology_from_env(per_node), zero)
        sd = train(engine, batches(3, world), rank)
        out.append((sd, engine.comm.stats.intra_node_bytes, engine.comm.stats.inter_node_bytes))
    return out


@pytest.mark.slow
def test_group_engine_trains_as_the_engine_alone(runs):
    groups = runs["group_runs"]
    alone = run_distributed(alone_runs, world_size=2)
    for rank, cases in enumerate(groups):
        for (sd, intra, inter, ranks), ref, (per_node, nodes, _) in zip(cases, alone[rank % 2], GROUP_CASES):
            assert ranks == [rank // 2 * 2, rank // 2 * 2 + 1]
            for k, v in ref[0].items():
                assert torch.equal(sd[k], v), (per_node, nodes, k)
            assert (intra, inter) == ref[1:], (per_node, nodes)
    assert groups[0][1][2] > 0 and groups[0][0][2] == 0   # ZeRO++ case crosses nodes; the other does not


# -- one group is the engine --------------------------------------------------------------------

def one_group(rank, world):
    job = topology_from_env(2)
    plain = train(build(job), batches(4, world), rank)
    engine, sync, _ = diloco(job, 2, OuterSettings(2, lr=1.0, momentum=0.0, fragments=2, delay=0))
    mode = train(engine, batches(4, world), rank)
    return plain, mode, sync.outer_steps


def test_one_group_is_the_engine_bit_for_bit(runs):
    for plain, mode, outer_steps in runs["one_group"]:
        assert outer_steps == 4   # 2 fragments, each at steps 1 and 3 or 2 and 4 (H = 2)
        for k, v in plain.items():
            assert torch.equal(mode[k], v), k


# -- H = 1 ----------------------------------------------------------------------------------------

SGD = zeropp.OptimizerSettings(type="sgd", lr=0.1, weight_decay=0.01)
EVERY_STEP = OuterSettings(1, lr=1.0, momentum=0.0, fragments=2, delay=0)


def sgd_runs(rank, world):
    job = topology_from_env(2)
    data = batches(4, world)
    single = train(build(job, optim=SGD), data, rank)
    engine, _, _ = diloco(job, 1, EVERY_STEP, optim=SGD)
    return single, train(engine, data, rank)


def test_every_step_with_sgd_is_synchronous_data_parallel(runs):
    data = batches(4, 4)
    torch.manual_seed(0)
    steps = [[lambda m, x=x: m(x[:, :-1], x[:, 1:])] for x in data]
    _, _, exact = fp64_reference(GPT(GPTConfig(**CFG)), steps, lr=SGD.lr, clip=0.0, optimizer="sgd",
                                 weight_decay=SGD.weight_decay)
    for single, got in runs["sgd_runs"]:
        assert_state_within_roundoff(got, single, exact, "H=1 SGD vs synchronous data parallel")


# -- a synchronous warm-up --------------------------------------------------------------------------

CLIPPED = 0.05   # below every step's gradient norm here: a group's own norm would clip otherwise


def warmup_runs(rank, world):
    job = topology_from_env(2)
    data = batches(4, world)
    single = train(build(job, optim=SGD, clip=CLIPPED), data, rank)
    engine, sync, _ = diloco(job, 1, OuterSettings(2, fragments=2, warmup=4), optim=SGD, clip=CLIPPED)
    warm = train(engine, data, rank)
    global_is_local = all(torch.equal(sync.glob[f], sync.local(f)) for f in range(2))
    warm_bytes = engine.comm.stats.by_phase[WARMUP][1]
    train(engine, batches(3, world), rank)   # steps 5-7: exchanges after each, those of 5 and 6 merged
    return single, warm, global_is_local, warm_bytes, sync.outer_steps, engine.comm.stats.by_phase[WARMUP][1]


def test_a_warm_up_is_synchronous_data_parallel_then_the_groups_exchange(runs):
    data = batches(4, 4)
    torch.manual_seed(0)
    steps = [[lambda m, x=x: m(x[:, :-1], x[:, 1:])] for x in data]
    _, norms, exact = fp64_reference(GPT(GPTConfig(**CFG)), steps, lr=SGD.lr, clip=CLIPPED, optimizer="sgd",
                                     weight_decay=SGD.weight_decay)
    assert min(norms) > CLIPPED
    results = runs["warmup_runs"]
    for rank, (single, warm, global_is_local, warm_bytes, outer_steps, bytes_after) in enumerate(results):
        assert_state_within_roundoff(warm, single, exact, "warm-up vs synchronous data parallel")
        for k, v in results[rank % 2][1].items():   # the same rank of the other group: the same model
            assert torch.equal(warm[k], v), k
        assert global_is_local and warm_bytes > 0
        assert outer_steps == 2 and bytes_after == warm_bytes   # no warm-up all-reduce after it


def warmup_faults(rank, world):
    """An fp16 overflow, then (fp32) a NaN loss, on rank 0 only (group 0) at the second of 3
    warm-up steps (scenarios/fault_modes.py's engines and fault injection)."""
    from scenarios.fault_modes import Grouped
    out = []
    for precision, value in (("fp16", float("inf")), ("fp32", float("nan"))):
        run = Grouped({"stage": 3}, precision, 2, 1, OuterSettings(2, fragments=2, warmup=3))
        skipped = run.train([0, 1, 2], fault={1: value})   # (train() checks the groups' global copies agree)
        sd = run.engine.module_state_dict()
        out.append((skipped, run.engine.loss_scaler.scale, sd))
        run.sync.drain()
    return out


def test_a_fault_in_one_group_during_the_warm_up_skips_the_step_in_every_group(runs):
    results = runs["warmup_faults"]
    for rank, cases in enumerate(results):
        for case, ((skipped, scale, sd), (_, other_scale, other)) in enumerate(zip(cases, results[(rank + 2) % 4])):
            assert skipped == [False, True, False], (rank, case)   # as one job: every group skips it
            assert scale == other_scale == results[0][case][1]
            for k, v in sd.items():
                assert torch.isfinite(v).all() and torch.equal(v, other[k]), (rank, case, k)


def averaging_runs(rank, world):
    job = topology_from_env(2)
    data = batches(3, world)
    ref = build(job.group_topology(1).build_groups())
    cross = cross_partition(ref.comm.topology)

    def average():   # parameter averaging through the state dict: another path than the outer step
        sd = ref.module_state_dict()
        for v in sd.values():
            dist.all_reduce(v, group=cross.group)
            v.div_(cross.size)
        ref.load_module_state_dict(sd)
    averaged = train(ref, data, rank, after_step=average)
    engine, _, _ = diloco(job, 1, EVERY_STEP)
    return averaged, train(engine, data, rank)


def test_every_step_with_adamw_is_parameter_averaging(runs):
    results = runs["averaging_runs"]
    for averaged, got in results:
        for k, v in averaged.items():
            assert torch.equal(got[k], v), k
    assert all(torch.equal(results[0][1][k], results[2][1][k]) for k in results[0][1])   # groups agree


# -- INT4 outer gradients -------------------------------------------------------------------------

def int4_runs(rank, world):
    job = topology_from_env(2)
    data = batches(2, world)
    plain = build(job.group_topology(1).build_groups())
    engine, sync, _ = diloco(job, 1, OuterSettings(2, lr=1.0, momentum=0.0, quantization="int4", delay=0))
    start = sync.glob[0].clone()
    train(plain, data, rank)   # the locals the outer step starts from (it runs after step 2)
    mine = start - torch.cat([s.master.detach().reshape(-1) for s in plain.shards if s.valid])
    train(engine, data, rank)
    everyone = [torch.empty_like(mine) for _ in range(sync.cross.size)]
    dist.all_gather(everyone, mine, group=sync.cross.group)
    return start, torch.stack(everyone), sync.glob[0].clone(), local_flat(sync), sync.err[0].clone(), sync.cross.rank


def block_half_steps(d):
    """Per element, half the INT4 step of its block: max|block| / 7 / 2 (zeropp/kernels/quant.py)."""
    n = d.numel()
    padded = torch.nn.functional.pad(d.abs(), (0, -n % BLOCK)).view(-1, BLOCK)
    return (padded.amax(dim=1, keepdim=True) / QMAX[4] / 2).expand(-1, BLOCK).reshape(-1)[:n]


def test_int4_outer_gradients_within_the_block_bound(runs):
    for start, deltas, glob, local, err, me in runs["int4_runs"]:
        exact = start.double() - deltas.double().mean(0)
        halves = torch.stack([block_half_steps(d.double()) for d in deltas])
        slack = 4 * EPS32 * (start.double().abs() + deltas.double().abs().max(0).values)
        assert ((glob.double() - exact).abs() <= halves.mean(0) + slack).all()
        assert not torch.equal(glob.double(), exact)   # quantized: not the exact mean
        assert torch.equal(local, glob)                # the masters are the new global
        assert torch.isfinite(err).all() and err.abs().max() > 0   # what my quantization left
        assert (err.double().abs() <= halves[me] + slack).all()


def nonfinite_runs(rank, world, quantization="int4"):
    import warnings
    job = topology_from_env(2)
    engine, sync, _ = diloco(job, 1, OuterSettings(1, quantization=quantization, delay=0, topk_fraction=0.05))
    data = batches(3, world)
    train(engine, data[:1], rank)
    before = sync.glob[0].clone(), sync.err[0].clone(), sync.mom[0].clone()
    if rank == 0:   # one weight of group 0 goes bad: its shard's outer gradient is not finite
        sync.owned[0].master.view(-1)[0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(engine, data[1:2], rank)
    after = sync.glob[0], sync.err[0], sync.mom[0]
    unchanged = [torch.equal(a, b) for a, b in zip(before, after)]
    reseeded = torch.equal(sync.local(0), sync.glob[0])   # the bad group's copy: the global values
    steps = sync.outer_steps
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        train(engine, data[2:], rank)   # the next exchange: every group again
    finite = all(bool(torch.isfinite(t).all()) for t in (sync.err[0], sync.glob[0], sync.local(0)))
    return (unchanged, finite, [str(w.message) for w in caught], reseeded, sync.outer_steps - steps,
            [str(w.message) for w in later], sync.glob[0].clone())


@pytest.mark.parametrize("case", ["nonfinite_runs", "nonfinite_topk2"])
def test_a_non_finite_fragment_skips_one_outer_step_and_the_bad_group_takes_the_global_values(runs, case):
    results = runs[case]
    for rank, (unchanged, finite, caught, reseeded, steps, later, glob) in enumerate(results):
        assert finite
        # ranks 0 and 2 hold the bad shard; every rank skips the fragment's outer step with them
        assert unchanged == [True, True, True], rank
        assert any("outer step of fragment 0 skipped: its outer gradient is not finite" in c for c in caught)
        # group 0 (ranks 0, 1) says it and starts again from the global values; group 1 goes on
        said = any("group 0's copy is not: it takes the global values" in c for c in caught)
        assert said == (rank < 2) and (reseeded or rank >= 2)
        assert steps == 1 and not later   # the next exchange is every group's again
        assert torch.equal(glob, results[rank ^ 2][-1])   # the same global values in both groups


# -- the end of training -----------------------------------------------------------------------------

def final_runs(rank, world, tmp):
    """Three steps with H = 100 (no exchange yet), saved; then the final synchronization."""
    from training.checkpoint import save_checkpoint
    engine, sync, _ = diloco(topology_from_env(2), 1, OuterSettings(100, fragments=2, quantization="int4"))
    train(engine, batches(3, world), rank)
    meta = {"model_config": {}, "param_shapes": {n: list(p.shape) for n, p in engine.module.named_parameters()}}
    save_checkpoint(f"{tmp}/before_final", 3, engine, 0, meta)
    before = [sync.local(f) for f in range(2)]
    final_sync(sync)
    return (before, [sync.local(f) for f in range(2)], [g.clone() for g in sync.glob],
            [bool(e.eq(0).all()) for e in sync.err], engine.module_state_dict())


def test_the_final_synchronization_is_the_exact_mean_and_the_export_of_a_running_job_gives_it(runs):
    from tools.export_checkpoint import consolidated_state_dict
    results = runs["final_runs"]
    for rank, (before, after, glob, error_zero, trained) in enumerate(results):
        peer = results[rank ^ 2][0]   # the same shard in the other group
        for f in range(2):
            mean = (before[f] + peer[f]) / 2
            assert not torch.equal(before[f], peer[f])        # the groups trained apart
            assert torch.equal(after[f], mean) and torch.equal(glob[f], mean), (rank, f)
        assert error_zero == [True, True]                     # nothing of the drift is left unsent
        assert all(torch.equal(v, results[rank ^ 2][-1][k]) for k, v in trained.items())   # one model
    exported, meta = consolidated_state_dict(runs["tmp"] + "/before_final", average_groups=True)
    assert meta["groups"] == 2
    assert all(torch.equal(exported[k], v) for k, v in results[0][-1].items())
    initial, _ = consolidated_state_dict(runs["tmp"] + "/before_final")   # the global parameters: no exchange yet
    assert any(not torch.equal(initial[k], v) for k, v in exported.items())


def test_average_groups_of_a_one_group_checkpoint_is_one_line(runs, capsys):
    from tools.export_checkpoint import main
    with pytest.raises(SystemExit) as stop:
        main(["--load", runs["tmp"] + "/plain", "--format", "torch", "--output", runs["tmp"] + "/x.pt",
              "--average-groups"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert "--average-groups: " in err and "was saved by one group (no --outer-sync-interval); drop it" in err


# -- streaming ---------------------------------------------------------------------------------------

def streaming_runs(rank, world):
    job = topology_from_env(2)
    engine, sync, _ = diloco(job, 1, OuterSettings(4, fragments=2))
    issued, drift = [], []
    train(engine, batches(8, world), rank, after_step=lambda: (issued.append([x.fragment for x in sync.pending]),
                                                               drift.append(sync.drift)))
    in_flight = sync.drain()
    sent = engine.comm.stats.by_phase[PHASE]
    peaks = engine.peak_buffers()
    return (issued, sync.outer_steps, [g.clone() for g in sync.glob], [sync.due(s) for s in range(1, 9)],
            sent, sum(g.numel() for g in sync.glob), sync.s,
            (in_flight, drift, peaks["outer_exchange_peak"], peaks["outer_exchange_bound"],
             max(g.numel() for g in sync.glob)))


def test_streaming_fragments_at_staggered_steps(runs):
    results = runs["streaming_runs"]
    for rank, (issued, outer_steps, glob, due, sent, owned, settings, (in_flight, drift, peak, bound, largest)) \
            in enumerate(results):
        assert due == [[], [1], [], [0], [], [1], [], [0]]
        assert issued == due                    # in flight for one inner step after its issue
        assert outer_steps == 3 and in_flight == 1   # the last, issued at step 8, completed unapplied
        # the drift: none before the first outer step (step 3), then the group's, the same on its ranks
        assert all(d != d for d in drift[:2]) and all(d > 0 for d in drift[2:])
        assert drift[2:] == results[rank ^ 1][-1][1][2:]
        # in flight: one fragment at a time (exact: my locals to sum and my outer gradient), within the bound
        assert 0 < peak <= bound == 8 * largest
        assert max(g.numel() for g in glob) - min(g.numel() for g in glob) <= 1   # cut by bytes: balanced
        for a, b in zip(glob, results[rank ^ 2][2]):   # the same rank of the other group
            assert torch.equal(a, b)
        # the planner's bytes per inner step (planner/outer.py) are what the 8 steps sent, across nodes
        c = exchange_per_step(owned, settings)
        assert sent == [0, 8 * sum(rank_bytes(c.op, (rank % 2, rank % 2 + 2), rank, c.nbytes, 2))] and sent[1] > 0


# -- checkpoints ---------------------------------------------------------------------------------------

META = {"model_config": {}, "param_shapes": {}}


def resume_runs(rank, world, tmp):
    from training.checkpoint import load_checkpoint, save_checkpoint
    job = topology_from_env(2)
    settings = OuterSettings(2, fragments=2, quantization="int4")   # momentum, error, an exchange in flight
    data = batches(6, world)
    engine, sync, _ = diloco(job, 1, settings)
    train(engine, data[:3], rank)
    meta = {"model_config": {}, "param_shapes": {n: list(p.shape) for n, p in engine.module.named_parameters()}}
    save_checkpoint(f"{tmp}/grouped", 3, engine, 0, meta, consolidated_16bit=True)
    saved_global = {k: v.local.clone() for k, v in sync.checkpoint_state(2).items() if ".global." in k}
    full = train(engine, data[3:], rank)
    engine, _, _ = diloco(job, 1, settings)
    straight = train(engine, data, rank)   # never saved: a save must not change the run
    engine, again, _ = diloco(job, 1, settings)
    load_checkpoint(f"{tmp}/grouped", engine)
    resumed = train(engine, data[3:], rank)
    regrouped = build(job)   # one group of 4: from the global parameters the 2 groups shared
    load_checkpoint(f"{tmp}/grouped", regrouped)
    regrouped = regrouped.module_state_dict()
    plain = build(job)   # a checkpoint of one group: every group starts from it, the outer state from its weights
    train(plain, data[:2], rank)
    save_checkpoint(f"{tmp}/plain", 2, plain, 0, META)
    engine, fresh, _ = diloco(job, 1, settings)
    load_checkpoint(f"{tmp}/plain", engine)
    return (full, resumed, straight, sync.outer_steps, again.outer_steps, plain.module_state_dict(),
            engine.module_state_dict(), torch.equal(local_flat(fresh), fresh.glob[0]), fresh.steps, regrouped,
            saved_global)


def warmup_resume(rank, world, tmp):
    """Saved in the middle of a warm-up of 2 steps, resumed and trained to step 5 (exchanges after
    steps 3, 4, 5), against the run that never stopped."""
    from training.checkpoint import load_checkpoint, save_checkpoint
    job = topology_from_env(2)
    settings = OuterSettings(2, fragments=2, quantization="int4", warmup=2)
    data = batches(5, world)
    engine, _, _ = diloco(job, 1, settings)
    straight = train(engine, data, rank)
    engine, _, _ = diloco(job, 1, settings)
    train(engine, data[:1], rank)
    save_checkpoint(f"{tmp}/warm", 1, engine, 0, META)
    engine, sync, _ = diloco(job, 1, settings)
    load_checkpoint(f"{tmp}/warm", engine)
    return straight, train(engine, data[1:], rank), sync.outer_steps


def test_a_resume_in_the_middle_of_the_warm_up_is_exact(runs):
    for straight, resumed, outer_steps in runs["warmup_resume"]:
        for k, v in straight.items():
            assert torch.equal(resumed[k], v), k
        assert outer_steps == 2   # the exchanges after steps 3 and 4, merged a step later


def delayed_resume(rank, world, tmp):
    """Merged 2 steps after issue, exact exchange, saved in the background after step 3: the
    exchange issued at step 2 is in flight and the masters have moved since."""
    from training.checkpoint import load_checkpoint, save_checkpoint
    job = topology_from_env(2)
    settings = OuterSettings(4, fragments=2, delay=2)
    data = batches(6, world)
    engine, sync, _ = diloco(job, 1, settings)
    straight = train(engine, data, rank)
    engine, sync, _ = diloco(job, 1, settings)
    train(engine, data[:3], rank)
    in_flight = [(x.fragment, x.merge_at) for x in sync.pending]
    meta = {"model_config": {}, "param_shapes": {n: list(p.shape) for n, p in engine.module.named_parameters()}}
    pending = save_checkpoint(f"{tmp}/delayed", 3, engine, 0, meta, async_group=dist.new_group(backend="gloo"))
    saving = train(engine, data[3:], rank)
    pending.finish()
    engine, again, _ = diloco(job, 1, settings)
    load_checkpoint(f"{tmp}/delayed", engine)
    loaded = [(x.fragment, x.merge_at, x.stepped) for x in again.pending]
    return straight, saving, train(engine, data[3:], rank), in_flight, loaded


def fp16_resume(rank, world, tmp):
    """fp16, dynamic loss scale: group 0 overflows at its first step (its scale set too high),
    group 1 does not; saved after 3 steps, loaded, 3 more steps."""
    from training.checkpoint import load_checkpoint, save_checkpoint
    job = topology_from_env(2)
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 1}}
    settings = OuterSettings(2, fragments=2)
    data = batches(6, world)

    def fresh():
        topo = job.group_topology(1).build_groups()
        torch.manual_seed(0)
        ds = zeropp.DeepSpeedConfig.from_dict({**fp16, "zero_optimization": {
            "stage": 3, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
            "stage3_param_persistence_threshold": 16, "stage3_prefetch_bucket_size": 20000}})
        engine = zeropp.initialize(GPT(GPTConfig(**CFG)), ds, Communicator(topo), torch.device("cpu"),
                                   zeropp.OptimizerSettings(lr=LR))
        return engine, attach(engine, cross_partition(topo), settings)

    engine, _ = fresh()
    if rank < 2:
        engine.loss_scaler.scale = 2.0 ** 19   # fp16's largest is 65504: this group's first steps overflow
    train(engine, data[:3], rank)
    meta = {"model_config": {}, "param_shapes": {n: list(p.shape) for n, p in engine.module.named_parameters()}}
    saved = engine.scalar_state()
    save_checkpoint(f"{tmp}/fp16", 3, engine, 0, meta)
    straight = train(engine, data[3:], rank)
    engine, _ = fresh()
    load_checkpoint(f"{tmp}/fp16", engine)
    loaded = engine.scalar_state()
    return saved, loaded, straight, train(engine, data[3:], rank)


def test_fp16_resume_restores_each_groups_loss_scale_and_skipped_steps(runs):
    results = runs["fp16_resume"]
    for rank, (saved, loaded, straight, resumed) in enumerate(results):
        assert (0 < saved["skipped_steps"] < 3) if rank < 2 else saved["skipped_steps"] == 0, saved   # they differ
        assert saved["loss_scaler"] != results[rank ^ 2][0]["loss_scaler"]
        for key in ("loss_scaler", "skipped_steps", "global_step"):
            assert loaded[key] == saved[key], (rank, key)
        for k, v in straight.items():
            assert torch.equal(resumed[k], v), (rank, k)


def test_a_delayed_merge_resumes_exactly_from_a_background_save(runs):
    for straight, saving, resumed, in_flight, loaded in runs["delayed_resume"]:
        assert in_flight == [(1, 4)] and loaded == [(1, 4, True)]   # issued at 2, merged after 4
        for k, v in straight.items():
            assert torch.equal(saving[k], v) and torch.equal(resumed[k], v), k


def test_resume_is_exact_and_a_plain_checkpoint_starts_every_group(runs):
    """Same layout: bit for bit, the exchange in flight at the save included (a resume issues it
    again), and as a run that never saved. A one-group checkpoint: every group from it, the outer
    state reset."""
    for (full, resumed, straight, outer_steps, outer_steps_resumed, plain, started, glob_is_local, steps,
         _, _) in runs["resume_runs"]:
        for k, v in straight.items():
            assert torch.equal(resumed[k], v) and torch.equal(full[k], v), k
        assert outer_steps == outer_steps_resumed == 5   # 6 issued, the last in flight
        for k, v in plain.items():
            assert torch.equal(started[k], v), k
        assert glob_is_local and steps == 0   # the outer state reset to the loaded weights


def test_export_and_another_number_of_groups_take_the_global_parameters(runs):
    from tools.export_checkpoint import consolidated_state_dict
    per_rank = [r[-1] for r in runs["resume_runs"]]
    exported, meta = consolidated_state_dict(runs["tmp"] + "/grouped")
    assert meta["groups"] == 2 and exported
    # stage3_gather_16bit_weights_on_model_save's file (fp32 here, the compute dtype): group 0's global parameters
    whole = torch.load(runs["tmp"] + "/grouped/iter_0000003/pytorch_model.bin", weights_only=True)
    assert list(whole) == list(exported) and all(torch.equal(whole[k], v) for k, v in exported.items())
    for regrouped in (r[-2] for r in runs["resume_runs"]):
        assert all(torch.equal(regrouped[k], v) for k, v in exported.items())
    for name, weight in exported.items():
        mine = [per_rank[r][f"outer_sync.global.{name}"] for r in (0, 1)]   # group 0's two shards
        assert torch.equal(weight.view(-1), torch.cat(mine))
        assert torch.equal(torch.cat([per_rank[r][f"outer_sync.global.{name}"] for r in (2, 3)]), weight.view(-1))


# -- bad input: one line each, exit 2, before any work -----------------------------------------------

from tests.integration.inputs.test_cli_errors import corpus, fails, good   # noqa: E402,F401 (corpus: the fixture)

OUTER = ("--zero-stage", "3", "--outer-sync-interval", "4")


@pytest.mark.parametrize("world, per_node, extra, says", [
    (4, 2, ("--zero-stage", "3", "--outer-sync-interval", "0"), "--outer-sync-interval: must be >= 1, got 0"),
    (4, 2, OUTER + ("--outer-fragments", "5"), "--outer-fragments 5 exceeds --outer-sync-interval 4 (each fragment"),
    (4, 2, OUTER + ("--outer-sync-delay", "0", "--outer-merge-alpha", "0.3"),
     "--outer-merge-alpha 0.3 has no effect with --outer-sync-delay 0"),
    (4, 2, OUTER + ("--outer-merge-alpha", "1"), "--outer-merge-alpha: must be in [0, 1), got 1"),
    (4, 2, OUTER + ("--outer-sync-delay", "4"), "--outer-sync-delay 4 must be below --outer-sync-interval 4"),
    (6, 2, OUTER + ("--group-size", "2"), "--group-size 2 must divide the 3 node(s)"),
    (2, 1, OUTER, "--group-size 1 makes groups of one rank"),
    (4, 2, ("--zero-stage", "2", "--outer-sync-interval", "4"), "this run is ZeRO stage 2; pass --zero-stage 3"),
    (4, 2, ("--zero-stage", "3", "--outer-lr", "0.5"), "--outer-lr has no effect without --outer-sync-interval"),
    (4, 2, ("--zero-stage", "3", "--outer-warmup-iters", "10"),
     "--outer-warmup-iters has no effect without --outer-sync-interval"),
    (4, 2, OUTER + ("--no-load-optim",), "--no-load-optim does not reset the outer state"),
    (4, 2, OUTER + ("--sharding", "fsdp2"), "runs this application's engine in each group; drop --sharding fsdp2"),
    (1, 1, OUTER + ("--dry-run", "--cluster", "configs/clusters/v100_4x16_100gbps.yaml", "--group-size", "3"),
     "--group-size 3 must divide the 4 nodes of --cluster configs/clusters/v100_4x16_100gbps.yaml"),
    # a job of one node without --ranks-per-node: what is wrong is the node, not --group-size
    (4, 4, OUTER, "--outer-sync-interval 4 synchronizes groups of nodes, and this job is one node of 4 ranks "
                  "(torchrun's --nproc-per-node, LOCAL_WORLD_SIZE); pass --ranks-per-node 2"),
    (2, 2, OUTER, "this job is one node of 2 ranks (torchrun's --nproc-per-node, LOCAL_WORLD_SIZE); run 4+ ranks"),
    (8, 2, OUTER + ("--group-size", "4"), "--group-size 4 makes one group of the 4 node(s) of 2 rank(s): there is no "
                                          "other group to synchronize with; pass --group-size 1 or 2"),
    # the dry run refuses the layouts training refuses (one function, planner/outer.py calls it)
    (1, 1, OUTER + ("--dry-run", "--cluster", "configs/clusters/v100_4x16_100gbps.yaml", "--group-size", "4"),
     "--group-size 4 makes one group of the 4 nodes of --cluster configs/clusters/v100_4x16_100gbps.yaml"),
    (1, 1, OUTER + ("--dry-run", "--cluster", "configs/clusters/v100_1x8.yaml"),
     "this job is one node of 8 ranks (--cluster configs/clusters/v100_1x8.yaml); plan a --cluster of 2+ nodes"),
])
def test_bad_outer_input(corpus, capsys, monkeypatch, world, per_node, extra, says):  # noqa: F811
    monkeypatch.setenv("WORLD_SIZE", str(world))   # as torchrun sets them, before any process group
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    fails(good(corpus, *extra), capsys, says)


def test_a_warmup_as_long_as_the_run_says_there_is_no_exchange(corpus, capsys, monkeypatch):  # noqa: F811
    from training.args import parse_args
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    parse_args(good(corpus, *OUTER, "--outer-warmup-iters", "1"))   # 2 iterations: one exchange after the warm-up
    assert "> note:" not in capsys.readouterr().out
    parse_args(good(corpus, *OUTER, "--outer-warmup-iters", "5"))
    assert "> note: --outer-warmup-iters 5 covers all 2 iterations of the run: it trains as one synchronous job " \
           "throughout, with no exchange between the groups" in capsys.readouterr().out


def test_the_drift_is_na_on_log_lines_before_an_exchange_is_merged(tmp_path, capsys):
    """A run's (or a resume's) first log lines come before any merged exchange: no drift yet,
    said as n/a, and no point in TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from training.logger import TrainingLogger
    logger = TrainingLogger(str(tmp_path / "tb"))
    line = {"consumed": 8, "iter_ms": 1.0, "lr": 1e-3, "global_batch": 8, "loss": 5.0, "loss_scale": 1.0,
            "grad_norm": 1.0, "skipped": 0, "nan": 0, "samples_per_s": 1.0, "tokens_per_s": 1.0, "tflops": 0.0,
            "intra_mb": 0.0, "inter_mb": 0.0, "outer_steps": 0, "cross_group_mb": 0.0, "loss_of": "group 0 of 2"}
    logger.training_line(1, 4, {**line, "outer_drift": float("nan")})
    logger.training_line(2, 4, {**line, "outer_steps": 1, "outer_drift": 2.5e-3})
    logger.close()
    first, second = [x for x in capsys.readouterr().out.splitlines() if "iteration" in x]
    assert "| outer drift: n/a |" in first and "| outer drift: 2.500e-03 |" in second
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("outer/drift")] == [(2, pytest.approx(2.5e-3))]


# -- train.py ------------------------------------------------------------------------------------------

def test_dry_run_plans_the_bytes_across_groups(capsys):
    import train
    train.main(["--dry-run", "--cluster", "configs/clusters/v100_4x16_100gbps.yaml", "--num-layers", "4",
                "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256", "--micro-batch-size", "2",
                "--lr", "1e-4", "--zero-stage", "3", "--outer-sync-interval", "64", "--outer-quantization", "int4",
                "--outer-fragments", "2", "--group-size", "2", "--outer-warmup-iters", "100"])
    out = capsys.readouterr().out
    assert "-- Outer synchronization: 2 groups of 2 node(s)" in out
    ratio = float(out.split("(ratio ")[1].split(")")[0])
    assert 0 < ratio < 0.01   # INT4 shards every 64 steps against ZeRO-3's gathers and reductions every step
    per_step = float(out.split("across groups per inner step per GPU: ")[1].split(" MB")[0])
    warm = float(out.split("the first 100 iterations as one synchronous job: ")[1].split(" MB")[0])
    assert warm > 4 * 64 * per_step   # each step the fp32 gradient shard, not an INT4 one every 64 steps


@pytest.mark.slow
def test_train_py_runs_the_mode_and_logs_it(corpus, tmp_path):  # noqa: F811
    d = corpus
    rc, log = train_ranks(4, ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                           "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "12", "--lr", "3e-3",
                           "--data-path", str(d / "docs_text_document"), "--tokenizer-model", str(d / "sp.model"),
                           "--data-cache-path", str(tmp_path / "cache"), "--log-interval", "4", "--eval-iters", "0",
                           "--zero-stage", "3", "--ranks-per-node", "2", "--outer-sync-interval", "4",
                           "--outer-fragments", "2", "--outer-quantization", "int4",
                           "--tensorboard-dir", str(tmp_path / "tb")])
    assert rc == 0, log
    lines = [line for line in log.splitlines() if "lm loss:" in line]
    steps = [int(line.split("outer steps: ")[1].split(" ")[0]) for line in lines]
    assert steps == [1, 3, 5]   # fragment 1 at steps 2, 6, 10, fragment 0 at 4, 8, 12: each applied a step later
    assert all(float(line.split("cross-group MB: ")[1].split(" ")[0]) > 0 for line in lines)
    # and at the end the one in flight merged (6 outer steps), then both fragments averaged exactly (no outer step)
    assert "final exchange of all 2 fragment(s) after iteration 12: every group now holds the global parameters, " \
           "the groups' exact mean" in log
    assert "6 outer steps (fragment exchanges) over 2 groups" in log and "not merged at the end" not in log
    assert all("| lm loss of: group 0 of 2 |" in line for line in lines)
    assert "MB, the groups' engines and the outer exchange between them" in log and "would send" not in log
    assert "> outer synchronization: 2 groups of 1 node(s) x 2 ranks, each its own engine; every 4 inner steps in 2 " \
           "fragment(s), outer lr 0.7, Nesterov momentum 0.9, int4 outer gradients, merged 1 inner step(s) after issue" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("outer/steps")] == steps
    assert {"outer/cross-group-MB-per-iteration", "outer/drift"} <= set(events.Tags()["scalars"])


# -- ZeRO++ with hpZ inside groups of 2 nodes x 2 (8 ranks) ----------------------------------------------

ZEROPP_ALL = {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2,
              "zero_quantized_weight_deltas": True}


def zeropp_group(rank, world):
    topo = topology_from_env(2).group_topology(2).build_groups() if world == 8 else topology_from_env(2)
    engine = build(topo, ZEROPP_ALL)
    sd = train(engine, batches(3, topo.world_size), topo.rank)
    return sd, engine.comm.stats.intra_node_bytes, engine.comm.stats.inter_node_bytes


@pytest.mark.slow
def test_group_engine_with_every_zeropp_switch_trains_as_alone():
    groups = run_distributed(zeropp_group, world_size=8)
    alone = run_distributed(zeropp_group, world_size=4)
    for rank, (sd, intra, inter) in enumerate(groups):
        ref = alone[rank % 4]
        assert all(torch.equal(sd[k], v) for k, v in ref[0].items())
        assert (intra, inter) == ref[1:] and inter > 0
