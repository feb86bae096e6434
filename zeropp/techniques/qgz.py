"""qgZ (ZeRO++, arXiv 2306.10209 section 3.3): the gradient reduce-scatter replaced by two
all-to-alls of INT4 blocks, inside each node, then between the ranks of the same local
index, with a dequantize-sum-requantize between the hops. The result is the sum a
reduce-scatter gives (the caller scales it), within the INT4 bound. With
`zero_quantized_gradients_bits` 2 the hop between nodes sends INT2 blocks instead (the node's
sums requantized to ternary values, zeropp/kernels/quant.py): 0.28 instead of 0.53 bytes an
element on the slow link; the hop inside the node stays INT4. Without error feedback that
loses most of each block (max|x| / 2 an element): the configuration refuses it without LoCo
(measured: bench/results/convergence_int2_without_loco_1234.json).

With `hadamard` (`zero_hadamard_gradients`, zeropp/techniques/hadamard.py; Hadamard smoothing
as in SDP4Bit, arXiv 2410.15526), each row, zero-padded to whole quantization blocks, is
rotated block by block by a Walsh-Hadamard transform before its first INT4 quantization (an
outlier is spread over its block, so the block's scale no longer crushes the rest); being
linear, the sums stay rotated through every hop, and the final sum is rotated back once
(dequantized into a pooled fp32 row, inverse, copied into the result). With LoCo's error
feedback the reduction is zeropp/techniques/loco.py's `CompensatedReduce`.

It charges the communicator's plain equivalent with the reduce-scatter it replaces
(parallel/comm.py), so a run reports what ZeRO-3 would have sent. Wire buffers come from
the caller's `BufferPool` (counted, reused) and go back to it once the collective is done;
dequantization writes straight into the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common import ConfigError

from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool, take_wire
from zeropp.collectives.exact import ShardReduce
from zeropp.collectives.partition import Partition
from zeropp.collectives.protocols import PlannedCollective
from zeropp.collectives.two_hop import TwoHops
from zeropp.kernels.format import num_blocks
from zeropp.kernels.quant import (DEFAULT_BLOCK_SIZE, Quantized, dequantize_reduce, dequantize_reduce_requantize,
                                  quantize, wire_nbytes)
from zeropp.kernels.hadamard import check_hadamard_block, hadamard
from zeropp.techniques.technique import Technique, check_bits, check_block_size, key


@dataclass
class Keys:
    """qgZ's keys in zero_optimization."""
    zero_quantized_gradients: bool | str = key(False, flag="zero_quantized_gradients", auto=True)
    # elements per fp32 scale (this product's key: DeepSpeed fixes it)
    zero_quantized_gradients_block_size: int = DEFAULT_BLOCK_SIZE[4]
    # bits of the hop between nodes: 4, or 2 (INT2 blocks); the hop inside a node stays INT4
    zero_quantized_gradients_bits: int = key(4, flag="zero_quantized_gradients_bits")


