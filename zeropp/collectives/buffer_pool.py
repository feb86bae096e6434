"""Reusable buffers for the engine's transient tensors (gather rows, gradient
buckets, quantized wire buffers), and their bytes.

A pool hands out byte buffers viewed as the dtype asked for, and takes them
back when the collective that used them is done. A request reuses a free buffer
of its exact size (a step makes the same requests as the last one), else
allocates one, first dropping free buffers, largest first, while the pool would
hold more than its `budget`: the bound the engine derives from its configuration
(buckets in flight). So the pool holds at most max(budget, bytes in use), and its
peak is what `peak_buffers()` reports next to that bound.
"""
from __future__ import annotations

import torch

from zeropp.kernels.format import Quantized, wire_nbytes


class BufferPool:
    def __init__(self, device, budget: int | None = None):
        self.device = device
        self.budget = budget    # bytes; None: keep every free buffer
        self._free: list[torch.Tensor] = []             # uint8 buffers not in use
        self._in_use: dict[int, torch.Tensor] = {}       # data_ptr -> uint8 buffer
        self.bytes = 0          # held now (in use + free)
        self.peak_bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat tensor of `numel` elements of `dtype`, contents undefined."""
        nbytes = max(1, numel * dtype.itemsize)
        same = next((i for i, b in enumerate(self._free) if b.numel() == nbytes), None)
        if same is not None:
            buf = self._free.pop(same)
        else:
            if self.budget is not None:
                self._free.sort(key=torch.Tensor.numel)
                while self._free and self.bytes + nbytes > self.budget:
                    self.bytes -= self._free.pop().numel()
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._in_use[buf.data_ptr()] = buf
        return buf[:numel * dtype.itemsize].view(dtype)

    def give(self, t: torch.Tensor):
        """Return a tensor `take` gave out (or a view starting where it starts)."""
        self._free.append(self._in_use.pop(t.data_ptr()))

    @property
    def in_use_bytes(self) -> int:
        return sum(b.numel() for b in self._in_use.values())


def take_wire(pool: BufferPool, rows: int, numel: int, bits: int,
               block_size: int) -> tuple[torch.Tensor, list[Quantized]]:
    """A wire buffer [rows, nbytes] from `pool` and, per row, its Quantized view of `numel`
    elements (scales then data, `Quantized.to_bytes`'s layout): the quantizers write
    straight into it, with no quantized copy or staging buffer besides."""
    nbytes = wire_nbytes(numel, bits, block_size)
    buf = pool.take(rows * nbytes, torch.uint8).view(rows, nbytes)
    views = [Quantized.from_bytes(buf[i], numel, bits, block_size) for i in range(rows)]
    assert all(v.scales.data_ptr() == buf[i].data_ptr() for i, v in enumerate(views)), "unaligned wire buffer"
    return buf, views
