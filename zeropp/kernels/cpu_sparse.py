"""Compiled CPU kernels for zeropp.kernels.sparse (top-k 2-bit; same results bit for bit as its
torch reference), built and cached by zeropp.kernels.cache as cpu_quant.py builds quant_cpu.c:
one pass per chunk in L1 (a quickselect of the k-th key, then one ascending scan) instead of
the reference's sort of every chunk. No compiler, or a failed build: `available()` is False and
zeropp.kernels.sparse uses the torch path."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from zeropp.kernels import cache


def _declare(lib):
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.zs_encode.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.zs_decode_reduce.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i32, f32, ptr]
    lib.zs_max_chunk.restype = i32


_KERNELS = cache.Kernels("sparse_cpu", Path(__file__).with_name("csrc") / "sparse_cpu.c", "top-k", _declare)
available, why_not = _KERNELS.available, _KERNELS.why_not


def _check_chunk(chunk: int):
    if chunk > _KERNELS.lib.zs_max_chunk():
        raise ValueError(f"CPU top-k kernels take chunks of at most {_KERNELS.lib.zs_max_chunk()} elements, got {chunk}")


def encode(x: torch.Tensor, k: int, chunk: int, nc: int):
    """(scales [nc], index int32 [nc, k], codes uint8 [nc, k]): sparse.py wraps them."""
    _check_chunk(chunk)
    scales = torch.empty(nc, dtype=torch.float32)
    index = torch.empty(nc, k, dtype=torch.int32)
    codes = torch.empty(nc, k, dtype=torch.uint8)
    _KERNELS.lib.zs_encode(x.data_ptr(), x.numel(), chunk, k, scales.data_ptr(), index.data_ptr(), codes.data_ptr())
    return scales, index, codes


def decode_reduce(parts, factor, out: torch.Tensor) -> torch.Tensor:
    """`parts` stacked: scales [p, nc], index and codes [p, nc, k]."""
    _check_chunk(parts.chunk)
    scales, index, codes = parts.scales.contiguous(), parts.index.contiguous(), parts.codes.contiguous()
    nc, k = scales.shape[-1], parts.k
    _KERNELS.lib.zs_decode_reduce(scales.data_ptr(), nc, index.data_ptr(), codes.data_ptr(), nc * k, scales.shape[0],
                          parts.numel, parts.chunk, k, int(factor is not None),
                          1.0 if factor is None else factor, out.data_ptr())
    return out
