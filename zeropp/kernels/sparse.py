"""Sparse 2-bit top-k ("topk2"): streaming DiLoCo's outer gradients (zeropp/outer/diloco.py), one API
over three backends giving the same bits: the torch reference here, C for CPU tensors
(zeropp/kernels/cpu_sparse.py, csrc/sparse_cpu.c, built and loaded as cpu_quant.py is) and
Triton for CUDA tensors (zeropp/kernels/triton_sparse.py), chosen as zeropp/kernels/quant.py
chooses (`backend`, ZEROPP_QUANT_BACKEND forces one).

Format
------
A flat fp32 tensor of ``numel`` elements is zero-padded to whole chunks of ``chunk`` elements
(``DEFAULT_CHUNK`` = 2048). In each chunk the ``k = topk_count(fraction, chunk)`` elements of
largest magnitude are kept (ties: the lower index wins; a NaN counts as an infinity; the padding
of the last chunk only where it has fewer than k real elements, and a decode drops it), the rest
dropped. The chunk's ``scale`` is the median of its kept nonzero magnitudes (the
``nz // 2 + 1``-th largest of the ``nz`` of them; 0 when all kept are zero): an order statistic,
so every backend finds the same fp32 value with no arithmetic. Each kept value is 2 bits,
``code = (hi << 1) | neg`` with ``neg = x < 0`` and ``hi = |x| > 2 scale``, decoded as
``(-1)^neg * (1 + 2 hi) * scale``: levels +-scale, +-3 scale. Mid-rise because a kept value is
never expected to be zero (it is among the largest; a chunk with fewer than k nonzero elements
keeps zeros, which decode to +scale and error feedback sends back). Why the median, not the
largest magnitude M with levels M/4 and 3M/4: kept values sit mostly near the k-th largest, far
below M when the chunk is heavy-tailed; on Student-t(3) chunks the M/4 levels leave a several
times larger squared error than the median's (tests/unit/outer/test_diloco_sparse.py compares them).

Wire (``SparseTopK.to_bytes``, a fixed size per tensor so the groups can all-gather it): the
fp32 scales of every chunk, then each chunk's positions: its k indices (ascending, ``log2(chunk)``
bits each, packed LSB first, the chunk's bits padded to whole bytes) or, when that is smaller
(``bitmap``: above 1/11 kept at 2048), a bitmap of the chunk (1 bit per element, LSB first);
then each chunk's k codes (2 bits each, LSB first, padded to whole bytes). ``wire_nbytes``.

Why 2048: an index costs log2(chunk) bits and the scale 32 / k bits per kept value; at the
default fraction 0.02 (k = 41) that is 11 + 2 + 0.8 = 13.8 bits per kept value, against 13.6 at
1024 (k = 20) and 14.4 at 4096 (k = 82): within 1% of the cheapest, with k twice 1024's, so
the fraction is resolved finely (1% is k = 20) and one outlier costs its chunk less.

Error bound: for finite input, a kept element with ``|x| <= 4 scale`` decodes within ``scale``
of it (half the 2-bit step ``2 scale``); a larger one is clipped to ``3 scale``, within
``|x| - 3 scale``: ``|x - x'| <= max(scale, |x| - 3 scale)`` (exactly for the lower level and the
threshold; the upper level ``3 scale`` is rounded once in fp32, which may add half an ulp of
it). A dropped element decodes to 0. Both are what error feedback carries to the next exchange.
An inf or NaN in a chunk makes its scale inf or NaN, so its kept values decode to non-finite
values (the outer step sees it and skips).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from zeropp.kernels import quant

DEFAULT_CHUNK = 2048
MAX_FRACTION = 0.1


def topk_count(fraction: float, chunk: int = DEFAULT_CHUNK) -> int:
    """Elements kept per chunk: round(fraction * chunk), at least 1."""
    return max(1, min(chunk, int(round(fraction * chunk))))


def index_bits(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


def num_chunks(numel: int, chunk: int) -> int:
    return max(1, -(-numel // chunk))


def check_chunk(chunk: int) -> int:
    chunk = int(chunk)
    if chunk < 2 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two of at least 2, got {chunk}")
    return chunk


def bitmap(k: int, chunk: int) -> bool:
    """Whether a chunk's kept positions go as a bitmap of the chunk (1 bit per element) rather
    than as k indices of log2(chunk) bits: whichever is smaller (above 1/11 kept at 2048)."""
    return chunk < k * index_bits(chunk)


def _sizes(k: int, chunk: int) -> tuple[int, int]:
    """Bytes of one chunk's packed positions and of its packed codes."""
    return -(-(chunk if bitmap(k, chunk) else k * index_bits(chunk)) // 8), -(-k * 2 // 8)


def wire_nbytes(numel: int, fraction: float, chunk: int = DEFAULT_CHUNK) -> int:
    """Bytes of ``SparseTopK.to_bytes()`` for a tensor of ``numel`` elements."""
    chunk = check_chunk(chunk)
    k = topk_count(fraction, chunk)
    ib, cb = _sizes(k, chunk)
    return num_chunks(numel, chunk) * (4 + ib + cb)


@dataclass
class SparseTopK:
    """Unpacked: ``scales`` fp32 ``[..., nc]``, ``index`` int32 ``[..., nc, k]`` (ascending
    within a chunk, relative to it), ``codes`` uint8 ``[..., nc, k]``; a leading dimension
    stacks the parts of an all-gather."""
    scales: torch.Tensor
    index: torch.Tensor
    codes: torch.Tensor
    numel: int
    chunk: int

    @property
    def k(self) -> int:
        return self.index.shape[-1]

    @property
    def stacked(self) -> bool:
        return self.scales.dim() == 2

    def to_bytes(self) -> torch.Tensor:
        lead = self.scales.shape[:-1]
        s = self.scales.contiguous().view(torch.uint8).reshape(*lead, -1)
        if bitmap(self.k, self.chunk):
            mask = torch.zeros(*self.index.shape[:-1], self.chunk, dtype=torch.int64, device=self.index.device)
            i = _pack(mask.scatter_(-1, self.index.to(torch.int64), 1), 1).reshape(*lead, -1)
        else:
            i = _pack(self.index.to(torch.int64), index_bits(self.chunk)).reshape(*lead, -1)
        c = _pack(self.codes.to(torch.int64), 2).reshape(*lead, -1)
        return torch.cat([s, i, c], dim=-1)

    @staticmethod
    def from_bytes(buf: torch.Tensor, numel: int, fraction: float, chunk: int = DEFAULT_CHUNK) -> "SparseTopK":
        """Inverse of ``to_bytes``; ``buf`` uint8 ``[nbytes]`` or ``[parts, nbytes]``."""
        chunk = check_chunk(chunk)
        if buf.dtype != torch.uint8 or buf.shape[-1] != wire_nbytes(numel, fraction, chunk):
            raise ValueError(f"buffer of {buf.shape[-1]} {buf.dtype} does not hold a top-k tensor of "
                             f"numel={numel} fraction={fraction} chunk={chunk}")
        nc, k = num_chunks(numel, chunk), topk_count(fraction, chunk)
        ib, cb = _sizes(k, chunk)
        lead = buf.shape[:-1]
        scales = buf[..., :4 * nc].contiguous().view(torch.float32)
        i = buf[..., 4 * nc:4 * nc + nc * ib].reshape(*lead, nc, ib)
        c = buf[..., 4 * nc + nc * ib:].reshape(*lead, nc, cb)
        if bitmap(k, chunk):   # the set bits' positions, ascending: exactly k per chunk
            mask = _unpack(i, 1, chunk).bool()
            if not (mask.sum(-1) == k).all():
                raise ValueError(f"a chunk's bitmap does not hold {k} positions")
            index = mask.nonzero()[:, -1].reshape(*lead, nc, k)
        else:
            index = _unpack(i, index_bits(chunk), k)
        return SparseTopK(scales, index.to(torch.int32), _unpack(c, 2, k).to(torch.uint8), numel, chunk)


_WEIGHTS = {}


def _bit_weights(device) -> torch.Tensor:
    if device not in _WEIGHTS:
        _WEIGHTS[device] = torch.tensor([1 << b for b in range(8)], dtype=torch.int64, device=device)
    return _WEIGHTS[device]


def _pack(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., k]`` non-negative ints of `bits` bits -> ``[..., ceil(k bits / 8)]`` uint8, LSB first."""
    shifts = torch.arange(bits, device=v.device)
    stream = ((v.unsqueeze(-1) >> shifts) & 1).flatten(-2)
    pad = -stream.shape[-1] % 8
    stream = torch.nn.functional.pad(stream, (0, pad)).unflatten(-1, (-1, 8))
    return (stream * _bit_weights(v.device)).sum(-1).to(torch.uint8)


def _unpack(b: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    stream = ((b.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=b.device)) & 1).flatten(-2)
    stream = stream[..., :k * bits].unflatten(-1, (k, bits))
    return (stream << torch.arange(bits, device=b.device)).sum(-1)


# ---------------------------------------------------------------------------------------
# torch reference

def _torch_encode(x: torch.Tensor, k: int, chunk: int) -> SparseTopK:
    n = x.numel()
    nc = num_chunks(n, chunk)
    xp = torch.zeros(nc * chunk, dtype=torch.float32, device=x.device)
    xp[:n] = x
    xp = xp.view(nc, chunk)
    mag = xp.abs()
    key = mag.nan_to_num(nan=math.inf, posinf=math.inf)
    key.view(-1)[n:] = -1.0   # the padding only where a chunk has fewer than k real elements
    order = torch.sort(key, dim=1, descending=True, stable=True).indices   # stable: the lower index wins ties
    index = order[:, :k].sort(dim=1).values
    kept = xp.gather(1, index)
    top = key.gather(1, order[:, :k])   # the kept magnitudes, largest first (NaN as inf, padding -1)
    nonzero = (top > 0).sum(dim=1, keepdim=True)
    median = top.gather(1, nonzero // 2).squeeze(1).clamp(min=0)   # of the nonzero kept magnitudes
    amax = mag.amax(dim=1)   # NaN propagates
    scales = torch.where(amax.isfinite(), median, amax)
    hi = kept.abs() > (scales * 2).unsqueeze(1)
    codes = (hi.to(torch.uint8) << 1) | (kept < 0).to(torch.uint8)
    return SparseTopK(scales, index.to(torch.int32), codes, n, chunk)


def _values(sp: SparseTopK) -> torch.Tensor:
    """The decoded kept values, fp32 ``[..., nc, k]``."""
    c = sp.codes.to(torch.int32)
    level = (1 + 2 * (c >> 1)).to(torch.float32) * sp.scales.unsqueeze(-1)
    return torch.where((c & 1).bool(), -level, level)


def _positions(sp: SparseTopK) -> torch.Tensor:
    nc = sp.scales.shape[-1]
    base = torch.arange(nc, device=sp.index.device, dtype=torch.int64).unsqueeze(-1) * sp.chunk
    return sp.index.to(torch.int64) + base


def _torch_decode_reduce(sp: SparseTopK, factor: Optional[float], out: torch.Tensor) -> torch.Tensor:
    """Each part decoded and added in fp32, part 0 first, then times `factor` (None: decode a
    single part, no product)."""
    nc = sp.scales.shape[-1]
    dense = torch.zeros(nc * sp.chunk, dtype=torch.float32, device=out.device)
    pos, vals = _positions(sp).reshape(-1, nc * sp.k), _values(sp).reshape(-1, nc * sp.k)
    part = torch.empty_like(dense)
    for p in range(pos.shape[0]):
        part.zero_().scatter_(0, pos[p], vals[p])
        dense.add_(part)
    if factor is not None:
        dense.mul_(factor)
    return out.copy_(dense[:sp.numel])


# ---------------------------------------------------------------------------------------
# dispatch (as zeropp/kernels/quant.py's `kernel`)

def _backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"backend must be auto, torch, triton or cpu, got {backend!r}")
    if backend == "auto":
        backend = quant.forced_backend()
    from zeropp.kernels import cpu_sparse
    if backend == "triton" and not quant.triton_available():
        raise RuntimeError("backend='triton' but triton is not importable")
    if backend == "cpu" and not cpu_sparse.available():
        raise RuntimeError(f"backend='cpu': {cpu_sparse.why_not()}")
    if backend == "auto":
        if device.type == "cuda" and quant.triton_available():
            return "triton"
        if device.type == "cpu" and cpu_sparse.available():
            return "cpu"
        return "torch"
    return backend


def _module(backend: str):
    if backend == "cpu":
        from zeropp.kernels import cpu_sparse
        return cpu_sparse
    if backend == "triton":
        from zeropp.kernels import triton_sparse
        return triton_sparse
    return None


def encode(x: torch.Tensor, fraction: float, chunk: int = DEFAULT_CHUNK, backend: str = "auto") -> SparseTopK:
    """The top-k 2-bit code of the flattened `x` (read as fp32)."""
    chunk = check_chunk(chunk)
    if not x.is_floating_point():
        raise TypeError(f"encode needs a floating tensor, got {x.dtype}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    x = x.reshape(-1).to(torch.float32).contiguous()
    k = topk_count(fraction, chunk)
    m = _module(_backend(backend, x.device))
    if m is None:
        return _torch_encode(x, k, chunk)
    return SparseTopK(*m.encode(x, k, chunk, num_chunks(x.numel(), chunk)), x.numel(), chunk)


def decode_reduce(parts: SparseTopK, scale: Optional[float] = 1.0, backend: str = "auto",
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``[numel]``: the parts (a stacked SparseTopK, or one) decoded, summed in fp32 part 0
    first, times `scale` (None: no product, a plain decode)."""
    if out is None:
        out = torch.empty(parts.numel, dtype=torch.float32, device=parts.scales.device)
    elif out.dtype != torch.float32 or out.shape != (parts.numel,) or not out.is_contiguous():
        raise ValueError(f"decode_reduce: out must be contiguous float32 of shape ({parts.numel},)")
    if not parts.stacked:
        parts = SparseTopK(parts.scales.unsqueeze(0), parts.index.unsqueeze(0), parts.codes.unsqueeze(0),
                           parts.numel, parts.chunk)
    m = _module(_backend(backend, out.device))
    return (m.decode_reduce if m else _torch_decode_reduce)(parts, scale, out)


def decode(sp: SparseTopK, backend: str = "auto", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dense fp32 ``[numel]`` of one (unstacked) part: the kept values decoded, zeros elsewhere."""
    return decode_reduce(sp, None, backend, out)
