"""qwZ (ZeRO++, arXiv 2306.10209 section 3.1): the weights stage 3 gathers to compute with
go as INT8 blocks (one fp32 scale per block). Each member quantizes its chunks, the bytes
are all-gathered and every member dequantizes all rows, its own included, so all ranks
compute with the same weights. State dicts, persistent weights and evaluation keep the
exact gather (zeropp/collectives/exact.py). It charges the communicator's plain equivalent
with the gather it replaces (parallel/comm.py). Wire buffers come from the caller's
`BufferPool` and go back to it once the collective is done.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool, take_wire
from zeropp.collectives.exact import ShardGather
from zeropp.collectives.partition import Partition
from zeropp.collectives.protocols import PlannedCollective
from zeropp.kernels.quant import DEFAULT_BLOCK_SIZE, Quantized, dequantize, quantize, wire_nbytes
from zeropp.techniques.technique import Technique, check_block_size, key


@dataclass
class Keys:
    """qwZ's keys in zero_optimization."""
    zero_quantized_weights: bool | str = key(False, flag="zero_quantized_weights", auto=True)
    # elements per fp32 scale (this product's key: DeepSpeed fixes it)
    zero_quantized_weights_block_size: int = DEFAULT_BLOCK_SIZE[8]


def validate(zero, where: str):
    check_block_size(zero, where, "zero_quantized_weights_block_size", 4)   # INT8: 4 elements a word


class QuantizedShardGather(ShardGather):
    """qwZ: all-gather of INT8 blocks; the result is [N, total] in `inp`'s dtype, or,
    when `out` is a function `deliver(j, row)`, each member's row in turn: dequantized
    into one pooled [total] buffer and handed over, so the [N, total] rows are never
    materialized (stage 3 copies each row's pieces straight into the weights)."""

    delivers_rows = True

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[8]):
        super().__init__(comm)
        self.block_size = block_size

    def bytes_per_element(self, elem_bytes: int, members: int) -> float:
        """Delivering row by row into the weights: its input and one row, and the INT8 wire,
        received (1 + 4/block bytes) and sent (1/N of that)."""
        wire = (1 + 4 / self.block_size) * (1 + 1 / members)
        return 2 * elem_bytes / members + wire

    def plan(self, phase: str, total: int, elem_bytes: int, members: int) -> list[PlannedCollective]:
        """INT8 + an fp32 scale per block; `total` elements quantized, all `members` rows dequantized."""
        return [PlannedCollective(phase, "all_gather", "world", wire_nbytes(total, 8, self.block_size),
                                  quant_elements=(1 + members) * total, quant_bits=8)]

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
        send, (mine,) = take_wire(pool, 1, total, 8, self.block_size)
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


def build(ctx) -> QuantizedShardGather:
    return QuantizedShardGather(ctx.comm, ctx.zero.zero_quantized_weights_block_size)


TECHNIQUE = Technique("qwZ", "weight_gather", Keys, "zero_quantized_weights", build, validate)
