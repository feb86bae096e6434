"""ZeRO++'s two quantized collectives, drop-in for those of zeropp/collectives/exact.py
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

- with `ErrorFeedback` (zeropp/techniques/loco.py, `zeropp_loco_param`), qgZ
  carries the quantization error of what a rank sent across nodes into its
  next reduction of the same bucket. The one lossy hop is then the inter-node
  one: inside the node the rows go exactly (an all-to-all in the
  communication dtype, on the fast link, summed in fp32), so the error lives
  in 1/L of the bucket per rank.
- with `hadamard` (`zero_hadamard_gradients`, zeropp/techniques/hadamard.py), each row,
  zero-padded to whole quantization blocks, is rotated block by block by a
  Walsh-Hadamard transform before its first INT4 quantization (an outlier is
  spread over its block, so the block's scale no longer crushes the rest);
  being linear, the sums stay rotated through every hop (and the error
  feedback lives in the rotated domain), and the final sum is rotated back
  once (dequantized into a pooled fp32 row, inverse, copied into the result).

Each charges the communicator's plain equivalent with the collective it
replaces (parallel/comm.py), so a run reports what ZeRO-3 would have sent.
Quantization runs in zeropp/kernels/quant.py: Triton kernels on CUDA, torch elsewhere.
Wire buffers come from the caller's `BufferPool` (counted, reused) and go back
to it once the collective is done; dequantization writes straight into the
result.
"""
from __future__ import annotations

from typing import Callable

import torch

from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.exact import ShardGather, ShardReduce
from zeropp.techniques.loco import ErrorFeedback
from zeropp.kernels.hadamard import check_hadamard_block, hadamard
from zeropp.collectives.partition import Partition
from zeropp.kernels.quant import (DEFAULT_BLOCK_SIZE, Quantized, dequantize, dequantize_reduce,
                          dequantize_reduce_requantize, quantize, wire_nbytes)
