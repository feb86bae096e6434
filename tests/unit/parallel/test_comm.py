"""The collectives layer charges the bytes a ring (or direct all-to-all, or a
broadcast chain) puts on the wire, split into intra- and inter-node bytes, by
phase and by collective."""
import pytest
import torch
import torch.distributed as dist

from parallel.comm import OPS, Communicator, CommStats, wire_bytes
from parallel.topology import Topology, topology_from_env
from tests.distributed import run_distributed


def nodes_of(L):
    return lambda r: r // L


def charges(op, ranks, S, L, **kw):
    """{rank: (intra, inter)} for every member of the group."""
    return {r: wire_bytes(op, ranks, r, S, nodes_of(L), **kw) for r in ranks}


def direct_all_gather(ranks, me, S, node_of):
    """The old model: my shard straight to every other member."""
    intra = sum(S for r in ranks if r != me and node_of(r) == node_of(me))
    inter = sum(S for r in ranks if r != me and node_of(r) != node_of(me))
    return intra, inter


# -- pure charge model ----------------------------------------------------------

def test_ring_4_ranks_2_nodes_of_2():
    world = [0, 1, 2, 3]
    # all_gather, S = 32 B input shard: (n-1) S = 96 to the successor; 1 -> 2 and 3 -> 0 cross.
    assert charges("all_gather", world, 32, 2) == {0: (96, 0), 1: (0, 96), 2: (96, 0), 3: (0, 96)}
    # reduce_scatter, S = 8 B output chunk: (n-1) S = 24.
    assert charges("reduce_scatter", world, 8, 2) == {0: (24, 0), 1: (0, 24), 2: (24, 0), 3: (0, 24)}
    # all_reduce, S = 32 B tensor: 2 (n-1) S / n = 48.
    assert charges("all_reduce", world, 32, 2) == {0: (48, 0), 1: (0, 48), 2: (48, 0), 3: (0, 48)}
    # all_to_all, S = 32 B input: 8 B chunk to each other member, by its node.
    assert charges("all_to_all", world, 32, 2) == {r: (8, 16) for r in world}
    # broadcast chain from 0: 0 -> 1 -> 2 -> 3; the last (3) sends nothing.
    assert charges("broadcast", world, 32, 2, src=0) == {0: (32, 0), 1: (0, 32), 2: (32, 0), 3: (0, 0)}
    # from 2: 2 -> 3 -> 0 -> 1.
    assert charges("broadcast", world, 32, 2, src=2) == {2: (32, 0), 3: (0, 32), 0: (32, 0), 1: (0, 0)}


def test_ring_8_ranks_2_nodes_of_4():
    world = list(range(8))
    S = 10
    ag = charges("all_gather", world, S, 4)
    assert ag == {r: ((0, 70) if r in (3, 7) else (70, 0)) for r in world}
    rs = charges("reduce_scatter", world, S, 4)
    assert rs == ag
    ar = charges("all_reduce", world, 16, 4)         # 2 * 7 * 16 / 8 = 28
    assert ar == {r: ((0, 28) if r in (3, 7) else (28, 0)) for r in world}
    a2a = charges("all_to_all", world, 64, 4)         # 8 B chunks: 3 local peers, 4 remote
    assert a2a == {r: (24, 32) for r in world}
    # broadcast from 5: 5 -> 6 -> 7 -> 0 -> 1 -> 2 -> 3 -> 4; 7 -> 0 and 3 -> 4 cross; 4 ends it.
    bc = charges("broadcast", world, S, 4, src=5)
    assert bc == {0: (10, 0), 1: (10, 0), 2: (10, 0), 3: (0, 10), 4: (0, 0),
                  5: (10, 0), 6: (10, 0), 7: (0, 10)}


def test_ring_8_ranks_4_nodes_of_2():
    world = list(range(8))
    ag = charges("all_gather", world, 10, 2)
    assert ag == {r: ((0, 70) if r % 2 else (70, 0)) for r in world}
    a2a = charges("all_to_all", world, 64, 2)         # 8 B chunks: 1 local peer, 6 remote
    assert a2a == {r: (8, 48) for r in world}
    bc = charges("broadcast", world, 10, 2, src=0)    # 0 -> 1 -> ... -> 7: 1, 3, 5 cross
    assert bc == {0: (10, 0), 1: (0, 10), 2: (10, 0), 3: (0, 10), 4: (10, 0), 5: (0, 10),
                  6: (10, 0), 7: (0, 0)}


