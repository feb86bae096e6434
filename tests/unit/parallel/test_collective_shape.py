"""The collectives in the shape of FSDP2's `AllGather` / `ReduceScatter` comms
(torch.distributed.fsdp, `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`):
`allocate(size, dtype=, device=)` and `__call__(output, input, group, [op,] async_op)`,
giving what `start()` gives, on 4 ranks as 2 emulated nodes x 2."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.comm import Communicator
from parallel.topology import Topology
from tests.distributed import run_distributed
from zeropp.collectives.exact import ShardGather, ShardReduce
from zeropp.collectives.partition import Partition
from zeropp.techniques.qgz import HierarchicalQuantizedReduce
from zeropp.techniques.qwz import QuantizedShardGather


def called_in_fsdp_shape(rank, world):
    comm = Communicator(Topology(world, rank, 2).build_groups())
    part = Partition(None, world, rank)
    g = torch.Generator().manual_seed(rank)
    inp = torch.randn(300, generator=g)
    every = torch.stack([torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    out = {}
    for name, gather in (("exact", ShardGather(comm)), ("qwz", QuantizedShardGather(comm))):
        buf = gather.allocate((world * 300,), dtype=torch.float32, device=torch.device("cpu"))
        assert gather(buf, inp, None, async_op=False) is None
        out[name] = torch.equal(buf.view(world, 300), gather.start(inp, part, "other", async_op=False).wait())
        handle = gather(buf, inp, None, async_op=True)
        handle.wait()
        out[name + "_async"] = torch.equal(buf.view(world, 300), gather.start(inp, part, "other", async_op=False).wait())
    buf = torch.empty(world * 300)
    ShardGather(comm)(buf, inp, None)
    out["exact_values"] = torch.equal(buf.view(world, 300), every)
    rows = torch.randn(world, 200, generator=g)
    for name, reduce in (("sum", ShardReduce(comm)), ("qgz", HierarchicalQuantizedReduce(comm))):
        mine = reduce.allocate((200,), dtype=torch.float32, device=torch.device("cpu"))
        reduce(mine, rows.clone().view(-1), None, dist.ReduceOp.SUM)
        ref = torch.empty(200)
        reduce.start(rows.clone(), ref, part, "other", async_op=False).wait()
        out[name] = torch.equal(mine, ref)
        avg = reduce.allocate((200,), dtype=torch.float32, device=torch.device("cpu"))
        reduce(avg, rows.clone().view(-1), None, dist.ReduceOp.AVG, async_op=True).wait()
        out[name + "_avg"] = torch.equal(avg, ref / world)
    return out


def test_collectives_called_as_fsdp2_comms_give_what_start_gives():
    for r in run_distributed(called_in_fsdp_shape, 4):
        assert all(r.values()), r
