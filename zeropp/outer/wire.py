"""What an exchange of the outer synchronization (zeropp/outer/diloco.py) puts on the wire: the
encoding of a quantized outer gradient (INT4 blocks, or topk2's sparse 2-bit code) and its
decoding into the members' mean, the bytes a rank sends per inner step (the planner's figure) and
the bytes of exchanges in flight at once (the memory report's bound)."""
from __future__ import annotations

import torch

from zeropp.collectives.protocols import PlannedCollective
from zeropp.kernels import sparse
from zeropp.kernels.format import Quantized, wire_nbytes
from zeropp.kernels.quant import dequantize, dequantize_reduce, quantize
from zeropp.outer.settings import PHASE, OuterSettings


def outer_wire_nbytes(numel: int, s: OuterSettings) -> int:
    """Bytes a rank sends for `numel` elements of outer gradient, quantized (int4, topk2)."""
    if s.quantization == "topk2":
        return sparse.wire_nbytes(numel, s.topk_fraction)
    return wire_nbytes(numel, 4, s.block_size)


def encode_outer(send: torch.Tensor, s: OuterSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized outer gradient: (its wire, what the wire decodes to)."""
    if s.quantization == "topk2":
        q = sparse.encode(send, s.topk_fraction)
        return q.to_bytes(), sparse.decode(q)
    q = quantize(send, 4, s.block_size)
    return q.to_bytes(), dequantize(q)


def decode_mean(buf: torch.Tensor, numel: int, groups: int, s: OuterSettings) -> torch.Tensor:
    """The mean of the gathered wires `buf` [groups, bytes], fp32 [numel]."""
    if s.quantization == "topk2":
        return sparse.decode_reduce(sparse.SparseTopK.from_bytes(buf, numel, s.topk_fraction), 1.0 / groups)
    return dequantize_reduce(Quantized.from_bytes(buf, numel, 4, s.block_size), torch.float32, 1.0 / groups)


def decode_weighted(buf: torch.Tensor, numel: int, weights: list[float], s: OuterSettings) -> torch.Tensor:
    """sum_i weights[i] * decode(buf[i]), fp32 [numel]: each row's scales times its weight, then the
    rows' plain sum (a row of weight 0, e.g. a member that sent nothing, adds zeros)."""
    w = torch.tensor(weights, dtype=torch.float32, device=buf.device).unsqueeze(1)
    if s.quantization == "topk2":
        sp = sparse.SparseTopK.from_bytes(buf, numel, s.topk_fraction)
        sp.scales = sp.scales * w
        return sparse.decode_reduce(sp, 1.0)
    q = Quantized.from_bytes(buf, numel, 4, s.block_size)
    q.scales = q.scales * w
    return dequantize_reduce(q, torch.float32, 1.0)


def exchange_per_step(owned: int, s: OuterSettings) -> PlannedCollective:
    """A rank's exchanges of one inner step over the group "outer" (a rank of every group), for
    `owned` master elements: every fragment once in H steps, so the whole shard / H (rounded down)."""
    if s.quantization == "none":
        return PlannedCollective(PHASE, "all_reduce", "outer", owned * 4 // s.interval)
    return PlannedCollective(PHASE, "all_gather", "outer", outer_wire_nbytes(owned, s) // s.interval,
                             owned // s.interval, 4)


def in_flight_bound(numels: list[int], s: OuterSettings, groups: int) -> int:
    """The most bytes of exchanges in flight at once (`Exchange.nbytes`), for fragments of `numels`
    master elements: those issued in the last w = max(delay, 1) inner steps, at the worst step.
    Fragment f is in flight over the steps [f H // F, f H // F + w) modulo H; the sum is largest at
    some fragment's issue, so a window sliding over the issues (sorted, then again shifted by H)
    finds it in O(F), whatever H."""
    def held(n):   # my outer gradient and (exact) my locals to sum or (int4) the error and the wires
        return 8 * n + (0 if s.quantization == "none" else (groups + 1) * outer_wire_nbytes(n, s))
    w, H, F = max(s.delay, 1), s.interval, len(numels)
    issues = [(f * H // F, held(n)) for f, n in enumerate(numels)]
    issues += [(at + H, b) for at, b in issues]
    best = total = lo = 0
    for at, b in issues:
        total += b
        while issues[lo][0] <= at - w:   # issued w or more steps before: merged by now
            total -= issues[lo][1]
            lo += 1
        best = max(best, total)
    return best
