"""ZeRO stages 1, 2, 3 on 4 gloo ranks (and stage 0, DDP, on 2) match a single
process (DDPEngine, world size 1) over the same global batch: fp32, gradient
accumulation 2, gradient clipping that triggers, activation checkpointing off and on.
"Match": within the round-off the single process itself shows against the same
training in fp64 (tests/numerics.py), which holds on any CPU."""
import pytest
import torch

from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import topology_from_env
from tests.distributed import run_distributed
from tests.numerics import assert_state_within_roundoff, assert_within_roundoff, fp64_reference
import zeropp

CFG = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4,
           max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
GLOBAL_BATCH, SEQ, STEPS, ACCUM, WORLD = 8, 16, 5, 2, 4
CLIP = 0.4  # the gradient norm here falls from ~1.0 to ~0.45 over 5 steps: clipping triggers on every step


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def zero_config(stage):
    return {"gradient_clipping": CLIP,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                  "allgather_bucket_size": 5000,
                                  "stage3_param_persistence_threshold": 16,
                                  "stage3_prefetch_bucket_size": 20000}}


def train(rank, world_size, stage, checkpoint):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, checkpoint_activations=checkpoint))
    ds = zeropp.DeepSpeedConfig.from_dict(zero_config(stage))
    engine = zeropp.initialize(model, ds, Communicator(topology_from_env()), torch.device("cpu"),
                               zeropp.OptimizerSettings(lr=1e-2), gradient_accumulation_steps=ACCUM)
    losses, norms = [], []
    per_rank = GLOBAL_BATCH // world_size
    micro = per_rank // ACCUM
    for batch in batches():
        mine = batch[rank * per_rank:(rank + 1) * per_rank]
        total = 0.0
        for m in range(ACCUM):
            x = mine[m * micro:(m + 1) * micro]
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            total += loss.item() / ACCUM
        result = engine.step()
        norms.append(result.grad_norm)
        t = torch.tensor([total / world_size])
        if world_size > 1:
            torch.distributed.all_reduce(t)
        losses.append(t.item())
    return losses, norms, engine.module_state_dict()


def train_all(rank, world_size, stage):
    return [train(rank, world_size, stage, ckpt) for ckpt in (False, True)]


def check(result, ref, exact):
    losses, norms, weights = result
    ref_losses, ref_norms, ref_weights = ref
    exact_losses, exact_norms, exact_weights = exact
    assert_within_roundoff(losses, ref_losses, exact_losses, "losses")
    assert_within_roundoff(norms, ref_norms, exact_norms, "gradient norms")
    assert min(ref_norms) > CLIP  # clipping really was active
    assert_state_within_roundoff(weights, ref_weights, exact_weights, "weights")


def fp64_run(checkpoint):
    """The same training in fp64: the global batch of each step as ACCUM micro-batches."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, checkpoint_activations=checkpoint))
    micro = GLOBAL_BATCH // ACCUM

    def loss_of(x):
        return lambda m: m(x[:, :-1], x[:, 1:])
    steps = [[loss_of(batch[i * micro:(i + 1) * micro]) for i in range(ACCUM)] for batch in batches()]
    return fp64_reference(model, steps, lr=1e-2, clip=CLIP)


@pytest.fixture(scope="module")
def reference():
    return {ckpt: train(0, 1, 0, ckpt) for ckpt in (False, True)}


@pytest.fixture(scope="module")
def exact():
    return {ckpt: fp64_run(ckpt) for ckpt in (False, True)}


def test_fp64_reference_is_the_engines_arithmetic(reference, exact):
    """The fp64 run is the single process's training, to fp32 round-off (so the
    bounds below compare like with like)."""
    for ckpt in (False, True):
        for a, b in zip(reference[ckpt][0] + reference[ckpt][1], exact[ckpt][0] + exact[ckpt][1]):
            assert abs(a - b) <= 1e-4 * abs(b)
        for k, v in exact[ckpt][2].items():
            if "qkv.bias" not in k:   # the key bias: round-off noise through Adam (tests/numerics.py)
                assert (reference[ckpt][2][k].double() - v).abs().max() <= 1e-3 * v.abs().max() + 1e-6, k


@pytest.mark.slow
@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, WORLD), (2, WORLD), (3, WORLD)])
def test_stage_matches_single_process(stage, world_size, reference, exact):
    results = run_distributed(train_all, world_size=world_size, args=(stage,))
    for per_rank in results:
        for ckpt, result in zip((False, True), per_rank):
            check(result, reference[ckpt], exact[ckpt])
    assert reference[False][0][-1] < reference[False][0][0]


# -- the plain reduce-scatter on gloo: an all-to-all of the rows plus a local sum ------------

def plain_reduce_on_gloo(rank, world_size):
    import torch.distributed as dist

    from parallel.comm import wire_bytes
    from zeropp.collectives.exact import ShardReduce
    from zeropp.collectives.partition import Partition
    topo = topology_from_env(ranks_per_node=2)   # 2 nodes x 2
    comm = Communicator(topo)
    called = []
    for name in ("all_to_all_single", "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            orig = getattr(dist, name)
            setattr(dist, name, lambda *a, _n=name, _f=orig, **k: (called.append(_n), _f(*a, **k))[1])
    total = 1000
    rows = [torch.randn(world_size, total, generator=torch.Generator().manual_seed(r)).bfloat16()
            for r in range(world_size)]
    out = torch.empty(total, dtype=torch.bfloat16)
    part = Partition(group=None, size=world_size, rank=rank)
    ShardReduce(comm).start(rows[rank].clone(), out, part, "grad_reduce", async_op=True).wait()
    acc = rows[0][rank].float()   # the same fp32 sum, in member order
    for r in rows[1:]:
        acc = acc + r[rank].float()
    charged = (comm.stats.intra_node_bytes, comm.stats.inter_node_bytes)
    plain = (comm.stats.plain_intra_node_bytes, comm.stats.plain_inter_node_bytes)
    ring = wire_bytes("reduce_scatter", list(range(world_size)), rank, total * 2, topo.node_of)
    sent = wire_bytes("all_to_all", list(range(world_size)), rank, world_size * total * 2, topo.node_of)[1]
    return (called, torch.equal(out, acc.bfloat16()), charged, plain, ring, dict(comm.stats.by_op),
            (comm.stats.issued_inter_node_bytes, sent))


@pytest.mark.slow
def test_plain_reduce_scatter_on_gloo_is_an_all_to_all_summed_in_fp32():
    """gloo's reduce_scatter_tensor is an all-reduce (twice a ring's bytes): ShardReduce sends
    the rows by one all-to-all (a ring's (n-1) rows per member) and sums them in fp32, charged
    as the ring reduce-scatter it stands for, in the counted and the plain bytes; the issued
    bytes are the all-to-all's."""
    for called, equal, charged, plain, ring, by_op, issued in run_distributed(plain_reduce_on_gloo, world_size=4):
        assert called == ["all_to_all_single"]
        assert equal
        assert charged == plain == ring and sum(ring) == 3 * 2000
        assert list(by_op) == ["reduce_scatter"]
        assert issued[0] == issued[1] == 2 * 2000   # what crossed: a chunk to each rank of the other node
