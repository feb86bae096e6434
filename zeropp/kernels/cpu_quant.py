"""Compiled CPU kernels for zeropp.kernels.quant (same format, same results bit for bit).

The torch path makes a dozen passes over every element (amax, amin, divide, clamp,
round, cast, pack, ...); on CPU ranks that arithmetic was most of ZeRO++'s cost on a
fast link. ``csrc/quant_cpu.c`` does each block in one pass, in fp32, in L1. It is
built with the system C compiler (``$CC``, else ``cc``) the first time it is needed, into
zeropp.kernels.cache (``$ZEROPP_CACHE_DIR``, default ``~/.cache/zeropp``), once per source,
flags, compiler and CPU, so a cache shared between machines never runs code built for another
processor; the cache checks each library's sha256 before loading it, rebuilds a bad one and
refuses a directory other users can write (a ConfigError). Concurrent ranks build it once and
load it with ctypes; calls release the GIL. No compiler, or a failed build: `available()` is
False and zeropp.kernels.quant says why once, then uses the torch path.
"""
from __future__ import annotations

import ctypes
import warnings
from pathlib import Path
from typing import Optional

import torch

from zeropp.kernels import cache
from zeropp.kernels.format import Quantized

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _declare(lib):
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.zq_quantize.argtypes = [ptr, i32, i64, i32, i64, ptr, ptr]
    lib.zq_dequantize.argtypes = [ptr, i64, ptr, i64, i64, i64, i32, i64, i32, f32, ptr, i32, i64, i32, i32,
                                  ptr, ptr]
    lib.zq_max_block.restype = i32


_KERNELS = cache.Kernels("quant_cpu", Path(__file__).with_name("csrc") / "quant_cpu.c", "quantization", _declare)
available, why_not = _KERNELS.available, _KERNELS.why_not   # built on the first call to available()


def supports(block_size: int) -> bool:
    return available() and block_size <= _KERNELS.lib.zq_max_block()


def _check_block(block_size: int):
    if block_size > _KERNELS.lib.zq_max_block():
        raise ValueError(f"CPU quantization kernels take blocks of at most {_KERNELS.lib.zq_max_block()} elements, "
                         f"got {block_size}")


def _dtype_code(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPES:
        raise TypeError(f"CPU quantization kernels take float32, bfloat16 or float16, got {t.dtype}")
    return _DTYPES[t.dtype]


def quantize(x: torch.Tensor, bits: int, block_size: int, out: Optional[Quantized] = None) -> Quantized:
    _check_block(block_size)
    x = x.reshape(-1).contiguous()
    out = out if out is not None else Quantized.empty(x.numel(), bits, block_size, x.device)
    _KERNELS.lib.zq_quantize(x.data_ptr(), _dtype_code(x), x.numel(), bits, block_size, out.data.data_ptr(),
                     out.scales.data_ptr())
    return out


def _run(st: Quantized, reduce: bool, factor: float, out: Optional[torch.Tensor],
         requant: Optional[Quantized] = None, accumulate: bool = False):
    """st: a stacked Quantized whose rows may be strided views (wire buffers); out: [k, numel]
    (or [numel]) whose rows may be strided too."""
    _check_block(st.block_size)
    data, scales = st.data, st.scales
    if data.stride(-1) != 1 or scales.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        raise ValueError("each part's data and scales, and each row of out, must be contiguous")
    out_stride = out.stride(0) if out is not None and out.dim() == 2 else st.numel
    _KERNELS.lib.zq_dequantize(data.data_ptr(), data.stride(0) * data.element_size(), scales.data_ptr(), scales.stride(0),
                       len(st), st.numel, st.bits, st.block_size, int(reduce), factor,
                       out.data_ptr() if out is not None else None, _dtype_code(out) if out is not None else 0,
                       out_stride, int(accumulate), requant.bits if requant is not None else 0,
                       requant.data.data_ptr() if requant is not None else None,
                       requant.scales.data_ptr() if requant is not None else None)


def _stacked(q: Quantized) -> Quantized:
    if q.stacked:
        return q
    return Quantized(q.data.unsqueeze(0), q.scales.unsqueeze(0), q.numel, q.bits, q.block_size)


def dequantize(q: Quantized, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    _run(_stacked(q), False, 1.0, out)
    return out


def dequantize_add(q: Quantized, out: torch.Tensor) -> torch.Tensor:
    _run(_stacked(q), False, 1.0, out, accumulate=True)
    return out


def dequantize_reduce_requantize(st: Quantized, bits_out: int, out: Optional[Quantized] = None) -> Quantized:
    out = out if out is not None else Quantized.empty(st.numel, bits_out, st.block_size, st.data.device)
    _run(st, True, 1.0, None, requant=out)
    return out


def dequantize_reduce(st: Quantized, dtype: torch.dtype, scale: float, out: torch.Tensor) -> torch.Tensor:
    _run(st, True, scale, out)
    return out


def warn_unavailable():
    warnings.warn(f"zeropp.kernels.quant: {why_not()}; using the torch path (slower on CPU)", RuntimeWarning, stacklevel=4)
