"""The weight deltas' wire (zeropp/techniques/deltas.py): a rank's delta quantized and checked
small enough to send, and at the receiver the previous weights plus every member's dequantized
delta, a group of members at a time."""
from __future__ import annotations

import torch

from zeropp.kernels.format import ERROR_STEPS
from zeropp.kernels.quant import DEFAULT_BLOCK_SIZE, QMAX, Quantized, dequantize_add, quantize

BLOCK_SIZE = DEFAULT_BLOCK_SIZE[4]   # INT2's is the same
BOUND_BITS = {4: 8, 2: 4}   # a delta's error is held to half the step of these bits over the new values
DEQUANT_ELEMENTS = 1 << 22   # fp32 elements dequantized at once (16 MB): a weight's members in groups


def small_delta(shard: torch.Tensor, recon: torch.Tensor, wire: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Quantize my chunk's delta (`shard` - `recon`) into `wire` in `bits`; whether it is small (a
    bool on the device): in every block its largest error at most half the BOUND_BITS step of the new values."""
    new = shard.float()
    q = quantize(new - recon.float(), bits, BLOCK_SIZE,
                 out=Quantized.from_bytes(wire, new.numel(), bits, BLOCK_SIZE))
    nb = q.scales.numel()
    amax = torch.nn.functional.pad(new, (0, nb * BLOCK_SIZE - new.numel())).view(nb, -1).abs().amax(1)
    # NaN compares False; an infinite scale would pass as inf <= inf: not small either way
    error = q.scales * ERROR_STEPS[bits]
    return torch.isfinite(q.scales).all() & (error <= amax / (2 * QMAX[BOUND_BITS[bits]])).all()


def copy_previous(weights, chunks: list[int], previous: torch.Tensor):
    """Into each weight, the previous weights' slices of the h members of my group, row by row
    (`previous`: [h, the weights' slices end to end], `chunks`: each weight's slice)."""
    off = 0
    for s, c in zip(weights, chunks):
        flat = s.full.view(-1)
        for i in range(previous.shape[0]):
            lo, hi = i * c, min((i + 1) * c, s.numel)
            if hi > lo:
                flat[lo:hi].copy_(previous[i, off:off + hi - lo])
        off += c


def members_at_once(s, world: int) -> int:
    """Members of weight `s` dequantized at once (DEQUANT_ELEMENTS fp32 elements at most)."""
    return max(1, min(world, DEQUANT_ELEMENTS // s.chunk))


def dequant_elements(weights, world: int) -> int:
    """The fp32 elements a gather of `weights` dequantizes into at once."""
    return max(members_at_once(s, world) * s.chunk for s in weights)


def add_deltas(s, wires: torch.Tensor, scratch: torch.Tensor, h: int, world: int, bits: int = 4):
    """Add every member's dequantized delta to `s.full` (which holds the previous weights).
    `wires`: [h, W/h, bytes], member g h + i's deltas (in `bits`) at [i, g]; for each index i, members
    0 .. R h - 1 (R whole rounds of h chunks) are strided rows of both, a group at a time."""
    c, flat = s.chunk, s.full.view(-1)
    rounds = s.numel // c // h
    by_index = flat[:rounds * h * c].view(rounds, h, c)
    group = members_at_once(s, world)
    for i in range(h):
        for g in range(0, rounds, group):
            q = Quantized.from_bytes(wires[i, g:g + group], c, bits, BLOCK_SIZE)
            dequantize_add(q, by_index[g:g + group, i], scratch=scratch)
    for m in range(rounds * h, -(-s.numel // c)):   # the rest, one member at a time (the last may be short)
        piece = flat[m * c:min((m + 1) * c, s.numel)]
        dequantize_add(Quantized.from_bytes(wires[m % h, m // h], c, bits, BLOCK_SIZE).row(0, piece.numel()),
                       piece, scratch=scratch)
