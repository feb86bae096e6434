"""The block-quantized format the quantization backends share (zeropp/kernels/quant.py
documents it in full): `Quantized` (INT8 or packed INT4 data plus one fp32 scale
per block), its wire layout (`to_bytes` / `from_bytes`: scales, then data) and
its sizes. The torch path (zeropp/kernels/torch_quant.py), the C kernels (cpu_quant.py)
and the Triton kernels (triton_quant.py) all import this module and not each other's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

QMAX = {8: 127, 4: 7, 2: 1}         # the largest code
# The step is max|x| over the block / SCALE_DIV: QMAX, but 2 for INT2, whose ternary codes then
# cut at a quarter of max|x| and stand for half of it (clipping above), near the least squared
# error for bell-shaped blocks; the largest error is still a step, max|x| / 2.
SCALE_DIV = {8: 127, 4: 7, 2: 2}
# The largest |x - x'| of a finite element, in steps: half a step, but a whole one for INT2 (clipped).
ERROR_STEPS = {8: 0.5, 4: 0.5, 2: 1.0}
DEFAULT_BLOCK_SIZE = {8: 256, 4: 128, 2: 128}


@dataclass
class Quantized:
    """A block-quantized flat tensor (or a stack of k of them, see below).

    data:   int8 ``[padded]`` (INT8), uint8 ``[padded // 2]`` (INT4, packed low nibble first) or
            uint8 ``[padded // 4]`` (INT2, four values a byte, lowest bits first)
    scales: fp32 ``[num_blocks]``
    numel:  number of real (unpadded) elements
    bits:   8, 4 or 2
    block_size: elements per scale

    A *stacked* Quantized holds k tensors of the same numel/bits/block_size:
    ``data`` is ``[k, data_len]`` and ``scales`` is ``[k, num_blocks]`` (e.g. the receive
    buffer of an all-to-all, see ``from_bytes``).
    """

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block_size: int

    @staticmethod
    def empty(numel: int, bits: int, block_size: int, device) -> "Quantized":
        """Uninitialized storage for `numel` elements quantized to `bits`."""
        nb = num_blocks(numel, block_size)
        data = torch.empty(nb * block_size * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8,
                           device=device)   # INT4: two values per uint8, INT2: four
        return Quantized(data, torch.empty(nb, dtype=torch.float32, device=device), numel, bits, block_size)

    def check_out(self, numel: int, bits: int, block_size: int) -> "Quantized":
        """`self` as the destination of a quantization of `numel` elements: contiguous data and
        scales of the right sizes and dtypes (e.g. views into a wire buffer, `from_bytes`)."""
        dtype = torch.int8 if bits == 8 else torch.uint8
        nb = num_blocks(numel, block_size)
        if ((self.numel, self.bits, self.block_size) != (numel, bits, block_size) or self.stacked
                or self.data.dtype != dtype or self.data.numel() != nb * block_size * bits // 8
                or self.scales.dtype != torch.float32 or self.scales.numel() != nb
                or not (self.data.is_contiguous() and self.scales.is_contiguous())):
            raise ValueError(f"out does not hold {numel} elements quantized to INT{bits} in blocks of "
                             f"{block_size} (contiguous {dtype} data and float32 scales)")
        return self

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return num_blocks(self.numel, self.block_size)

    @property
    def stacked(self) -> bool:
        return self.data.dim() == 2

    def __len__(self) -> int:
        return self.data.shape[0] if self.stacked else 1

    def __getitem__(self, i: int) -> "Quantized":
        if not self.stacked:
            raise TypeError("indexing needs a stacked Quantized")
        return Quantized(self.data[i], self.scales[i], self.numel, self.bits, self.block_size)

    @staticmethod
    def stack(parts: Sequence["Quantized"]) -> "Quantized":
        p0 = parts[0]
        for p in parts:
            if p.stacked or (p.numel, p.bits, p.block_size) != (p0.numel, p0.bits, p0.block_size):
                raise ValueError("stack needs unstacked parts with equal numel, bits and block_size")
        return Quantized(torch.stack([p.data for p in parts]), torch.stack([p.scales for p in parts]),
                         p0.numel, p0.bits, p0.block_size)

    # ---- wire format -------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of one (unstacked) tensor on the wire: scales then data."""
        return wire_nbytes(self.numel, self.bits, self.block_size)

    def to_bytes(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One uint8 buffer ``[nbytes]`` (``[k, nbytes]`` if stacked): fp32 scales first, then
        data, so a single collective carries both.  Scales first keeps them 4-byte aligned.
        ``out``: a uint8 tensor of that shape to write into."""
        lead = self.data.shape[:-1]
        s = self.scales.contiguous().view(torch.uint8).reshape(*lead, -1)
        d = self.data.contiguous().view(torch.uint8).reshape(*lead, -1)
        if out is None:
            return torch.cat([s, d], dim=-1)
        return torch.cat([s, d], dim=-1, out=out)

    @staticmethod
    def from_bytes(buf: torch.Tensor, numel: int, bits: int, block_size: Optional[int] = None) -> "Quantized":
        """Inverse of ``to_bytes``; ``buf`` is uint8 ``[nbytes]`` or ``[k, nbytes]`` (stacked).
        Data is a view of ``buf``; scales are a view when aligned, else a copy."""
        block_size = check_block_size(bits, block_size)
        nb = num_blocks(numel, block_size)
        if buf.dtype != torch.uint8 or buf.shape[-1] != wire_nbytes(numel, bits, block_size):
            raise ValueError(f"buffer of {buf.shape[-1]} {buf.dtype} does not hold a quantized "
                             f"tensor of numel={numel} bits={bits} block_size={block_size}")
        sb = buf[..., : 4 * nb]
        try:
            scales = sb.view(torch.float32)
        except RuntimeError:
            scales = sb.contiguous().view(torch.float32)
        data = buf[..., 4 * nb:]
        if bits == 8:
            data = data.view(torch.int8)
        return Quantized(data, scales, numel, bits, block_size)

    def row(self, i: int, row_numel: int) -> "Quantized":
        """Elements [i * padded, (i + 1) * padded) of a Quantized (of each, if stacked) whose
        numel is a whole number of rows, each `row_numel` elements padded to whole blocks
        (`padded`): a view, so quantizing into it writes into `self` (into a wire buffer, with
        `from_bytes`)."""
        nb = num_blocks(row_numel, self.block_size)
        per = nb * self.block_size * self.bits // 8
        return Quantized(self.data[..., i * per:(i + 1) * per], self.scales[..., i * nb:(i + 1) * nb], row_numel,
                         self.bits, self.block_size)


# ---------------------------------------------------------------------------------------
# sizes

def num_blocks(numel: int, block_size: int) -> int:
    """Blocks of a tensor of `numel` elements: at least one, even for numel == 0."""
    return max(1, -(-numel // block_size))


def check_block_size(bits: int, block_size: Optional[int]) -> int:
    """The block size to use (the default for `bits` when None), checked."""
    if bits not in QMAX:
        raise ValueError(f"bits must be 8, 4 or 2, got {bits}")
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE[bits]
    block_size = int(block_size)
    if block_size <= 0 or block_size * bits % 8:
        raise ValueError(f"block_size must be positive (even for INT4, a multiple of 4 for INT2), got {block_size}")
    return block_size


def wire_nbytes(numel: int, bits: int, block_size: Optional[int] = None) -> int:
    """Size in bytes of ``Quantized.to_bytes()`` for a tensor of ``numel`` elements."""
    block_size = check_block_size(bits, block_size)
    nb = num_blocks(numel, block_size)
    return 4 * nb + nb * block_size * bits // 8
