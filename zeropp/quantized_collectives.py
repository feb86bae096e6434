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
Wire buffers come from the caller's `BufferPool` (counted, reused) and go back
to it once the collective is done; dequantization writes straight into the
result.
"""
from __future__ import annotations

from typing import Callable

import torch

from parallel.comm import Work
from zeropp.buffer_pool import BufferPool
from zeropp.collectives import ShardGather, ShardReduce
from zeropp.partition import Partition
from zeropp.quant import (DEFAULT_BLOCK_SIZE, Quantized, dequantize, dequantize_reduce,
                          dequantize_reduce_requantize, quantize, wire_nbytes)


def _take_wire(pool: BufferPool, rows: int, numel: int, bits: int,
               block_size: int) -> tuple[torch.Tensor, list[Quantized]]:
    """A wire buffer [rows, nbytes] from `pool` and, per row, its Quantized view of `numel`
    elements (scales then data, `Quantized.to_bytes`'s layout): the quantizers write
    straight into it, with no quantized copy or staging buffer besides."""
    nbytes = wire_nbytes(numel, bits, block_size)
    buf = pool.take(rows * nbytes, torch.uint8).view(rows, nbytes)
    views = [Quantized.from_bytes(buf[i], numel, bits, block_size) for i in range(rows)]
    assert all(v.scales.data_ptr() == buf[i].data_ptr() for i, v in enumerate(views)), "unaligned wire buffer"
    return buf, views


class QuantizedShardGather(ShardGather):
    """qwZ: all-gather of INT8 blocks; the result is [N, total] in `inp`'s dtype, or,
    when `out` is a function `deliver(j, row)`, each member's row in turn: dequantized
    into one pooled [total] buffer and handed over, so the [N, total] rows are never
    materialized (stage 3 copies each row's pieces straight into the weights)."""

    delivers_rows = True

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[8]):
        super().__init__(comm)
        self.block_size = block_size

    def start(self, inp: torch.Tensor, partition: Partition, phase: str, async_op: bool = True,
              out: torch.Tensor | None = None, plain: bool = True, pool: BufferPool | None = None):
        n, total = partition.size, inp.numel()
        deliver = out if callable(out) else None
        if out is None:
            out = torch.empty(n, total, dtype=inp.dtype, device=inp.device)
        if n == 1:
            if deliver is not None:
                deliver(0, inp)
                return Work(result=None)
            out[0].copy_(inp)
            return Work(result=out)
        pool = pool or BufferPool(inp.device)
        send, (mine,) = _take_wire(pool, 1, total, 8, self.block_size)
        send = send.view(-1)
        quantize(inp, 8, self.block_size, out=mine)
        recv = pool.take(n * send.numel(), torch.uint8).view(n, send.numel())
        work = self.comm.all_gather(recv.view(-1), send, group=partition.group, async_op=async_op,
                                    phase=phase, plain=False)
        if plain:
            self.comm.charge_plain("all_gather", partition.group, total * inp.element_size())

        def finish():
            pool.give(send)
            if deliver is None:
                dequantize(Quantized.from_bytes(recv, total, 8, self.block_size), out.dtype, out=out)
            else:
                row = pool.take(total, inp.dtype)
                for j in range(n):
                    deliver(j, dequantize(Quantized.from_bytes(recv[j], total, 8, self.block_size), inp.dtype,
                                          out=row))
                pool.give(row)
            pool.give(recv)
            return None if deliver is not None else out
        return Work(work, then=finish)


class _TwoHops(Work):
    """Two collectives in a row: `second()`, called once the first is done (by
    progress() or wait()), starts the second, whose result is the result."""

    def __init__(self, first: Work, second: Callable[[], Work]):
        super().__init__()
        self._first, self._start_second = first, second
        self._second: Work | None = None

    def _begin_second(self):
        self._first.wait()
        self._second = self._start_second()

    def progress(self) -> bool:
        if self._second is None:
            if not self._first.is_completed():
                return False
            self._begin_second()
        return self._second.is_completed()

    def is_completed(self) -> bool:
        return self._second is not None and self._second.is_completed()

    def wait(self):
        if self._second is None:
            self._begin_second()
        return self._second.wait()


class HierarchicalQuantizedReduce(ShardReduce):
    """qgZ: `rows` [W, total] (row p for global rank p) summed over all ranks,
    row p to rank p, through two INT4 all-to-alls. W = N nodes x L ranks, ranks
    node-major (p = a*L + b for node a, local rank b).

    1. Each row is zero-padded to a whole number of blocks and reordered so that
       the N rows whose owners have local index b are consecutive ("tensor slice
       reordering"): slot b*N + a holds row a*L + b. Each row is quantized to INT4
       straight into its slot of the wire buffer (no reordered copy).
    2. All-to-all inside the node: local rank b gets, from each of the L ranks
       of its node, the N rows of owners with local index b.
    3. Dequantize, sum the L contributions in fp32, requantize to INT4 (one
       fused kernel on CUDA).
    4. All-to-all among the N ranks of local index b (one per node): row a to
       the rank on node a.
    5. Dequantize and sum the N contributions in fp32: this rank's row.
    One node: step 2 then 5. One rank per node: step 1, 4 and 5.
    Asynchronously, steps 3-4 run as soon as step 2 is done (`progress()`,
    which the gradient reducer calls as gradients come in), step 5 in wait().
    """

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[4]):
        super().__init__(comm)
        self.block_size = block_size
        topo = comm.topology
        self.nodes, self.local = topo.num_nodes, topo.ranks_per_node
        self.intra_group, self.inter_group = topo.intra_node_group, topo.inter_node_group

    def _padded(self, bucket_elems: int) -> int:
        return bucket_elems + self.block_size * self.nodes * self.local   # each row to whole blocks

    def inflight_bytes(self, bucket_elems: int) -> int:
        # the INT4 wire of the first hop, sent and received; the second hop's two buffers
        # (1/L of it each, or all of it with L = 1) are taken once the first hop's send is back
        return 2 * wire_nbytes(self._padded(bucket_elems), 4, self.block_size)

    def start(self, rows: torch.Tensor, out: torch.Tensor, partition: Partition, phase: str,
              async_op: bool = True, pool: BufferPool | None = None):
        nodes, local, bs = self.nodes, self.local, self.block_size
        world, total = rows.shape
        if world != nodes * local:
            raise ValueError("qgZ reduces over the whole world, laid out as nodes x ranks per node")
        pool = pool or BufferPool(rows.device)
        padded = -(-total // bs) * bs
        self.comm.charge_plain("reduce_scatter", None, total * rows.element_size())
        by_node = rows.view(nodes, local, total)
        if local == 1:   # 4-5 only: row a to node a
            return self._inter_hop(lambda a, dest: quantize(by_node[a, 0], 4, bs, out=dest), out, total, phase,
                                   async_op, pool)
        # 1. slot b*N + a <- row a*L + b, each padded to whole blocks (zeros), in INT4
        send, per_dest = _take_wire(pool, local, nodes * padded, 4, bs)
        for b, dest in enumerate(per_dest):
            for a in range(nodes):
                quantize(by_node[a, b], 4, bs, out=dest.row(a, total))
        recv = pool.take(send.numel(), torch.uint8).view_as(send)
        # 2. inside the node
        first = self.comm.all_to_all(recv.view(-1), send.view(-1), group=self.intra_group,
                                     async_op=async_op, phase=phase, plain=False)

        if nodes == 1:  # 5. the node's sum is the result (padding blocks: same wire size)
            def finish():
                dequantize_reduce(Quantized.from_bytes(recv, total, 4, bs), out.dtype, out=out)
                pool.give(send)
                pool.give(recv)
                return out
            return Work(first, then=finish)

        def second() -> Work:  # 3-4, once the first hop is done
            pool.give(send)
            received = Quantized.from_bytes(recv, nodes * padded, 4, bs)   # [L senders], N rows each

            def fill(a: int, dest: Quantized):   # row a of the node's sum, for node a
                dequantize_reduce_requantize(received.row(a, total), 4, bs, out=dest)
            work = self._inter_hop(fill, out, total, phase, async_op, pool)
            pool.give(recv)
            return work

        return _TwoHops(first, second)

    def _inter_hop(self, fill: Callable[[int, Quantized], None], out: torch.Tensor, total: int, phase: str,
                   async_op: bool, pool: BufferPool) -> Work:
        """4-5: `fill(a, dest)` writes the INT4 row for node a (`total` elements) into `dest`,
        its slot of the wire buffer."""
        nodes, bs = self.nodes, self.block_size
        send, per_node = _take_wire(pool, nodes, total, 4, bs)
        for a, dest in enumerate(per_node):
            fill(a, dest)
        recv = pool.take(send.numel(), torch.uint8).view_as(send)
        work = self.comm.all_to_all(recv.view(-1), send.view(-1), group=self.inter_group, phase=phase,
                                    async_op=async_op, plain=False)

        def finish():  # rows of `total` have the wire size of `padded`: the padding is whole blocks
            dequantize_reduce(Quantized.from_bytes(recv, total, 4, bs), out.dtype, out=out)
            pool.give(send)
            pool.give(recv)
            return out
        return Work(work, then=finish)
