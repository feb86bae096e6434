"""Triton kernels for zeropp.kernels.sparse (top-k 2-bit), bit for bit with its torch reference
(tests/unit/outer/test_diloco_sparse.py). One program per chunk. Encode: each element's unique 64-bit key
(the magnitude's bits, then the complement of the index: the lower index wins a tie, as in
csrc/sparse_cpu.c); the k-th largest key is found bit by bit from the top (a radix select:
63 counts over the chunk, no sort), the kept elements' slots by a prefix count, so they come
out in ascending index order. Decode: the parts added into the output in order, part 0 first,
a barrier between parts (a part's indices are distinct, so one part's stores never collide).
The packing to wire bytes is sparse.py's, shared by every backend. CPU tensors work when
TRITON_INTERPRET=1 was set before triton was imported (tests)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_EXACT = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}   # no FMA


@triton.jit
def _encode_kernel(x_ptr, numel, scales_ptr, index_ptr, codes_ptr, k, CHUNK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, CHUNK)
    real = (c * CHUNK + i) < numel
    x = tl.load(x_ptr + c * CHUNK + i, mask=real, other=0.0)
    mag = tl.abs(x)
    isnan = mag != mag
    keymag = tl.where(isnan, float("inf"), mag)
    bits = keymag.to(tl.int32, bitcast=True).to(tl.int64)
    low = (CHUNK - 1 - i).to(tl.int64)
    key = tl.where(real, ((bits + 1) << 32) | low, low)   # the padding below every real element
    amax = tl.max(tl.where(isnan, 0.0, mag), axis=0)
    amax = tl.where(tl.max(isnan.to(tl.int32), axis=0) > 0, float("nan"), amax)
    t = tl.zeros([], dtype=tl.int64)
    one = tl.full([], 1, dtype=tl.int64)
    for b in range(62, -1, -1):   # the largest t with k keys >= t: the k-th largest key
        cand = t | (one << b)
        if tl.sum((key >= cand).to(tl.int32), axis=0) >= k:
            t = cand
    kept = key >= t
    # the scale: the median of the kept nonzero magnitudes, the (nz // 2 + 1)-th largest key
    nz = tl.sum((kept & (key >= (2 << 32))).to(tl.int32), axis=0)
    m = tl.zeros([], dtype=tl.int64)
    for b in range(62, -1, -1):
        cand = m | (one << b)
        if tl.sum((key >= cand).to(tl.int32), axis=0) >= nz // 2 + 1:
            m = cand
    median = tl.where(nz > 0, ((m >> 32) - 1).to(tl.int32).to(tl.float32, bitcast=True), 0.0)
    s = tl.where((amax == amax) & (amax != float("inf")), median, amax)
    slot = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    code = ((mag > s * 2.0).to(tl.int32) << 1) | (x < 0.0).to(tl.int32)
    tl.store(index_ptr + c * k + slot, i.to(tl.int32), mask=kept)
    tl.store(codes_ptr + c * k + slot, code.to(tl.uint8), mask=kept)
    tl.store(scales_ptr + c, s)


@triton.jit
def _decode_kernel(scales_ptr, index_ptr, codes_ptr, parts, nc, k, numel, out_ptr, factor,
                   CHUNK: tl.constexpr, KP: tl.constexpr, SCALE: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, CHUNK)
    mine = (c * CHUNK + i) < numel
    tl.store(out_ptr + c * CHUNK + i, tl.zeros([CHUNK], dtype=tl.float32), mask=mine)
    j = tl.arange(0, KP)
    inj = j < k
    for p in range(parts):
        tl.debug_barrier()   # the previous part's sums are stored
        s = tl.load(scales_ptr + p * nc + c)
        idx = tl.load(index_ptr + (p * nc + c) * k + j, mask=inj, other=0).to(tl.int64)
        code = tl.load(codes_ptr + (p * nc + c) * k + j, mask=inj, other=0).to(tl.int32)
        level = (1 + 2 * (code >> 1)).to(tl.float32) * s
        val = tl.where((code & 1) != 0, -level, level)
        at = c * CHUNK + idx
        ok = inj & (at < numel)   # the last chunk's padding is dropped
        acc = tl.load(out_ptr + at, mask=ok, other=0.0)
        tl.store(out_ptr + at, acc + val, mask=ok)
    if SCALE:
        tl.debug_barrier()
        v = tl.load(out_ptr + c * CHUNK + i, mask=mine, other=0.0)
        tl.store(out_ptr + c * CHUNK + i, v * factor, mask=mine)


def encode(x: torch.Tensor, k: int, chunk: int, nc: int):
    """(scales [nc], index int32 [nc, k], codes uint8 [nc, k]): sparse.py wraps them."""
    scales = torch.empty(nc, dtype=torch.float32, device=x.device)
    index = torch.empty(nc, k, dtype=torch.int32, device=x.device)
    codes = torch.empty(nc, k, dtype=torch.uint8, device=x.device)
    _encode_kernel[(nc,)](x, x.numel(), scales, index, codes, k, CHUNK=chunk, **_EXACT)
    return scales, index, codes


def decode_reduce(parts, factor, out: torch.Tensor) -> torch.Tensor:
    scales, index, codes = parts.scales.contiguous(), parts.index.contiguous(), parts.codes.contiguous()
    nc, k = scales.shape[-1], parts.k
    _decode_kernel[(nc,)](scales, index, codes, scales.shape[0], nc, k, parts.numel, out,
                          1.0 if factor is None else factor, CHUNK=parts.chunk, KP=triton.next_power_of_2(k),
                          SCALE=factor is not None, **_EXACT)
    return out
