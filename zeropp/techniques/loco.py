"""LoCo (`zeropp_loco_param`, arXiv 2407.04480): qgZ's reduction with error feedback. The INT4
(or, with `zero_quantized_gradients_bits` 2, INT2) error of what a rank sends across nodes is
carried into its next reduction of the same gradient bucket (`ErrorFeedback`,
zeropp/techniques/error_feedback.py: its format, its commit with the step, its checkpoints);
inside the node the rows go exactly (`CompensatedReduce`). With Hadamard smoothing the rows
are sent, and their errors kept, rotated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common import ConfigError
from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.exact import all_to_all_sum
from zeropp.collectives.protocols import PlannedCollective
from zeropp.collectives.two_hop import TwoHops
from zeropp.kernels.quant import DEFAULT_BLOCK_SIZE
from zeropp.kernels.format import Quantized, wire_nbytes
from zeropp.kernels.hadamard import hadamard
from zeropp.techniques import error_feedback
from zeropp.techniques.error_feedback import ErrorFeedback
from zeropp.techniques.qgz import HierarchicalQuantizedReduce
from zeropp.techniques.technique import Technique, key

LOCO_ERR_BETA = {4: 0.8, 2: 0.95}   # unset err_beta by the bits across nodes (docs/results.md, convergence)


@dataclass
class LocoConfig:
    """`zeropp_loco_param` (DeepSpeed's spelling): error feedback for qgZ's INT4 hop
    (zeropp/techniques/qgz.py). The error carried to the next reduction is
    err_beta x the old one + (1 - err_beta) x this quantization's; every reset_T
    reductions of a bucket it starts again from zero (unset err_beta: LOCO_ERR_BETA)."""
    err_beta: float | None = None
    reset_T: int = 1024

    def validate(self, where: str):
        if not 0 <= self.err_beta < 1:
            raise ConfigError(f"{where}.err_beta must be in [0, 1) (0: carry the whole last error), "
                              f"got {self.err_beta}")
        if self.reset_T < 1:
            raise ConfigError(f"{where}.reset_T must be >= 1 (reductions between resets), got {self.reset_T}")


@dataclass
class Keys:
    """LoCo's key in zero_optimization: its parameters (None: off; --zero-loco: the defaults)."""
    zeropp_loco_param: LocoConfig | None = key(None, flag="zero_loco", section=LocoConfig)


def validate(zero, where: str):
    loco = zero.zeropp_loco_param
    if loco is None:
        return
    if loco.err_beta is None:
        loco.err_beta = LOCO_ERR_BETA.get(zero.zero_quantized_gradients_bits, 0.8)
    loco.validate(f"{where}.zeropp_loco_param")
    if zero.zero_quantized_gradients is not True:
        raise ConfigError(f"{where}.zeropp_loco_param (--zero-loco) is error feedback for qgZ's quantized "
                          f"gradients: set zero_quantized_gradients true (--zero-quantized-gradients), "
                          f"got {zero.zero_quantized_gradients!r}")


class CompensatedReduce(HierarchicalQuantizedReduce):
    """qgZ with LoCo's error feedback: exact inside the node, INT4 (or INT2: `bits`) with the
    carried error across."""

    def __init__(self, comm, block_size: int = DEFAULT_BLOCK_SIZE[4], error_feedback: ErrorFeedback | None = None,
                 hadamard: bool = False, bits: int = 4):
        super().__init__(comm, block_size, hadamard, bits)
        self.error_feedback = error_feedback

    def expect(self, bucket_totals: dict[int, int], topology, device):
        self.error_feedback.expect({k: (topology.num_nodes, t) for k, t in bucket_totals.items()},
                                   topology.world_size, topology.num_nodes, device)

    def carried_parts(self) -> dict:
        return {"error_feedback": self.error_feedback}

    def plan(self, total: int, elem_bytes: int) -> list[PlannedCollective]:
        """An exact all-to-all inside the node (summed in fp32), then INT4 across with the carried
        error: quantize and dequantize N rows, dequantize N parts (Hadamard: N rows and the sum
        rotated besides)."""
        nodes, local, bs = self.nodes, self.local, self.block_size
        padded = -(-total // bs) * bs
        out = []
        if local > 1:
            out.append(PlannedCollective("grad_reduce", "all_to_all", "intra", local * nodes * total * elem_bytes))
        if nodes > 1:
            q = (3 * nodes + int(self.hadamard) * (nodes + 1)) * padded
            out.append(PlannedCollective("grad_reduce", "all_to_all", "inter", nodes * wire_nbytes(padded, self.bits, bs),
                                         quant_elements=q, quant_bits=self.bits))
        return out

    def inflight_bytes(self, bucket_elems: int, elem_bytes: int = 4) -> int:
        # at most (all counted as if alive at once): the exact first hop's reordered rows and
        # what it received (the bucket each, `elem_bytes` an element), then in fp32 the node sums
        # (1/L of it), the carried error dequantized and x (1/L each) and one row (1/W <= 1/N),
        # and the second hop's wire, sent and received; Hadamard: the rotated node sums (1/L)
        padded = self._padded(bucket_elems)
        sums = (4 if self.hadamard else 3) / self.local
        return (2 * elem_bytes * padded + 4 * padded * (sums + 1 / self.nodes)
                + 2 * wire_nbytes(padded, self.bits, self.block_size))

    def _reduce(self, by_node: torch.Tensor, out: torch.Tensor, phase: str, async_op: bool, pool: BufferPool,
                key: int, across=None) -> Work:
        """qgZ with error feedback: inside the node the reordered rows (slot b*N + a <- row a*L + b)
        go exactly, in the communication dtype, by an all-to-all, and each rank sums the L rows
        it received in fp32: a reduce-scatter's bytes without its 16-bit sum (the plain reduction's
        own hop, `all_to_all_sum`). Then the node's sums for owners of
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
            send = pool.take(local * nodes * total, by_node.dtype).view(local, nodes * total)
            send.view(local, nodes, total).copy_(by_node.transpose(0, 1))
            node_sum = pool.take(nodes * total, torch.float32).view(nodes, total)
            # the plain reduce-scatter's own hop (collectives/exact.py): the L rows summed in fp32, in order
            first = all_to_all_sum(self.comm, send, node_sum, self.intra_group, phase, async_op, pool, plain=False)
            first = Work(first, then=lambda: pool.give(send.view(-1)))

        if nodes == 1:
            def finish():
                if first is None:   # one rank: its own rows are the sum
                    return out.copy_(node_sum[0])
                first.wait()
                out.copy_(node_sum[0])
                pool.give(node_sum)
                return out
            return Work(first, then=finish)

        def second() -> Work:
            if first is not None:
                first.wait()
            work = self._inter_hop(send_across, out, total, phase, async_op, pool, across)
            if first is not None:
                pool.give(node_sum)
            return work

        if first is None:
            return second()
        return TwoHops(first, second)


def build(ctx) -> CompensatedReduce:
    """qgZ's reduction with the error carried (the config requires qgZ with LoCo)."""
    loco = ctx.zero.zeropp_loco_param
    return CompensatedReduce(ctx.comm, ctx.zero.zero_quantized_gradients_block_size,
                             ErrorFeedback(loco.err_beta, loco.reset_T, ctx.rotation), bool(ctx.rotation),
                             ctx.zero.zero_quantized_gradients_bits)


TECHNIQUE = Technique("LoCo", "gradient_reduction", Keys, "zeropp_loco_param", build, validate,
                      carries={"error_feedback": "qgZ's error feedback (zeropp_loco_param)"},
                      memory_key=error_feedback.MEMORY_KEY)
