"""The ZeRO engine at scale: sharded construction under a measured memory
bound, parameters without a gradient on some rank, fp32 accumulation of 16-bit
gradients, streamed gradient buckets, the gather order, and the live-weight
bound during activation-checkpoint recompute."""
import ctypes

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeropp
from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import Topology, topology_from_env
from tests.distributed import run_distributed
from tests.numerics import assert_state_within_roundoff, fp64_reference

WORLD = 4
TINY = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4,
            max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)


def engine_for(model, stage, world_size, accum=1, zero=None, param_init=None, **top):
    cfg = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(zero or {})},
           **top}
    comm = Communicator(topology_from_env() if world_size > 1 else Topology(1, 0, 1))
    return zeropp.initialize(model, zeropp.DeepSpeedConfig.from_dict(cfg), comm, torch.device("cpu"),
                             zeropp.OptimizerSettings(lr=1e-2), gradient_accumulation_steps=accum,
                             param_init=param_init)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _peak_rss_growth_mb(fn) -> tuple[float, object]:
    """Peak RSS growth while `fn` runs: the kernel's high-water mark is reset first.
    glibc's malloc keeps freed mid-size blocks on its heap (its mmap threshold
    grows with use), so RSS would count memory already freed; a fixed threshold
    returns every block over 64 KiB to the kernel on free, and RSS then tracks
    what is really held."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kb("VmRSS")
    out = fn()
    return (_status_kb("VmHWM") - before) / 1024, out


# -- sharded construction -------------------------------------------------------------------
BIG = dict(vocab_size=1024, num_layers=8, hidden_size=512, num_attention_heads=8,
           max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)


def construct_sharded(rank, world_size):
    torch.manual_seed(rank)  # must not matter: initial values come from the weights' names
    with torch.device("meta"):
        GPT(GPTConfig(**TINY))  # warm-up: torch's lazy first-use set-up is not the model

    def build():
        with torch.device("meta"):
            model = GPT(GPTConfig(**BIG))
        return engine_for(model, 3, world_size, param_init=model.init_parameter)

    growth, engine = _peak_rss_growth_mb(build)
    return growth, engine.module_state_dict()


def construct_whole(rank, world_size):
    GPT(GPTConfig(**TINY))
    growth, model = _peak_rss_growth_mb(lambda: GPT(GPTConfig(**BIG)))
    return growth, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_sharded_construction_holds_only_shards_and_equals_a_whole_build():
    # RSS bound (Linux VmHWM, reset before construction): each of 4 ranks may grow by
    # its stage-3 shards (fp32 weight + gradient partition = 2 x 4 B/param / 4) plus
    # one full parameter at a time (+ 8 MB slack), about half of what a plain build
    # of the whole model allocates.
    (whole_growth, whole), = run_distributed(construct_whole, world_size=1)
    full_mb = sum(v.numel() for v in whole.values()) * 4 / 2**20
    assert full_mb > 90  # ~25.7 M parameters
    assert whole_growth > 0.9 * full_mb
    largest_mb = max(v.numel() for v in whole.values()) * 4 / 2**20
    for growth, weights in run_distributed(construct_sharded, world_size=WORLD):
        assert growth < full_mb * 2 / WORLD + largest_mb + 8, (growth, full_mb)
        assert set(weights) == set(whole)
        for k in whole:  # the same initial values as an unsharded build, bit for bit
            assert torch.equal(weights[k], whole[k]), k


def test_meta_model_without_param_init_is_a_clear_error():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="weight is on the meta device: pass param_init"):
        engine_for(model, 0, 1)


# -- a parameter without a gradient on some ranks ----------------------------------------------
class Branchy(nn.Module):
    """`aux` runs on every rank but reaches the loss only where `use_aux`;
    `never` is used nowhere."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.aux = nn.Linear(32, 8)
        self.out = nn.Linear(32, 8)
        self.never = nn.Parameter(torch.ones(5))

    def forward(self, x, y, use_aux: bool):
        h = torch.tanh(self.inp(x))
        a = self.aux(h)
        loss = F.mse_loss(self.out(h), y)
        return loss + a.pow(2).mean() if use_aux else loss