def validate(zero, where: str):
    check_block_size(zero, where, "zero_quantized_gradients_block_size", 8)   # INT4: 8 elements a word
    bits, key_, flag = (zero.zero_quantized_gradients_bits, f"{where}.zero_quantized_gradients_bits",
                        "--zero-quantized-gradients-bits")
    check_bits(bits, key_, flag, "INT2 across nodes")
    if bits == 4:
        return
    if zero.zero_quantized_gradients is not True:
        raise ConfigError(f"{key_} ({flag}) {bits} sets the bits of qgZ's gradients across nodes: set "
                          f"zero_quantized_gradients true (--zero-quantized-gradients), "
                          f"got {zero.zero_quantized_gradients!r}")
    if zero.zeropp_loco_param is None:   # measured: bench/results/convergence_int2_without_loco_1234.json
        raise ConfigError(f"{key_} ({flag}) 2 without error feedback does not train as ZeRO-3 does (ternary "
                          f"gradients lose what they do not send): add zeropp_loco_param (--zero-loco)")
    if zero.zero_quantized_gradients_block_size < 16:   # a block's INT2 data: whole 4-byte words
        raise ConfigError(f"{key_} ({flag}) 2 needs zero_quantized_gradients_block_size >= 16 (the scales stay "
                          f"4-byte aligned on the wire), got {zero.zero_quantized_gradients_block_size}")


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

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[4], hadamard: bool = False, bits: int = 4):
        super().__init__(comm)
        self.block_size = block_size
        self.hadamard = hadamard
        self.bits = bits   # of the hop between nodes (4 or 2); inside the node always INT4
        if hadamard:
            check_hadamard_block(block_size)
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
        return 2 * wire_nbytes(padded, 4, self.block_size) + row   # INT2 across: smaller than the INT4 hop

    def plan(self, total: int, elem_bytes: int) -> list[PlannedCollective]:
        """An all-to-all of L x wire_nbytes(N P) inside the node, then of N x wire_nbytes(P) between
        nodes (P: `total` padded to whole blocks); (2W + N) P elements through the INT4 kernels
        (quantize W rows, dequantize-requantize them, dequantize N), Hadamard's transform of the W
        rows and its inverse on the sum besides."""
        nodes, local, bs = self.nodes, self.local, self.block_size
        padded = -(-total // bs) * bs
        q = (2 * nodes * local + nodes) * padded + int(self.hadamard) * (nodes * local + 1) * padded
        out = []
        if local > 1:
            out.append(PlannedCollective("grad_reduce", "all_to_all", "intra", local * wire_nbytes(nodes * padded, 4, bs),
                                         quant_elements=q, quant_bits=4))
            q = 0
        if nodes > 1:
            out.append(PlannedCollective("grad_reduce", "all_to_all", "inter", nodes * wire_nbytes(padded, self.bits, bs),
                                         quant_elements=q, quant_bits=self.bits))
        return out

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

    def _sum_into(self, recv: torch.Tensor, out: torch.Tensor, total: int, pool: BufferPool, bits: int = 4):
        """Step 5: the received rows [k, nbytes] (`bits`) dequantized and summed into `out`; with
        Hadamard through a pooled fp32 row, rotated back."""
        if not self.hadamard:
            dequantize_reduce(Quantized.from_bytes(recv, total, bits, self.block_size), out.dtype, out=out)
            return
        n = self._row_numel(total)
        acc = pool.take(n, torch.float32)
        dequantize_reduce(Quantized.from_bytes(recv, n, bits, self.block_size), torch.float32, out=acc)
        out.copy_(hadamard(acc, self.block_size, inverse=True)[:total])
        pool.give(acc)

    def start(self, rows: torch.Tensor, out: torch.Tensor, partition: Partition, phase: str,
              async_op: bool = True, pool: BufferPool | None = None, key: int = 0):
        """`key`: which bucket this is (a reduction that keeps state per bucket needs it)."""
        nodes, local = self.nodes, self.local
        world, total = rows.shape
        if world != nodes * local:
            raise ValueError("qgZ reduces over the whole world, laid out as nodes x ranks per node")
        pool = pool or BufferPool(rows.device)
        self.comm.charge_plain("reduce_scatter", None, total * rows.element_size())
        return self._reduce(rows.view(nodes, local, total), out, phase, async_op, pool, key)

    def start_across(self, rows: torch.Tensor, out: torch.Tensor, group, phase: str, async_op: bool = True,
                     pool: BufferPool | None = None, key=0) -> Work:
        """Steps 4-5 alone, over `group` of R members: `rows` [R, total], each already a sum taken
        inside the node (HSDP's reduce-scatter inside the node, zeropp/fsdp/replicate.py), row a to
        member a, summed into `out`. The caller charges the plain collective it replaces."""
        pool = pool or BufferPool(rows.device)
        return self._reduce(rows.unsqueeze(1), out, phase, async_op, pool, key, across=(group, rows.shape[0]))

    def _reduce(self, by_node: torch.Tensor, out: torch.Tensor, phase: str, async_op: bool, pool: BufferPool,
                key: int, across=None) -> Work:
        """Steps 1-5 on the rows [N, L, total]; `across`: (group, size) of the hop between nodes
        (default: the inter-node group)."""
        nodes, local, total = by_node.shape
        bs = self.block_size
        padded = -(-total // bs) * bs
        n = self._row_numel(total)

        def quantize_rows(pairs):   # (row, its INT4 destination); Hadamard: one fp32 row to rotate in
            rotated = pool.take(n, torch.float32) if self.hadamard else None
            for row, dest in pairs:
                self._quantize_row(row, dest, rotated)
            if rotated is not None:
                pool.give(rotated)

        if local == 1:   # 4-5 only: row a to node a
            return self._inter_hop(lambda dests: quantize_rows(zip(by_node[:, 0], dests)), out, total, phase,
                                   async_op, pool, across)
        # 1. slot b*N + a <- row a*L + b, each padded to whole blocks (zeros), in INT4
        send, per_dest = take_wire(pool, local, nodes * padded, 4, bs)
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
                    dequantize_reduce_requantize(received.row(a, n), self.bits, bs, out=dest)
            work = self._inter_hop(fill, out, total, phase, async_op, pool)
            pool.give(recv)
            return work

        return TwoHops(first, second)

    def _inter_hop(self, fill: Callable[[list[Quantized]], None], out: torch.Tensor, total: int, phase: str,
                   async_op: bool, pool: BufferPool, across=None) -> Work:
        """4-5: `fill(dests)` writes the row for node a in `self.bits` (`total` elements; rotated,
        `total` padded to whole blocks) into `dests[a]`, its slot of the wire buffer."""
        group, nodes = across or (self.inter_group, self.nodes)
        bs = self.block_size
        send, per_node = take_wire(pool, nodes, self._row_numel(total), self.bits, bs)
        fill(per_node)
        recv = pool.take(send.numel(), torch.uint8).view_as(send)
        work = self.comm.all_to_all(recv.view(-1), send.view(-1), group=group, phase=phase,
                                    async_op=async_op, plain=False)

        def finish():  # rows of `total` have the wire size of `padded`: the padding is whole blocks
            pool.give(send)
            self._sum_into(recv, out, total, pool, self.bits)
            pool.give(recv)
            return out
        return Work(work, then=finish)


def build(ctx) -> HierarchicalQuantizedReduce:
    return HierarchicalQuantizedReduce(ctx.comm, ctx.zero.zero_quantized_gradients_block_size, bool(ctx.rotation),
                                       ctx.zero.zero_quantized_gradients_bits)


TECHNIQUE = Technique("qgZ", "gradient_reduction", Keys, "zero_quantized_gradients", build, validate)
