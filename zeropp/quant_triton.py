"""Triton kernels for zeropp.quant (same format, same results bit for bit).

One program per block of BLOCK (a power of two) elements.  INT4 programs handle the even
and odd elements of their block as two vectors of BLOCK // 2 so that packing (low nibble =
even element) needs no shuffles.  Rounding: clamp to [-qmax, qmax], then
``(y + 1.5 * 2**23) - 1.5 * 2**23`` which is round-to-nearest-even for |y| < 2**22, the
same arithmetic as the torch path (libdevice.rint is not available under
TRITON_INTERPRET=1).  Division is ``tl.math.div_rn`` (IEEE round to nearest), as torch.

Called through zeropp.quant (dispatch for CUDA tensors); the functions here also accept CPU
tensors when TRITON_INTERPRET=1 was set before triton was imported (tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from zeropp.quant import QMAX, Quantized, _num_blocks

_MAGIC = 12582912.0
# No fused multiply-add: the sum of dequantized parts (a + q * s) must round like torch's
# separate product and sum, so both backends give the same bits (found on an H100).
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
def _block_scale(amax, nan_count, QMAX_: tl.constexpr):
    scale = tl.math.div_rn(amax, QMAX_ * 1.0)  # IEEE division: '/' is approximate on GPU
    # tl.max may drop NaNs on GPU (max.f32); make a NaN input give a NaN scale explicitly.
    return tl.where(nan_count > 0, float("nan"), scale)


@triton.jit
def _pack_store(q_e, q_o, out_ptr, pid, HALF: tl.constexpr):
    h = tl.arange(0, HALF)
    lo = q_e.to(tl.int32) & 0xF
    hi = q_o.to(tl.int32) & 0xF
    tl.store(out_ptr + pid * HALF + h, (lo | (hi << 4)).to(tl.uint8))


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
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, numel,
                     BLOCK: tl.constexpr, BITS: tl.constexpr, QMAX_: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK
    if BITS == 8:
        offs = tl.arange(0, BLOCK)
        m = base + offs < numel
        x = tl.load(x_ptr + base + offs, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        nan_count = tl.sum((x != x).to(tl.int32), axis=0)
        scale = _block_scale(amax, nan_count, QMAX_)
        q = _quant_vals(x, scale, QMAX_)
        tl.store(data_ptr + base + offs, q.to(tl.int8))
    else:
        HALF: tl.constexpr = BLOCK // 2
        offs = tl.arange(0, BLOCK)  # one contiguous (coalesced) load, split into even / odd
        x = tl.load(x_ptr + base + offs, mask=base + offs < numel, other=0.0).to(tl.float32)
        xe, xo = tl.split(tl.reshape(x, (HALF, 2)))
        amax = tl.maximum(tl.max(tl.abs(xe), axis=0), tl.max(tl.abs(xo), axis=0))
        nan_count = tl.sum((xe != xe).to(tl.int32), axis=0) + tl.sum((xo != xo).to(tl.int32), axis=0)
        scale = _block_scale(amax, nan_count, QMAX_)
        _pack_store(_quant_vals(xe, scale, QMAX_), _quant_vals(xo, scale, QMAX_), data_ptr, pid.to(tl.int64), HALF)
    tl.store(scale_ptr + pid, scale)


@triton.jit
def _load_deq(data_ptr, scale_ptr, k, data_stride, scale_stride, pid,
              BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Dequantize block pid of part k -> (even, odd) fp32 vectors for INT4, or
    (all, all) for INT8 (second value unused)."""
    s = tl.load(scale_ptr + k * scale_stride + pid)
    if BITS == 8:
        offs = tl.arange(0, BLOCK)
        v = tl.load(data_ptr + k * data_stride + pid * BLOCK + offs).to(tl.float32) * s
        return v, v
    else:
        HALF: tl.constexpr = BLOCK // 2
        h = tl.arange(0, HALF)
        b = tl.load(data_ptr + k * data_stride + pid * HALF + h)
        lo, hi = _unpack(b)
        return lo * s, hi * s