def branchy_data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g), rank % 2 == 0


def branchy_run(rank, world_size, stage, zero):
    torch.manual_seed(0)
    engine = engine_for(Branchy(), stage, world_size, zero=zero, gradient_clipping=1.0)
    for step in range(4):
        engine.backward(engine(*branchy_data(step, rank)))
        engine.step()
    return engine.module_state_dict()


def branchy_reference():
    """One process, the 4 ranks' batches as 4 accumulation micro-steps (the same average)."""
    torch.manual_seed(0)
    engine = engine_for(Branchy(), 0, 1, accum=WORLD, gradient_clipping=1.0)
    for step in range(4):
        for r in range(WORLD):
            engine.backward(engine(*branchy_data(step, r)))
        engine.step()
    return engine.module_state_dict()


def branchy_fp64():
    """branchy_reference's training in fp64 (tests/numerics.py)."""
    torch.manual_seed(0)
    model = Branchy()

    def loss_of(step, r):
        x, y, use_aux = branchy_data(step, r)
        return lambda m: m(x.double(), y.double(), use_aux)
    steps = [[loss_of(step, r) for r in range(WORLD)] for step in range(4)]
    return fp64_reference(model, steps, lr=1e-2, clip=1.0)[2]


def branchy_all(rank, world_size):
    return {(stage, reuse): branchy_run(rank, world_size, stage, {"stage3_max_reuse_distance": reuse})
            for stage in (1, 2, 3) for reuse in ((0, 10**9) if stage == 3 else (0,))}


@pytest.mark.slow
def test_parameter_without_gradient_on_some_ranks_trains_and_matches():
    ref, exact = branchy_reference(), branchy_fp64()
    for per_rank in run_distributed(branchy_all, world_size=WORLD):
        for key, weights in per_rank.items():
            assert_state_within_roundoff(weights, ref, exact, str(key))


def branchy_eval_between(rank, world_size):
    """Stage 3, reuse distance 0 (backward gathers everything again): a no_grad
    eval forward between each training forward and its backward."""
    torch.manual_seed(0)
    engine = engine_for(Branchy(), 3, world_size, zero={"stage3_max_reuse_distance": 0},
                        gradient_clipping=1.0)
    for step in range(4):
        loss = engine(*branchy_data(step, rank))
        engine.eval()
        with torch.no_grad():
            engine(*branchy_data(99, rank))
        engine.train()
        engine.backward(loss)
        engine.step()
    return engine.module_state_dict()


@pytest.mark.slow
def test_eval_between_forward_and_backward_keeps_the_backward_schedule():
    """The eval forward must not replace the record backward's order comes from:
    without that order, backward gathers on demand, and ranks where `aux` gets no
    gradient issue other collectives than the rest (a hang or a wrong sum)."""
    ref, exact = branchy_reference(), branchy_fp64()
    for weights in run_distributed(branchy_eval_between, world_size=WORLD, timeout=120):
        assert_state_within_roundoff(weights, ref, exact, "eval in between")


def strict_unused(rank, world_size):
    torch.manual_seed(0)
    engine = engine_for(Branchy(), 2, world_size, zero={"ignore_unused_parameters": False})
    try:
        engine.backward(engine(*branchy_data(0, rank)))
    except RuntimeError as e:
        return str(e)
    return None


def test_ignore_unused_parameters_false_names_the_parameter():
    messages = run_distributed(strict_unused, world_size=2)
    assert all(m is not None and "never" in m and "ignore_unused_parameters" in m for m in messages)


# -- 16-bit gradients accumulate in fp32 ------------------------------------------------------
ACCUM = 32


def micro_batches(rank):
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(0, 96, (1, 17), generator=g) for _ in range(ACCUM)]


def bf16_accumulate(rank, world_size, stage):
    torch.manual_seed(0)
    engine = engine_for(GPT(GPTConfig(**TINY)), stage, world_size, accum=ACCUM,
                        bf16={"enabled": True}, communication_data_type="fp32")
    for x in micro_batches(rank):
        engine.backward(engine(x[:, :-1], x[:, 1:]))
    return {s.name: (s.lo, s.hi, s.grad.clone()) for s in engine.shards}


