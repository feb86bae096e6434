"""The collectives layer counts bytes inside a node and across nodes."""
import pytest
import torch

from parallel.comm import Communicator
from parallel.topology import Topology, topology_from_env
from tests.distributed import run_distributed


def count_bytes(rank, world_size):
    topo = topology_from_env(ranks_per_node=2)  # 4 ranks as 2 nodes x 2
    comm = Communicator(topo)
    x = torch.ones(8)  # 32 bytes
    out = {}

    def measure(name, fn):
        comm.reset_stats()
        fn()
        out[name] = (comm.stats.intra_node_bytes, comm.stats.inter_node_bytes)

    gathered = torch.empty(32)
    measure("all_gather", lambda: comm.all_gather(gathered, x))
    measure("reduce_scatter", lambda: comm.reduce_scatter(torch.empty(2), x))
    measure("all_to_all", lambda: comm.all_to_all(torch.empty(8), x))
    measure("all_reduce", lambda: comm.all_reduce(x.clone()))
    measure("intra_group", lambda: comm.all_gather(torch.empty(16), x, group=topo.intra_node_group))
    measure("inter_group", lambda: comm.all_gather(torch.empty(16), x, group=topo.inter_node_group))
    assert torch.equal(gathered, torch.ones(32))
    return out, topo.node, topo.local_rank


def test_bytes_split_by_node_boundary():
    for rank, (out, node, local) in enumerate(run_distributed(count_bytes, world_size=4)):
        assert (node, local) == divmod(rank, 2)
        assert out["all_gather"] == (32, 64)       # 32 B to the node peer, 32 B to each of 2 remote ranks
        assert out["reduce_scatter"] == (8, 16)    # one 8 B chunk per peer
        assert out["all_to_all"] == (8, 16)
        assert out["all_reduce"] == (16, 32)       # reduce-scatter + all-gather: 2 S/n per peer
        assert out["intra_group"] == (32, 0)       # never leaves the node
        assert out["inter_group"] == (0, 32)


def test_topology_layout_and_bad_ranks_per_node():
    t = Topology(world_size=8, rank=5, ranks_per_node=4)
    assert (t.num_nodes, t.node, t.local_rank) == (2, 1, 1)
    assert t.node_ranks(1) == [4, 5, 6, 7] and t.peer_ranks(1) == [1, 5]
    with pytest.raises(ValueError, match="--ranks-per-node 4 must divide the world size 6"):
        Topology(world_size=6, rank=0, ranks_per_node=4)