@triton.jit
def _reduce_kernel(data_ptr, scale_ptr, K, data_stride, scale_stride, numel, factor,
                   out_ptr, out_scale_ptr,
                   BLOCK: tl.constexpr, BITS_IN: tl.constexpr, MODE: tl.constexpr,
                   BITS_OUT: tl.constexpr, QMAX_OUT: tl.constexpr):
    """Sum K parts block-wise in fp32 (part 0 first).  MODE 0: write the sum * factor,
    cast to out's dtype, [numel] (dequantize / dequantize_reduce).  MODE 1: re-quantize
    the sum to BITS_OUT with the same block size."""
    pid = tl.program_id(0).to(tl.int64)
    a, b = _load_deq(data_ptr, scale_ptr, 0, data_stride, scale_stride, pid, BLOCK, BITS_IN)
    for k in range(1, K):
        a2, b2 = _load_deq(data_ptr, scale_ptr, k, data_stride, scale_stride, pid, BLOCK, BITS_IN)
        a += a2
        b += b2
    if BITS_IN == 8:
        # a holds the whole block in order; view it as even/odd only when packing INT4 out.
        if MODE == 0:
            offs = tl.arange(0, BLOCK)
            o = pid * BLOCK + offs
            _store_out(out_ptr, o, a * factor, o < numel)
        else:
            amax = tl.max(tl.abs(a), axis=0)
            nan_count = tl.sum((a != a).to(tl.int32), axis=0)
            scale = _block_scale(amax, nan_count, QMAX_OUT)
            q = _quant_vals(a, scale, QMAX_OUT)
            if BITS_OUT == 8:
                tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), q.to(tl.int8))
            else:
                qq = tl.reshape(q.to(tl.int32), (BLOCK // 2, 2))
                lo, hi = tl.split(qq)
                _pack_store(lo, hi, out_ptr, pid, BLOCK // 2)
            tl.store(out_scale_ptr + pid, scale)
    else:
        HALF: tl.constexpr = BLOCK // 2
        if MODE == 0:  # interleave even / odd back into one contiguous store
            o = pid * BLOCK + tl.arange(0, BLOCK)
            _store_out(out_ptr, o, tl.reshape(tl.join(a * factor, b * factor), (BLOCK,)), o < numel)
        else:
            amax = tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(b), axis=0))
            nan_count = tl.sum((a != a).to(tl.int32), axis=0) + tl.sum((b != b).to(tl.int32), axis=0)
            scale = _block_scale(amax, nan_count, QMAX_OUT)
            qa = _quant_vals(a, scale, QMAX_OUT)
            qb = _quant_vals(b, scale, QMAX_OUT)
            if BITS_OUT == 4:
                _pack_store(qa, qb, out_ptr, pid, HALF)
            else:
                q = tl.reshape(tl.join(qa, qb), (BLOCK,))
                tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), q.to(tl.int8))
            tl.store(out_scale_ptr + pid, scale)


def _check_block(block_size: int):
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"Triton quant kernels need a power-of-two block_size >= 2, got {block_size}")


def quantize(x: torch.Tensor, bits: int, block_size: int) -> Quantized:
    _check_block(block_size)
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    nb = _num_blocks(n, block_size)
    dtype = torch.int8 if bits == 8 else torch.uint8
    data = torch.empty(nb * block_size * bits // 8, dtype=dtype, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    _quantize_kernel[(nb,)](x, data, scales, n, BLOCK=block_size, BITS=bits, QMAX_=QMAX[bits],
                            **_EXACT)
    return Quantized(data, scales, n, bits, block_size)


def _stacked_args(st: Quantized):
    _check_block(st.block_size)
    data = st.data if st.stacked else st.data.unsqueeze(0)
    scales = st.scales if st.stacked else st.scales.unsqueeze(0)
    if data.stride(-1) != 1:
        data = data.contiguous()
    if scales.stride(-1) != 1:
        scales = scales.contiguous()
    return data, scales


def _reduce_out(st: Quantized, dtype: torch.dtype, factor: float) -> torch.Tensor:
    data, scales = _stacked_args(st)
    out = torch.empty(st.numel, dtype=dtype, device=data.device)
    _reduce_kernel[(st.num_blocks,)](data, scales, data.shape[0], data.stride(0), scales.stride(0),
                                     st.numel, float(factor), out, scales,
                                     BLOCK=st.block_size, BITS_IN=st.bits, MODE=0,
                                     BITS_OUT=st.bits, QMAX_OUT=QMAX[st.bits], **_EXACT)
    return out


def dequantize(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    if q.stacked:
        return torch.stack([_reduce_out(q[i], dtype, 1.0) for i in range(len(q))])
    return _reduce_out(q, dtype, 1.0)


def dequantize_reduce(st: Quantized, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return _reduce_out(st, dtype, scale)


def dequantize_reduce_requantize(st: Quantized, bits_out: int) -> Quantized:
    data, scales = _stacked_args(st)
    nb, bs = st.num_blocks, st.block_size
    odt = torch.int8 if bits_out == 8 else torch.uint8
    out = torch.empty(nb * bs * bits_out // 8, dtype=odt, device=data.device)
    out_scales = torch.empty(nb, dtype=torch.float32, device=data.device)
    _reduce_kernel[(nb,)](data, scales, data.shape[0], data.stride(0), scales.stride(0),
                          st.numel, 1.0, out, out_scales,
                          BLOCK=bs, BITS_IN=st.bits, MODE=1, BITS_OUT=bits_out, QMAX_OUT=QMAX[bits_out],
                          **_EXACT)
    return Quantized(out, out_scales, st.numel, bits_out, bs)