def test_ring_64_ranks_8_nodes_of_8_about_M_leaves_each_node():
    N, L = 8, 8
    W = N * L
    world = list(range(W))
    S = 1000
    M = W * S
    node_of = nodes_of(L)
    ring = charges("all_gather", world, S, L)
    for node in range(N):
        members = range(node * L, (node + 1) * L)
        out = sum(ring[r][1] for r in members)
        assert out == (W - 1) * S                   # only the node's last rank talks across
        assert M * (W - 1) / W == out               # ~ M leaves each node
        assert sum(ring[r][0] for r in members) == (L - 1) * (W - 1) * S
        direct = sum(direct_all_gather(world, r, S, node_of)[1] for r in members)
        assert direct == L * (W - L) * S            # M (N-1)/N per rank
        # the old count is L (N-1)/N = 7x the ring's (exactly 7 * W / (W-1))
        assert direct / out == pytest.approx(L * (N - 1) / N * W / (W - 1))
        assert 7 < direct / out < 7.2
    # every rank sends (n-1) S; N links of the ring cross nodes
    assert sum(a + b for a, b in ring.values()) == W * (W - 1) * S
    assert sum(b for _, b in ring.values()) == N * (W - 1) * S
    # reduce-scatter moves the same; all-reduce twice that, over the same links
    assert charges("reduce_scatter", world, S, L) == ring
    ar = charges("all_reduce", world, M, L)
    assert all(v == (2 * a, 2 * b) for (a, b), v in zip(ring.values(), ar.values()))


def test_intra_node_group_never_crosses():
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        got = charges(op, [4, 5, 6, 7], 40, 4)
        assert all(inter == 0 and intra > 0 for intra, inter in got.values()), op
    assert charges("all_gather", [4, 5, 6, 7], 40, 4) == {r: (120, 0) for r in (4, 5, 6, 7)}
    assert charges("all_to_all", [4, 5, 6, 7], 40, 4) == {r: (30, 0) for r in (4, 5, 6, 7)}
    assert charges("broadcast", [4, 5, 6, 7], 40, 4, src=6) == {6: (40, 0), 7: (40, 0), 4: (40, 0),
                                                                5: (0, 0)}


def test_one_rank_per_node_group_always_crosses():
    peers = [1, 3, 5, 7]                              # 4 nodes of 2, local rank 1
    assert charges("all_gather", peers, 10, 2) == {r: (0, 30) for r in peers}
    assert charges("reduce_scatter", peers, 10, 2) == {r: (0, 30) for r in peers}
    assert charges("all_reduce", peers, 40, 2) == {r: (0, 60) for r in peers}
    assert charges("all_to_all", peers, 40, 2) == {r: (0, 30) for r in peers}
    assert charges("broadcast", [1, 5], 10, 4, src=5) == {5: (0, 10), 1: (0, 0)}


def test_ring_order_is_ascending_global_rank_and_rounding():
    # the order the group was given in does not matter
    assert charges("all_gather", [3, 1, 0, 2], 32, 2) == charges("all_gather", [0, 1, 2, 3], 32, 2)
    # 2 (n-1) S / n rounds down: n = 3, S = 10 -> 13
    assert wire_bytes("all_reduce", [0, 1, 2], 0, 10, nodes_of(3)) == (13, 0)
    # a group of one sends nothing
    for op in OPS:
        assert wire_bytes(op, [5], 5, 100, nodes_of(2), src=5) == (0, 0)


def test_wire_bytes_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("gather", [0, 1], 0, 8, nodes_of(1))
    with pytest.raises(ValueError, match="not in the group"):
        wire_bytes("all_gather", [0, 1], 2, 8, nodes_of(1))
    with pytest.raises(ValueError, match="src"):
        wire_bytes("broadcast", [0, 1], 0, 8, nodes_of(1))
    with pytest.raises(ValueError, match="src"):
        wire_bytes("broadcast", [0, 1], 0, 8, nodes_of(1), src=3)


