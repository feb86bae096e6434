"""Triton kernels for zeropp.kernels.quant (same format, same results bit for bit).

Every kernel works on tiles of ROWS blocks of BLOCK (a power of two) elements, one block
per row; INT4 bytes are split into (even, odd) nibbles and joined back in element order, INT2
bytes into their four 2-bit fields likewise.
Scale: max|x| / SCALE_DIV (zeropp/kernels/format.py). Rounding: clamp to [-qmax, qmax], then
``(y + 1.5 * 2**23) - 1.5 * 2**23`` which is round-to-nearest-even for |y| < 2**22, the
same arithmetic as the torch path (libdevice.rint is not available under
TRITON_INTERPRET=1).  Division is ``tl.math.div_rn`` (IEEE round to nearest), as torch.

Called through zeropp.kernels.quant (dispatch for CUDA tensors); the functions here also accept CPU
tensors when TRITON_INTERPRET=1 was set before triton was imported (tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from zeropp.kernels.format import QMAX, Quantized, num_blocks

_MAGIC = 12582912.0
# No fused multiply-add: the sum of dequantized parts (a + q * s) must round like torch's
# separate product and sum, so both backends give the same bits (found on an H100).
_TILE = 2048   # elements per quantize program
_EXACT = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@triton.jit
def _quant_vals(x, scale, QMAX_: tl.constexpr):
    """x fp32 vector -> rounded, clamped fp32 values (0 where the scale is 0 / non-finite)."""
    finite = (scale == scale) & (scale != float("inf"))
    ok = finite & (scale != 0.0)
    safe = tl.where(ok, scale, 1.0)
    y = tl.math.div_rn(x, safe)
    y = tl.minimum(tl.maximum(y, -QMAX_), QMAX_)
    y = (y + 12582912.0) - 12582912.0
    return tl.where(finite, y, 0.0)


@triton.jit
def _block_scale(amax, nan_count, DIV_: tl.constexpr):
    scale = tl.math.div_rn(amax, DIV_ * 1.0)  # IEEE division: '/' is approximate on GPU
    # tl.max may drop NaNs on GPU (max.f32); make a NaN input give a NaN scale explicitly.
    return tl.where(nan_count > 0, float("nan"), scale)


@triton.jit
def _store_quantized(v, row, live, data_ptr, scale_ptr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, QMAX_: tl.constexpr):
    """Quantize the fp32 tile v [ROWS, BLOCK] (row r = block `row[r]`) and store its
    data and scales; rows where `live` is false are not stored."""
    amax = tl.max(tl.abs(v), axis=1)
    nan_count = tl.sum((v != v).to(tl.int32), axis=1)
    if BITS == 2:   # format.py SCALE_DIV
        scale = _block_scale(amax, nan_count, 2)
    else:
        scale = _block_scale(amax, nan_count, QMAX_)
    q = _quant_vals(v, scale[:, None], QMAX_)
    if BITS == 8:
        offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        tl.store(data_ptr + offs, q.to(tl.int8), mask=live[:, None])
    elif BITS == 2:  # four values per byte, element 4i + k in bits 2k, 2k + 1
        QUARTER: tl.constexpr = BLOCK // 4
        a, b = tl.split(tl.reshape(q.to(tl.int32), (ROWS, QUARTER, 2, 2)))   # elements 4i + {0, 2}, 4i + {1, 3}
        e0, e2 = tl.split(a)
        e1, e3 = tl.split(b)
        packed = ((e0 & 3) | ((e1 & 3) << 2) | ((e2 & 3) << 4) | ((e3 & 3) << 6)).to(tl.uint8)
        tl.store(data_ptr + row[:, None] * QUARTER + tl.arange(0, QUARTER)[None, :], packed, mask=live[:, None])
    else:  # two values per byte, low nibble = even element
        HALF: tl.constexpr = BLOCK // 2
        qe, qo = tl.split(tl.reshape(q.to(tl.int32), (ROWS, HALF, 2)))
        packed = ((qe & 0xF) | ((qo & 0xF) << 4)).to(tl.uint8)
        tl.store(data_ptr + row[:, None] * HALF + tl.arange(0, HALF)[None, :], packed, mask=live[:, None])
    tl.store(scale_ptr + row, scale, mask=live)


@triton.jit
def _store_out(ptr, offs, v, mask):
    """Store fp32 v cast to ptr's dtype.  fp32 -> bf16 is rounded to nearest even by hand:
    the interpreter's bf16 conversion truncates, this gives the same bits as torch's cast
    everywhere (NaN stays NaN, overflow goes to inf)."""
    ty: tl.constexpr = ptr.dtype.element_ty
    if ty == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(ptr + offs, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, v.to(ty), mask=mask)


@triton.jit
def _unpack(b):
    b = b.to(tl.int32)
    lo = ((b & 0xF) ^ 8) - 8
    hi = (((b >> 4) & 0xF) ^ 8) - 8
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, numel, num_blocks,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, QMAX_: tl.constexpr):
    """ROWS quantization blocks per program, one per row of a [ROWS, BLOCK] tile
    (small blocks alone would make programs too small to keep the GPU busy)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)   # block indices
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0).to(tl.float32)
    _store_quantized(x, row, row < num_blocks, data_ptr, scale_ptr, BLOCK, ROWS, BITS, QMAX_)


