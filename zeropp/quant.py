"""Block-wise symmetric quantization for ZeRO++ (qwZ: INT8 weights, qgZ: INT4 gradients).

One API, two backends (REFERENCE.md section 7): Triton kernels (``zeropp.quant_triton``)
when the tensor is on CUDA and triton imports, this vectorized torch implementation
everywhere else.  The torch path is the reference the Triton kernels are tested against.

Format
------
A flat tensor of ``numel`` elements is zero-padded to ``num_blocks * block_size``
elements and cut into blocks of ``block_size``.  Each block gets one fp32 scale::

    scale = max|x| / qmax            (qmax = 127 for INT8, 7 for INT4)
    q     = round_half_even(clamp(x / scale, -qmax, qmax))
    x'    = q * scale                (computed in fp32, then cast to the requested dtype)

* INT8: ``data`` is int8, shape ``[num_blocks * block_size]``.
* INT4: ``data`` is uint8, shape ``[num_blocks * block_size // 2]``; two values per byte,
  **low nibble first**: element ``2i`` is in bits 0-3 of byte ``i``, element ``2i+1`` in
  bits 4-7.  Each nibble is the 4-bit two's complement of q (q in [-7, 7]; -8 is never
  produced), i.e. ``byte = (q[2i] & 0xF) | ((q[2i+1] & 0xF) << 4)``.  ``block_size`` must
  be even so that blocks are byte aligned.
* All arithmetic is fp32 whatever the input dtype (fp32/fp16/bf16 are read as fp32 exactly).

Special values
--------------
* An all-zero block has scale 0 and dequantizes to exact zeros (no NaN).
* Non-finite input is never clamped to a finite value: an inf in a block makes that block's
  scale inf, a NaN makes it NaN, and the block's ``data`` is set to 0.  Dequantizing that
  block gives NaN (0 * inf) for every element of the block, so the overflow shows both in
  ``q.scales`` (check ``torch.isfinite(q.scales).all()``, cheap: one value per block) and in
  the dequantized result, and keeps propagating through ``dequantize_reduce_requantize``.
* A block whose max|x| is so small (< ~127 * 1.4e-45) that max|x|/qmax underflows to 0 gets
  scale 0 and dequantizes to zeros (the error is then below 1e-42 in absolute value).

Error bound: for finite input each dequantized (fp32) element is within half a
quantization step of the original, ``|x - x'| <= scale / 2`` (plus a few fp32 ulps of
max|x| for the rounding of the division and the product).

Default block sizes (``DEFAULT_BLOCK_SIZE``)
--------------------------------------------
* INT8 (qwZ weights): 256.  The fp32 scale costs 4/256 = 1.6% on top of the 1-byte data
  (M -> 0.508M instead of 0.5M); 127 levels make the error small even with wider blocks.
* INT4 (qgZ gradients): 128.  Only 7 levels per sign, so one outlier degrades the whole
  block: smaller blocks keep the error of gradient reduction small.  Overhead 4/64 bytes =
  6.25% (0.25M -> 0.266M).
Both are powers of two (required by the Triton kernels; the torch path accepts any
positive size, even for INT4) and multiples of 8, so the wire buffer of ``to_bytes`` is
4-byte aligned.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch

from zeropp.quant_format import (DEFAULT_BLOCK_SIZE, QMAX, Quantized, check_block_size, num_blocks,
                                 wire_nbytes)

__all__ = [
    "Quantized",
    "DEFAULT_BLOCK_SIZE",
    "QMAX",
    "quantize",
    "dequantize",
    "dequantize_reduce_requantize",
    "dequantize_reduce",
    "wire_nbytes",
    "triton_available",
]

# 1.5 * 2**23: adding then subtracting it rounds an fp32 |y| < 2**22 to the nearest
# integer, ties to even (same as torch.round).  The Triton kernels use the same trick.
_RINT_MAGIC = 12582912.0


_TRITON = None


def triton_available() -> bool:
    """True if ``zeropp.quant_triton`` imports (triton installed)."""
    global _TRITON
    if _TRITON is None:
        try:
            from zeropp import quant_triton  # noqa: F401
            _TRITON = quant_triton
        except Exception:  # ImportError, or a broken triton install
            _TRITON = False
    return _TRITON is not False


def _pick_backend(backend: str, device: torch.device, block_size: int) -> str:
    """'auto' -> 'triton' for CUDA tensors when triton imports and block_size is a power of
    two, else 'torch'.  ZEROPP_QUANT_BACKEND=torch in the environment forces torch."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
    if backend != "auto":
        if backend == "triton" and not triton_available():
            raise RuntimeError("backend='triton' but triton is not importable")
        return backend
    if os.environ.get("ZEROPP_QUANT_BACKEND", "") == "torch":
        return "torch"
    if device.type == "cuda" and block_size & (block_size - 1) == 0 and triton_available():
        return "triton"
    return "torch"


# ---------------------------------------------------------------------------------------
# torch reference implementation (works on padded [.., num_blocks, block_size] views)

def _quantize_blocks(xb: torch.Tensor, bits: int):
    """xb: fp32 [..., nb, bs] -> (q int8 [..., nb, bs] unpacked, scales fp32 [..., nb])."""
    qmax = QMAX[bits]
    amax = xb.abs().amax(dim=-1)  # propagates NaN
    scales = amax / qmax
    finite = torch.isfinite(scales)
    safe = torch.where((scales == 0) | ~finite, torch.ones_like(scales), scales)
    y = (xb / safe.unsqueeze(-1)).clamp_(-qmax, qmax)
    y.add_(_RINT_MAGIC).sub_(_RINT_MAGIC)  # == torch.round (ties to even) for |y| <= 127
    if not bool(finite.all()):  # non-finite block: data 0, the scale carries inf/nan
        y.masked_fill_(~finite.unsqueeze(-1), 0.0)
    return y.to(torch.int8), scales


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., 2m] in [-8, 7] -> uint8 [..., m], low nibble = even element."""
    u = q.view(torch.uint8) & 0xF
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack4(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> int8 [..., 2m] (inverse of _pack4)."""
    lo = (b & 0xF).to(torch.int8)
    hi = (b >> 4).to(torch.int8)
    q = torch.stack([lo, hi], dim=-1).flatten(-2)
    return (q ^ 8) - 8  # 4-bit two's complement -> int8