def test_comm_stats_add_and_as_dict():
    s = CommStats()
    s.add("all_gather", "forward_gather", 10, 20)
    s.add("all_gather", "backward_gather", 5, 0)
    s.add("reduce_scatter", "grad_reduce", 0, 7)
    assert (s.intra_node_bytes, s.inter_node_bytes, s.total_bytes) == (15, 27, 42)
    d = s.as_dict()
    assert d["total_bytes"] == 42
    assert d["by_op"] == {"all_gather": {"intra_node_bytes": 15, "inter_node_bytes": 20},
                          "reduce_scatter": {"intra_node_bytes": 0, "inter_node_bytes": 7}}
    assert d["by_phase"]["forward_gather"] == {"intra_node_bytes": 10, "inter_node_bytes": 20}
    assert d["calls"] == {"forward_gather": 1, "backward_gather": 1, "grad_reduce": 1}


# -- real collectives on 4 gloo ranks (2 nodes x 2) ---------------------------

def count_bytes(rank, world_size):
    topo = topology_from_env(ranks_per_node=2)  # 4 ranks as 2 nodes x 2
    comm = Communicator(topo)
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    alone = singles[rank]
    out, expect, values = {}, {}, {}

    def measure(name, op, group, nbytes, fn, src=None):
        before = (comm.stats.intra_node_bytes, comm.stats.inter_node_bytes)
        fn()
        out[name] = (comm.stats.intra_node_bytes - before[0], comm.stats.inter_node_bytes - before[1])
        expect[name] = wire_bytes(op, comm.group_ranks(group), rank, nbytes, topo.node_of, src=src)

    x = torch.full((8,), float(rank + 1))           # 32 bytes
    gathered = torch.empty(32)

    def ag():
        comm.all_gather(gathered, x, async_op=True, phase="forward_gather").wait()
    measure("all_gather", "all_gather", None, 32, ag)
    values["all_gather"] = gathered

    rs_in = torch.arange(8, dtype=torch.float32) + 100 * rank
    rs_out = torch.empty(2)

    def rs():
        comm.reduce_scatter(rs_out, rs_in, async_op=True, phase="grad_reduce").wait()
    measure("reduce_scatter", "reduce_scatter", None, 8, rs)
    values["reduce_scatter"] = rs_out

    a2a_in = torch.tensor([100 * rank + 10 * j + k for j in range(4) for k in range(2)], dtype=torch.float32)
    a2a_out = torch.empty(8)
    measure("all_to_all", "all_to_all", None, 32,
            lambda: comm.all_to_all(a2a_out, a2a_in, phase="grad_reduce"))
    values["all_to_all"] = a2a_out

    ar = x.clone()
    measure("all_reduce", "all_reduce", None, 32, lambda: comm.all_reduce(ar, phase="optimizer"))
    values["all_reduce"] = ar

    bc = torch.full((8,), float(rank))
    measure("broadcast", "broadcast", None, 32, lambda: comm.broadcast(bc, src=2), src=2)
    values["broadcast"] = bc

    intra_out = torch.empty(16)
    measure("intra_group", "all_gather", topo.intra_node_group, 32,
            lambda: comm.all_gather(intra_out, x, group=topo.intra_node_group, phase="backward_gather"))
    values["intra_group"] = intra_out
    inter_out = torch.empty(16)
    measure("inter_group", "all_gather", topo.inter_node_group, 32,
            lambda: comm.all_gather(inter_out, x, group=topo.inter_node_group, phase="forward_gather"))
    values["inter_group"] = inter_out

    alone_out = torch.empty(8)
    measure("alone", "all_gather", alone, 32,
            lambda: comm.all_gather(alone_out, x, group=alone, phase="backward_gather"))
    values["alone"] = alone_out
    comm.all_reduce(torch.ones(4), group=alone, phase="optimizer")   # n == 1: no call counted

    async_handles = comm.async_handles
    stats = comm.stats.as_dict()
    reset = comm.reset_stats()
    assert comm.stats.total_bytes == 0 and comm.async_handles == 0 and reset.total_bytes == stats["total_bytes"]
    return out, expect, values, stats, async_handles, (topo.node, topo.local_rank)


