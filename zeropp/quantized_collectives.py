"""ZeRO++'s two quantized collectives, drop-in for those of zeropp/collectives.py
(REFERENCE.md section 2):

- `QuantizedShardGather` (qwZ): each member quantizes its chunks to INT8 in
  blocks (one fp32 scale per block), the bytes are all-gathered and every
  member dequantizes all rows, its own included, so all ranks compute with the
  same weights. Used for the weights stage 3 gathers to compute with; state
  dicts and persistent weights keep the exact gather.
- `HierarchicalQuantizedReduce` (qgZ): replaces the gradient reduce-scatter
  by two all-to-alls of INT4 blocks: inside each node, then between the ranks
  of the same local index, with a dequantize-sum-requantize between the hops.
  The result is the sum a reduce-scatter gives (the caller scales it), within
  the INT4 bound.

Each charges the communicator's plain equivalent with the collective it
replaces (parallel/comm.py), so a run reports what ZeRO-3 would have sent.
Quantization runs in zeropp/quant.py: Triton kernels on CUDA, torch elsewhere.
"""
from __future__ import annotations

import torch

from parallel.comm import Work
from zeropp.collectives import ShardGather, ShardReduce
from zeropp.partition import Partition
from zeropp.quant import (DEFAULT_BLOCK_SIZE, Quantized, dequantize, dequantize_reduce,
                          dequantize_reduce_requantize, quantize)


class QuantizedShardGather(ShardGather):
    """qwZ: all-gather of INT8 blocks; the result is [N, total] in `inp`'s dtype."""

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[8]):
        super().__init__(comm)
        self.block_size = block_size

    def start(self, inp: torch.Tensor, partition: Partition, phase: str, async_op: bool = True,
              out: torch.Tensor | None = None, plain: bool = True):
        n, total = partition.size, inp.numel()
        if out is None:
            out = torch.empty(n, total, dtype=inp.dtype, device=inp.device)
        if n == 1:
            out[0].copy_(inp)
            return Work(result=out)
        send = quantize(inp, 8, self.block_size).to_bytes()
        recv = torch.empty(n, send.numel(), dtype=torch.uint8, device=inp.device)
        work = self.comm.all_gather(recv.view(-1), send, group=partition.group, async_op=async_op,
                                    phase=phase, plain=False)
        if plain:
            self.comm.charge_plain("all_gather", partition.group, total * inp.element_size())

        def finish():
            rows = Quantized.from_bytes(recv, total, 8, self.block_size)
            out.copy_(dequantize(rows, out.dtype).view(n, total))
            return out
        return Work(work, then=finish)


class HierarchicalQuantizedReduce(ShardReduce):
    """qgZ: `rows` [W, total] (row p for global rank p) summed over all ranks,
    row p to rank p, through two INT4 all-to-alls. W = N nodes x L ranks, ranks
    node-major (p = a*L + b for node a, local rank b).

    1. Each row is zero-padded to a whole number of blocks and reordered so that
       the N rows whose owners have local index b are consecutive ("tensor slice
       reordering"): slot b*N + a holds row a*L + b. Quantized to INT4.
    2. All-to-all inside the node: local rank b gets, from each of the L ranks
       of its node, the N rows of owners with local index b.
    3. Dequantize, sum the L contributions in fp32, requantize to INT4 (one
       fused kernel on CUDA).
    4. All-to-all among the N ranks of local index b (one per node): row a to
       the rank on node a.
    5. Dequantize and sum the N contributions in fp32: this rank's row.
    One node: step 2 then 5. One rank per node: step 1, 4 and 5.
    """

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[4]):
        super().__init__(comm)
        self.block_size = block_size
        topo = comm.topology
        self.nodes, self.local = topo.num_nodes, topo.ranks_per_node
        self.intra_group, self.inter_group = topo.intra_node_group, topo.inter_node_group

    def start(self, rows: torch.Tensor, out: torch.Tensor, partition: Partition, phase: str,
              async_op: bool = True):
        nodes, local, bs = self.nodes, self.local, self.block_size
        world, total = rows.shape
        if partition.group is not None or world != nodes * local:
            raise ValueError("qgZ reduces over the whole world, laid out as nodes x ranks per node")
        padded = -(-total // bs) * bs
        self.comm.charge_plain("reduce_scatter", None, total * rows.element_size())
        # 1. slot b*N + a <- row a*L + b, padded to whole blocks
        slots = rows.new_zeros(local, nodes, padded)
        slots[:, :, :total].copy_(rows.view(nodes, local, total).transpose(0, 1))
        q = quantize(slots.view(-1), 4, bs)
        per_dest = Quantized(q.data.view(local, -1), q.scales.view(local, -1), nodes * padded, 4, bs)
        if local == 1:
            return self._inter_hop(per_dest[0], out, total, padded, phase)
        send = per_dest.to_bytes()
        recv = torch.empty_like(send)
        # 2. inside the node
        work = self.comm.all_to_all(recv.view(-1), send.view(-1), group=self.intra_group,
                                    async_op=async_op, phase=phase, plain=False)

        def finish():
            parts = Quantized.from_bytes(recv, nodes * padded, 4, bs)
            if nodes == 1:  # 5. the node's sum is the result
                out.copy_(dequantize_reduce(parts, out.dtype)[:total])
                return out
            # 3. the node's partial sums for the N owners of my local index
            return self._inter_hop(dequantize_reduce_requantize(parts, 4, bs), out, total, padded,
                                   phase).wait()
        return Work(work, then=finish)

    def _inter_hop(self, partial: Quantized, out: torch.Tensor, total: int, padded: int, phase: str):
        """4-5: `partial` holds N rows of `padded` elements, row a for node a."""
        nodes, bs = self.nodes, self.block_size
        rows = Quantized(partial.data.view(nodes, -1), partial.scales.view(nodes, -1), padded, 4, bs)
        send = rows.to_bytes()
        recv = torch.empty_like(send)
        self.comm.all_to_all(recv.view(-1), send.view(-1), group=self.inter_group, phase=phase,
                             plain=False)
        out.copy_(dequantize_reduce(Quantized.from_bytes(recv, padded, 4, bs), out.dtype)[:total])
        return Work(result=out)