def _dequant_blocks(q: Quantized) -> torch.Tensor:
    """-> fp32 [..., nb, bs] (padded)."""
    nb, bs = q.num_blocks, q.block_size
    lead = q.data.shape[:-1]
    vals = q.data if q.bits == 8 else _unpack4(q.data)
    return vals.reshape(*lead, nb, bs).to(torch.float32) * q.scales.reshape(*lead, nb, 1)


def _from_blocks_fp32(xb: torch.Tensor, numel: int, bits: int, block_size: int) -> Quantized:
    qv, scales = _quantize_blocks(xb, bits)
    data = qv.flatten()
    if bits == 4:
        data = _pack4(data)
    return Quantized(data, scales, numel, bits, block_size)


def _torch_quantize(x: torch.Tensor, bits: int, block_size: int) -> Quantized:
    n = x.numel()
    nb = num_blocks(n, block_size)
    xf = x.reshape(-1).to(torch.float32)
    pad = nb * block_size - n
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    return _from_blocks_fp32(xf.view(nb, block_size), n, bits, block_size)


def _as_stacked(parts: Union[Quantized, Sequence[Quantized]]) -> Quantized:
    if isinstance(parts, Quantized):
        return parts if parts.stacked else Quantized.stack([parts])
    if len(parts) == 0:
        raise ValueError("need at least one part")
    return Quantized.stack(list(parts))


def _torch_sum_parts(st: Quantized) -> torch.Tensor:
    """fp32 [nb, bs] sum over the k parts, accumulated sequentially (part 0, then +1, ...),
    the same order as the Triton kernel so that both give identical bits."""
    deq = _dequant_blocks(st)
    acc = deq[0].clone()
    for i in range(1, deq.shape[0]):
        acc.add_(deq[i])
    return acc


# ---------------------------------------------------------------------------------------
# public API

def quantize(x: torch.Tensor, bits: int = 8, block_size: Optional[int] = None,
             backend: str = "auto") -> Quantized:
    """Quantize the flattened ``x`` (fp32/fp16/bf16) to ``bits`` (8 or 4) with one fp32 scale
    per ``block_size`` elements (default ``DEFAULT_BLOCK_SIZE[bits]``)."""
    block_size = check_block_size(bits, block_size)
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating tensor, got {x.dtype}")
    if _pick_backend(backend, x.device, block_size) == "triton":
        from zeropp import quant_triton
        return quant_triton.quantize(x, bits, block_size)
    return _torch_quantize(x, bits, block_size)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """Back to a flat ``dtype`` tensor of exactly ``q.numel`` elements (``[k, numel]`` if
    ``q`` is stacked).  Computed in fp32 (``q * scale``), then cast."""
    if _pick_backend(backend, q.data.device, q.block_size) == "triton":
        from zeropp import quant_triton
        return quant_triton.dequantize(q, dtype)
    out = _dequant_blocks(q)
    out = out.reshape(*q.data.shape[:-1], -1)[..., : q.numel]
    return out.to(dtype)


def dequantize_reduce_requantize(parts: Union[Quantized, Sequence[Quantized]], bits_out: int = 4,
                                 block_size_out: Optional[int] = None,
                                 backend: str = "auto") -> Quantized:
    """qgZ's middle hop: dequantize k quantized tensors of the same numel (a list, or one
    stacked Quantized), sum them in fp32 (sequentially, part 0 first) and quantize the sum
    to ``bits_out`` with ``block_size_out`` (default: the parts' block size if valid for
    ``bits_out``, else ``DEFAULT_BLOCK_SIZE[bits_out]``)."""
    st = _as_stacked(parts)
    if block_size_out is None:
        block_size_out = st.block_size if (bits_out == 8 or st.block_size % 2 == 0) else None
    block_size_out = check_block_size(bits_out, block_size_out)
    if _pick_backend(backend, st.data.device, st.block_size) == "triton" and block_size_out == st.block_size:
        from zeropp import quant_triton
        return quant_triton.dequantize_reduce_requantize(st, bits_out)
    acc = _torch_sum_parts(st)
    if block_size_out == st.block_size:
        return _from_blocks_fp32(acc, st.numel, bits_out, block_size_out)
    return _torch_quantize(acc.flatten()[: st.numel], bits_out, block_size_out)


def dequantize_reduce(parts: Union[Quantized, Sequence[Quantized]], dtype: torch.dtype = torch.float32,
                      scale: float = 1.0, backend: str = "auto") -> torch.Tensor:
    """qgZ's last hop: dequantize k parts, sum in fp32 (part 0 first), multiply by ``scale``
    (e.g. 1/world_size for averaging) in fp32, cast to ``dtype``.  Returns ``[numel]``."""
    st = _as_stacked(parts)
    if _pick_backend(backend, st.data.device, st.block_size) == "triton":
        from zeropp import quant_triton
        return quant_triton.dequantize_reduce(st, dtype, scale)
    acc = _torch_sum_parts(st).flatten()[: st.numel]
    if scale != 1.0:
        acc = acc * torch.tensor(scale, dtype=torch.float32)
    return acc.to(dtype)