def test_communicator_charges_wire_bytes_on_real_collectives():
    results = run_distributed(count_bytes, world_size=4)
    for rank, (out, expect, values, stats, async_handles, where) in enumerate(results):
        assert where == divmod(rank, 2)
        assert out == expect, rank
        crosses = rank in (1, 3)                    # world ring 0 -> 1 | 2 -> 3 | 0
        ring = lambda b: (0, b) if crosses else (b, 0)
        assert out["all_gather"] == ring(96)
        assert out["reduce_scatter"] == ring(24)
        assert out["all_reduce"] == ring(48)
        assert out["all_to_all"] == (8, 16)
        assert out["broadcast"] == {2: (32, 0), 3: (0, 32), 0: (32, 0), 1: (0, 0)}[rank]
        assert out["intra_group"] == (32, 0)       # never leaves the node
        assert out["inter_group"] == (0, 32)
        assert out["alone"] == (0, 0)

        # values
        assert torch.equal(values["all_gather"], torch.arange(1, 5).float().repeat_interleave(8))
        assert torch.equal(values["reduce_scatter"], 4 * torch.arange(2 * rank, 2 * rank + 2).float() + 600)
        assert torch.equal(values["all_to_all"],
                           torch.tensor([100 * i + 10 * rank + k for i in range(4) for k in range(2)]).float())
        assert torch.equal(values["all_reduce"], torch.full((8,), 10.0))
        assert torch.equal(values["broadcast"], torch.full((8,), 2.0))
        node = rank // 2
        assert torch.equal(values["intra_group"],
                           torch.tensor([2 * node + 1, 2 * node + 2]).float().repeat_interleave(8))
        local = rank % 2
        assert torch.equal(values["inter_group"],
                           torch.tensor([local + 1, local + 3]).float().repeat_interleave(8))
        assert torch.equal(values["alone"], torch.full((8,), float(rank + 1)))

        # stats: totals, by_phase, by_op, calls
        intra = sum(v[0] for v in out.values())
        inter = sum(v[1] for v in out.values())
        assert (stats["intra_node_bytes"], stats["inter_node_bytes"]) == (intra, inter)
        assert stats["total_bytes"] == intra + inter
        pair = lambda a, b: {"intra_node_bytes": a, "inter_node_bytes": b}
        add = lambda *names: pair(sum(out[n][0] for n in names), sum(out[n][1] for n in names))
        assert stats["by_op"] == {"all_gather": add("all_gather", "intra_group", "inter_group"),
                                  "reduce_scatter": add("reduce_scatter"),
                                  "all_to_all": add("all_to_all"),
                                  "all_reduce": add("all_reduce"),
                                  "broadcast": add("broadcast")}
        assert stats["by_phase"] == {"forward_gather": add("all_gather", "inter_group"),
                                     "grad_reduce": add("reduce_scatter", "all_to_all"),
                                     "optimizer": add("all_reduce"),
                                     "other": add("broadcast"),
                                     "backward_gather": add("intra_group")}
        assert stats["calls"] == {"forward_gather": 2, "grad_reduce": 2, "optimizer": 1,
                                  "other": 1, "backward_gather": 1}
        assert async_handles == 2
    # summed over node 0, the world all-gather sends (n-1) S = 96 B ~ M = 128 B across
    assert sum(results[r][0]["all_gather"][1] for r in (0, 1)) == 96


def test_topology_layout_and_bad_ranks_per_node():
    t = Topology(world_size=8, rank=5, ranks_per_node=4)
    assert (t.num_nodes, t.node, t.local_rank) == (2, 1, 1)
    assert t.node_ranks(1) == [4, 5, 6, 7] and t.peer_ranks(1) == [1, 5]
    with pytest.raises(ValueError, match="--ranks-per-node 4 must divide the world size 6"):
        Topology(world_size=6, rank=0, ranks_per_node=4)


def uneven_all_to_all(rank, world_size):
    comm = Communicator(topology_from_env(ranks_per_node=2))   # 4 ranks as 2 nodes x 2
    sends = [j + 1 for j in range(world_size)]                 # rank j gets j + 1 elements
    x = torch.cat([torch.full((n,), 100.0 * rank + j) for j, n in enumerate(sends)])
    out = torch.empty(world_size * (rank + 1))
    comm.all_to_all(out, x, output_splits=[rank + 1] * world_size, input_splits=sends)
    return out, (comm.stats.intra_node_bytes, comm.stats.inter_node_bytes), comm.stats.calls["other"]


def test_an_uneven_all_to_all_delivers_each_part_and_charges_what_goes_to_each_rank():
    for rank, (out, charged, calls) in enumerate(run_distributed(uneven_all_to_all, world_size=4)):
        assert torch.equal(out, torch.tensor([100.0 * i + rank for i in range(4)]).repeat_interleave(rank + 1))
        peer = rank ^ 1   # the other rank of my node
        assert charged == (4 * (peer + 1), 4 * sum(j + 1 for j in range(4) if j // 2 != rank // 2)), rank
        assert calls == 1