from zeropp.kernels.format import num_blocks


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
    `hadamard`: step 1 quantizes each padded row rotated, step 5 rotates the sum back.
    """

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[4], error_feedback: ErrorFeedback | None = None,
                 hadamard: bool = False):
        super().__init__(comm)
        self.block_size = block_size
        self.error_feedback = error_feedback
        self.hadamard = hadamard
        if hadamard:
            check_hadamard_block(block_size)
            if error_feedback is not None:   # its buffers hold rotated rows
                error_feedback.hadamard = block_size
        topo = comm.topology
        self.nodes, self.local = topo.num_nodes, topo.ranks_per_node
        self.intra_group, self.inter_group = topo.intra_node_group, topo.inter_node_group

    def _padded(self, bucket_elems: int) -> int:
        return bucket_elems + self.block_size * self.nodes * self.local   # each row to whole blocks

    def inflight_bytes(self, bucket_elems: int, elem_bytes: int = 4) -> int:
        # the INT4 wire of the first hop, sent and received; the second hop's two buffers
        # (1/L of it each, or all of it with L = 1) are taken once the first hop's send is back.
        # Hadamard: one fp32 row (1/W of the padded bucket) beside them, to rotate each row
        # before it is quantized, and the sum back once the last hop is in
        padded = self._padded(bucket_elems)
        row = 4 * -(-padded // (self.nodes * self.local)) if self.hadamard else 0
        if self.error_feedback is None:
            return 2 * wire_nbytes(padded, 4, self.block_size) + row
        # with error feedback, at most (all counted as if alive at once): the exact first hop's
        # reordered rows and what it received (the bucket each, `elem_bytes` an element), then
        # in fp32 the node sums (1/L of it), x (1/L) and one row (1/W <= 1/N), and the second
        # hop's INT4 wire, sent and received; Hadamard: the rotated node sums (1/L) beside x
        sums = (3 if self.hadamard else 2) / self.local
        return (2 * elem_bytes * padded + 4 * padded * (sums + 1 / self.nodes)
                + 2 * wire_nbytes(padded, 4, self.block_size))

    def _row_numel(self, total: int) -> int:
        """Elements of a wire row: `total`, or, rotated, `total` padded to whole blocks (the
        transform fills the padding); the same wire size either way."""
        return num_blocks(total, self.block_size) * self.block_size if self.hadamard else total

    def _quantize_row(self, row: torch.Tensor, dest: Quantized, rotated: torch.Tensor | None):
        """INT4 `row` into `dest`; with Hadamard, rotated in `rotated` (fp32, whole blocks) first."""
        if rotated is None:
            quantize(row, 4, self.block_size, out=dest)
            return
        rotated[:row.numel()].copy_(row)
        rotated[row.numel():].zero_()
        quantize(hadamard(rotated, self.block_size), 4, self.block_size, out=dest)

    def _sum_into(self, recv: torch.Tensor, out: torch.Tensor, total: int, pool: BufferPool):
        """Step 5: the received rows [k, nbytes] dequantized and summed into `out`; with
        Hadamard through a pooled fp32 row, rotated back."""
        if not self.hadamard:
            dequantize_reduce(Quantized.from_bytes(recv, total, 4, self.block_size), out.dtype, out=out)
            return
        n = self._row_numel(total)
        acc = pool.take(n, torch.float32)
        dequantize_reduce(Quantized.from_bytes(recv, n, 4, self.block_size), torch.float32, out=acc)
        out.copy_(hadamard(acc, self.block_size, inverse=True)[:total])
        pool.give(acc)

    def start(self, rows: torch.Tensor, out: torch.Tensor, partition: Partition, phase: str,
              async_op: bool = True, pool: BufferPool | None = None, key: int = 0):
        """`key`: which bucket this is (error feedback keeps one error per bucket)."""
        nodes, local, bs = self.nodes, self.local, self.block_size
        world, total = rows.shape
        if world != nodes * local:
            raise ValueError("qgZ reduces over the whole world, laid out as nodes x ranks per node")
        pool = pool or BufferPool(rows.device)
        padded = -(-total // bs) * bs
        self.comm.charge_plain("reduce_scatter", None, total * rows.element_size())
        by_node = rows.view(nodes, local, total)
        if self.error_feedback is not None:
            return self._start_compensated(by_node, out, phase, async_op, pool, key)
        n = self._row_numel(total)

        def quantize_rows(pairs):   # (row, its INT4 destination); Hadamard: one fp32 row to rotate in
            rotated = pool.take(n, torch.float32) if self.hadamard else None
            for row, dest in pairs:
                self._quantize_row(row, dest, rotated)
            if rotated is not None:
                pool.give(rotated)

        if local == 1:   # 4-5 only: row a to node a
            return self._inter_hop(lambda dests: quantize_rows(zip(by_node[:, 0], dests)), out, total, phase,
                                   async_op, pool)
        # 1. slot b*N + a <- row a*L + b, each padded to whole blocks (zeros), in INT4
        send, per_dest = _take_wire(pool, local, nodes * padded, 4, bs)
        quantize_rows((by_node[a, b], per_dest[b].row(a, n)) for b in range(local) for a in range(nodes))
        recv = pool.take(send.numel(), torch.uint8).view_as(send)
        # 2. inside the node
        first = self.comm.all_to_all(recv.view(-1), send.view(-1), group=self.intra_group,
                                     async_op=async_op, phase=phase, plain=False)

        if nodes == 1:  # 5. the node's sum is the result (padding blocks: same wire size)
            def finish():
                pool.give(send)
                self._sum_into(recv, out, total, pool)
                pool.give(recv)
                return out
            return Work(first, then=finish)

        def second() -> Work:  # 3-4, once the first hop is done
            pool.give(send)
            received = Quantized.from_bytes(recv, nodes * padded, 4, bs)   # [L senders], N rows each

            def fill(dests: list[Quantized]):   # row a of the node's sum, for node a
                for a, dest in enumerate(dests):
                    dequantize_reduce_requantize(received.row(a, n), 4, bs, out=dest)
            work = self._inter_hop(fill, out, total, phase, async_op, pool)
            pool.give(recv)
            return work

        return _TwoHops(first, second)

    def _start_compensated(self, by_node: torch.Tensor, out: torch.Tensor, phase: str, async_op: bool,
                           pool: BufferPool, key: int) -> Work:
        """qgZ with error feedback: inside the node the reordered rows (slot b*N + a <- row a*L + b)
        go exactly, in the communication dtype, by an all-to-all, and each rank sums the L rows
        it received in fp32: a reduce-scatter's bytes without its 16-bit sum (and gloo runs a
        reduce-scatter as an all-reduce: twice the bytes). Then the node's sums for owners of
        local index b go across nodes in INT4 with the carried error (`ErrorFeedback.send`).
        One node: the exact sum is the whole reduction (nothing crosses a node)."""
        nodes, local, total = by_node.shape
        ef = self.error_feedback

        def send_across(dests: list[Quantized]):   # with Hadamard, the node sums rotated
            if not self.hadamard:
                ef.send(key, node_sum, dests, pool)
                return
            n = self._row_numel(total)
            rotated = pool.take(nodes * n, torch.float32).view(nodes, n)
            rotated[:, :total].copy_(node_sum)
            rotated[:, total:].zero_()
            hadamard(rotated.view(-1), self.block_size)
            ef.send(key, rotated, dests, pool)
            pool.give(rotated)

        if local == 1:
            node_sum, first = by_node[:, 0], None
        else:
            send = pool.take(local * nodes * total, by_node.dtype).view(local, nodes, total)
            send.copy_(by_node.transpose(0, 1))
            recv = pool.take(send.numel(), by_node.dtype).view_as(send)
            node_sum = pool.take(nodes * total, torch.float32).view(nodes, total)
            first = self.comm.all_to_all(recv.view(-1), send.view(-1), group=self.intra_group,
                                         async_op=async_op, phase=phase, plain=False)

        def sum_in_node():   # once the first hop is done: the L received rows summed in fp32, in order
            pool.give(send)
            node_sum.copy_(recv[0])
            for part in recv[1:]:
                node_sum.add_(part)   # (torch.sum(dtype=float32) of 16-bit rows is ~5x slower on CPU)
            pool.give(recv)

        if nodes == 1:
            def finish():
                if first is None:   # one rank: its own rows are the sum
                    return out.copy_(node_sum[0])
                sum_in_node()
                out.copy_(node_sum[0])
                pool.give(node_sum)
                return out
            return Work(first, then=finish)

        def second() -> Work:
            if first is not None:
                sum_in_node()
            work = self._inter_hop(send_across, out, total, phase, async_op, pool)
            if first is not None:
                pool.give(node_sum)
            return work

        if first is None:
            return second()
        return _TwoHops(first, second)

    def _inter_hop(self, fill: Callable[[list[Quantized]], None], out: torch.Tensor, total: int, phase: str,
                   async_op: bool, pool: BufferPool) -> Work:
        """4-5: `fill(dests)` writes the INT4 row for node a (`total` elements; rotated, `total`
        padded to whole blocks) into `dests[a]`, its slot of the wire buffer."""
        nodes, bs = self.nodes, self.block_size
        send, per_node = _take_wire(pool, nodes, self._row_numel(total), 4, bs)
        fill(per_node)
        recv = pool.take(send.numel(), torch.uint8).view_as(send)
        work = self.comm.all_to_all(recv.view(-1), send.view(-1), group=self.inter_group, phase=phase,
                                    async_op=async_op, plain=False)

        def finish():  # rows of `total` have the wire size of `padded`: the padding is whole blocks
            pool.give(send)
            self._sum_into(recv, out, total, pool)
            pool.give(recv)
            return out
        return Work(work, then=finish)


def qgz_reduce(comm, zero) -> HierarchicalQuantizedReduce:
    """qgZ as `zero` (a ZeroConfig) sets it up: its block size, LoCo's error feedback, Hadamard."""
    loco = zero.zeropp_loco_param
    feedback = ErrorFeedback(loco.err_beta, loco.reset_T) if loco is not None else None
    return HierarchicalQuantizedReduce(comm, zero.zero_quantized_gradients_block_size, feedback,
                                       zero.zero_hadamard_gradients)