@triton.jit
def _load_deq(data_ptr, scale_ptr, k, data_stride, scale_stride, row, live,
              BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr):
    """Blocks `row` of part k, dequantized: an fp32 tile [ROWS, BLOCK] in element order."""
    s = tl.load(scale_ptr + k * scale_stride + row, mask=live, other=0.0)
    if BITS == 8:
        offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        v = tl.load(data_ptr + k * data_stride + offs, mask=live[:, None], other=0).to(tl.float32)
    elif BITS == 2:
        QUARTER: tl.constexpr = BLOCK // 4
        b = tl.load(data_ptr + k * data_stride + row[:, None] * QUARTER + tl.arange(0, QUARTER)[None, :],
                    mask=live[:, None], other=0).to(tl.int32)
        v0 = (((b & 3) ^ 2) - 2).to(tl.float32)   # (v ^ 2) - 2 sign-extends 2 bits
        v1 = ((((b >> 2) & 3) ^ 2) - 2).to(tl.float32)
        v2 = ((((b >> 4) & 3) ^ 2) - 2).to(tl.float32)
        v3 = ((((b >> 6) & 3) ^ 2) - 2).to(tl.float32)
        v = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (ROWS, BLOCK))   # [i, a, c] = 4i + 2a + c
    else:
        HALF: tl.constexpr = BLOCK // 2
        b = tl.load(data_ptr + k * data_stride + row[:, None] * HALF + tl.arange(0, HALF)[None, :],
                    mask=live[:, None], other=0)
        lo, hi = _unpack(b)
        v = tl.reshape(tl.join(lo, hi), (ROWS, BLOCK))
    return v * s[:, None]


@triton.jit
def _reduce_kernel(data_ptr, scale_ptr, K, data_stride, scale_stride, numel, num_blocks, factor,
                   out_ptr, out_scale_ptr,
                   BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS_IN: tl.constexpr, MODE: tl.constexpr,
                   BITS_OUT: tl.constexpr, QMAX_OUT: tl.constexpr):
    """Sum K parts block-wise in fp32 (part 0 first), ROWS blocks per program.  MODE 0:
    write the sum * factor, cast to out's dtype, [numel] (dequantize / dequantize_reduce).
    MODE 1: re-quantize the sum to BITS_OUT with the same block size."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = row < num_blocks
    a = _load_deq(data_ptr, scale_ptr, 0, data_stride, scale_stride, row, live, BLOCK, ROWS, BITS_IN)
    for k in range(1, K):
        a += _load_deq(data_ptr, scale_ptr, k, data_stride, scale_stride, row, live, BLOCK, ROWS, BITS_IN)
    if MODE == 0:
        offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        _store_out(out_ptr, offs, a * factor, offs < numel)
    else:
        _store_quantized(a, row, live, out_ptr, out_scale_ptr, BLOCK, ROWS, BITS_OUT, QMAX_OUT)


def _rows(block_size: int) -> int:
    return max(1, _TILE // block_size)


def _check_block(block_size: int):
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"Triton quant kernels need a power-of-two block_size >= 2, got {block_size}")


def quantize(x: torch.Tensor, bits: int, block_size: int, out: Quantized | None = None) -> Quantized:
    """`out`: contiguous destination (zeropp.kernels.quant.quantize checks it); default new tensors."""
    _check_block(block_size)
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    nb = num_blocks(n, block_size)
    out = out if out is not None else Quantized.empty(n, bits, block_size, x.device)
    rows = _rows(block_size)
    _quantize_kernel[(triton.cdiv(nb, rows),)](x, out.data, out.scales, n, nb, BLOCK=block_size, ROWS=rows,
                                               BITS=bits, QMAX_=QMAX[bits], **_EXACT)
    return out


def _stacked_args(st: Quantized):
    _check_block(st.block_size)
    data = st.data if st.stacked else st.data.unsqueeze(0)
    scales = st.scales if st.stacked else st.scales.unsqueeze(0)
    if data.stride(-1) != 1:
        data = data.contiguous()
    if scales.stride(-1) != 1:
        scales = scales.contiguous()
    return data, scales


def _reduce_out(st: Quantized, dtype: torch.dtype, factor: float, out: torch.Tensor | None = None) -> torch.Tensor:
    data, scales = _stacked_args(st)
    if out is None:
        out = torch.empty(st.numel, dtype=dtype, device=data.device)
    nb, rows = st.num_blocks, _rows(st.block_size)
    _reduce_kernel[(triton.cdiv(nb, rows),)](data, scales, data.shape[0], data.stride(0), scales.stride(0),
                                             st.numel, nb, float(factor), out, scales,
                                             BLOCK=st.block_size, ROWS=rows, BITS_IN=st.bits, MODE=0,
                                             BITS_OUT=st.bits, QMAX_OUT=QMAX[st.bits], **_EXACT)
    return out


def dequantize(q: Quantized, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`out`: contiguous, `dtype`, [numel] (or [k, numel] stacked); default a new tensor."""
    if q.stacked:
        if out is None:
            out = torch.empty(len(q), q.numel, dtype=dtype, device=q.data.device)
        for i in range(len(q)):
            _reduce_out(q[i], dtype, 1.0, out[i])
        return out
    return _reduce_out(q, dtype, 1.0, out)


def dequantize_reduce(st: Quantized, dtype: torch.dtype, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    return _reduce_out(st, dtype, scale, out)


def dequantize_reduce_requantize(st: Quantized, bits_out: int, out: Quantized | None = None) -> Quantized:
    data, scales = _stacked_args(st)
    nb, bs = st.num_blocks, st.block_size
    out = out if out is not None else Quantized.empty(st.numel, bits_out, bs, data.device)
    rows = _rows(bs)
    _reduce_kernel[(triton.cdiv(nb, rows),)](data, scales, data.shape[0], data.stride(0), scales.stride(0),
                                             st.numel, nb, 1.0, out.data, out.scales,
                                             BLOCK=bs, ROWS=rows, BITS_IN=st.bits, MODE=1, BITS_OUT=bits_out,
                                             QMAX_OUT=QMAX[bits_out], **_EXACT)
    return out