def bf16_reference(rank, world_size, ranks):
    """Each micro-step's bf16 gradient (the same tensors the ranks compute, also one
    thread each), summed in fp64, and what summing them in bf16 gives."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).to(torch.bfloat16)
    exact = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in model.named_parameters()}
    naive = {n: torch.zeros(p.numel(), dtype=torch.bfloat16) for n, p in model.named_parameters()}
    for r in range(ranks):
        for x in micro_batches(r):
            model.zero_grad()
            (model(x[:, :-1], x[:, 1:]) / ACCUM).backward()
            for n, p in model.named_parameters():
                exact[n] += p.grad.view(-1).double() / ranks
                naive[n] += p.grad.view(-1) / ranks
    return exact, naive


def bf16_both(rank, world_size):
    return {stage: bf16_accumulate(rank, world_size, stage) for stage in (2, 3)}


@pytest.mark.slow
def test_bf16_gradients_accumulate_in_fp32():
    (exact, naive), = run_distributed(bf16_reference, world_size=1, args=(2,))
    naive_err = max(((naive[n].double() - exact[n]).norm() / exact[n].norm()).item()
                    for n in exact if exact[n].norm() > 0)
    assert naive_err > 1e-3  # what accumulating in bf16 would lose: the test can tell
    for per_rank in run_distributed(bf16_both, world_size=2):
        for stage, grads in per_rank.items():
            for name, (lo, hi, g) in grads.items():
                ref = exact[name][lo:hi]
                if ref.numel() and ref.norm() > 0:
                    err = ((g.double() - ref).norm() / ref.norm()).item()
                    assert err < 1e-6, (stage, name, err)


# -- gradients streamed through a bounded set of buckets; gathers in order -----------------------
def streaming_run(rank, world_size):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, checkpoint_activations=True))
    numel = sum(p.numel() for p in model.parameters())
    engine = engine_for(model, 3, world_size,
                        zero={"reduce_bucket_size": numel // 8, "stage3_prefetch_bucket_size": numel // 6,
                              "stage3_max_reuse_distance": 0,
                              "stage3_max_live_parameters": int(numel * 0.6)})
    log = []
    gathers = engine.parts.hooks.gathers
    issue, request = gathers._issue, gathers.request

    def traced_request(params):
        log.append(("request", [s.index for s in params if s.state.value == "released"]))
        request(params)

    def traced_issue(params):
        todo = [s.index for s in params if not s.persistent and s.state.value == "released"]
        if todo:
            log.append(("issue", todo))
        issue(params)

    gathers.request, gathers._issue = traced_request, traced_issue
    comm = engine.comm
    x = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(rank))
    peaks, calls = [], []
    for step in range(3):
        log.clear()
        comm.reset_stats()
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
        peaks.append(engine.peak_buffers())
        calls.append(dict(comm.stats.calls))
    return numel, peaks, calls, list(log), len(engine.reducer.buckets)


def test_gradients_stream_gathers_bucket_and_needed_weight_goes_first():
    for numel, peaks, calls, log, buckets in run_distributed(streaming_run, world_size=WORLD):
        full_grad_bytes = numel * 4
        p = peaks[-1]
        # Gradient buffers: a few buckets of numel/8, never the whole gradient, and
        # reused from step to step (no growth after the first step).
        assert p["gradient_buckets_peak"] <= p["gradient_buckets_bound"]
        assert p["gradient_buckets_peak"] < 0.6 * full_grad_bytes, p
        assert peaks[0]["gradient_buckets_peak"] == p["gradient_buckets_peak"]
        assert calls[-1]["grad_reduce"] == buckets >= 8
        # Gathered weights, activation-checkpoint recompute included, within the live bound;
        # the gathers' own buffers (inputs, rows) within theirs.
        assert p["gathered_weights_peak"] <= p["gathered_weights_bound"], p
        assert 0 < p["gather_buffers_peak"] <= p["gather_buffers_bound"], p
        # One collective per prefetch bucket, not per module (22 modules with weights).
        assert calls[-1]["forward_gather"] <= 8 and calls[-1]["backward_gather"] <= 8, calls[-1]
        # The weight a request needs is issued before any prefetch that follows it.
        for i, (kind, needed) in enumerate(log):
            if kind == "request" and needed:
                nxt = next(entry for entry in log[i + 1:] if entry[0] == "issue")
                assert set(needed) & set(nxt[1]), (needed, nxt)


# -- the buffer pool and the weights held for backward: plain functions ----------------------
def test_buffer_pool_reuses_exact_sizes_and_keeps_to_its_budget():
    from zeropp.collectives.buffer_pool import BufferPool
    pool = BufferPool(torch.device("cpu"), budget=1000)
    a = pool.take(100, torch.float32)                      # 400 bytes
    assert a.dtype == torch.float32 and a.numel() == 100
    pool.give(a)
    b = pool.take(100, torch.float32)
    assert b.data_ptr() == a.data_ptr() and pool.bytes == 400   # the same size: reused
    c = pool.take(50, torch.int64)                         # 400 bytes, new (exact sizes only)
    pool.give(b)
    pool.give(c)
    assert pool.bytes == 800
    d = pool.take(100, torch.bfloat16)                     # 200 bytes: 1000 fits the budget
    assert pool.bytes == 1000
    e = pool.take(75, torch.float32)                       # 300: a free 400 is dropped first
    assert pool.bytes == 900 and pool.peak_bytes == 1000
    f = pool.take(300, torch.float32)    # every free buffer dropped; beyond the budget only what is in use
    assert pool.bytes == pool.in_use_bytes == 1700
    for t in (d, e, f):
        pool.give(t)
    assert pool.in_use_bytes == 0


def test_reuse_distance_decides_what_is_held_within_the_hold_budget():
    from zeropp.stages.schedule import reuse_set
    numels = [10, 10, 10, 10, 40]
    forward = [[0], [1], [2], [3], [4]]
    backward = [[4], [3], [2], [1], [0]]
    # reuse 0: every module's weights are released after its forward (DeepSpeed's)
    assert reuse_set(forward, backward, numels, 0, 10**9) == set()
    # a reuse distance holds by distance, nearest first
    assert reuse_set(forward, backward, numels, 80, 10**9) == {4, 3}
    assert reuse_set(forward, backward, numels, 79, 10**9) == {4}
    # within the hold budget; a pinned weight (read outside its module, live anyway) costs nothing
    assert reuse_set(forward, backward, numels, 10**9, 45) == {4}
    assert reuse_set(forward, backward, numels, 10**9, 5, pinned={4}) == {4}
    # a weight backward never uses is never held
    assert reuse_set(forward, [[4], [3]], numels, 10**9, 10**9) == {4, 3}


def test_live_budget_leaves_room_for_pinned_weights_and_a_bucket():
    from zeropp.stages.schedule import live_budget
    numels = [8, 30, 20, 20]
    events = [[0], [1], [2], [3]]
    b = live_budget(60, 40, numels, events, pinned={0})
    assert (b.pinned, b.bucket, b.hold) == (8, 40, 12)       # 8 + 40 + 12 = the live bound
    b = live_budget(40, 40, numels, events, pinned={0})
    assert (b.bucket, b.hold) == (32, 0)                     # buckets shrink to fit beside the pinned
    b = live_budget(25, 10, numels, events, pinned=set())
    assert (b.bucket, b.hold) == (10, 0)                     # a module beyond the rest: nothing held


# -- world size 1 ------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_one_takes_the_short_path(stage):
    """One rank: no partitions, no collectives, the optimizer updates the weights in
    place from gradients autograd left in param.grad (the same code as a plain loop)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    engine = engine_for(model, stage, 1)
    assert isinstance(engine, zeropp.DDPEngine) and engine.ddp is None
    weight = model.wte.weight
    x = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    assert weight.grad is not None and weight.grad.data_ptr() != 0
    before = weight.detach().clone()
    engine.step()
    assert engine.module.wte.weight is weight and not torch.equal(weight, before)
    assert engine.comm.stats.total_bytes == 0 and not engine.comm.stats.calls
