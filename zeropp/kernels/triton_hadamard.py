"""Triton kernel for zeropp.kernels.hadamard: the same block-diagonal Walsh-Hadamard butterfly,
bit for bit (tests/unit/kernels/test_hadamard.py).

Each program holds a tile of ROWS blocks of BLOCK elements ([ROWS, BLOCK], about 2048
elements). Stage s (h = 2**s) views each block as [BLOCK / 2h, 2, h], moves the pair axis
last (permute), splits it into a (first half of each group of 2h) and b (second half),
and joins (a + b, a - b) back in place: the torch path's stages, in its order, with the
same fp32 adds and subtracts (no multiply until the inverse's exact 1/BLOCK). Called
through zeropp.kernels.hadamard for CUDA tensors; CPU tensors work when TRITON_INTERPRET=1 was
set before triton was imported (tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_TILE = 2048
_EXACT = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


@triton.jit
def _stage(v, ROWS: tl.constexpr, BLOCK: tl.constexpr, H: tl.constexpr):
    """One butterfly stage of v [ROWS, BLOCK]: pairs (i, i + H) of each group of 2H."""
    G: tl.constexpr = BLOCK // (2 * H)
    w = tl.permute(tl.reshape(v, (ROWS, G, 2, H)), (0, 1, 3, 2))     # [ROWS, G, H, 2]
    a, b = tl.split(w)
    w = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))              # [ROWS, G, 2, H]
    return tl.reshape(w, (ROWS, BLOCK))


@triton.jit
def _hadamard_kernel(x_ptr, out_ptr, numel, factor,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, INVERSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    v = tl.load(x_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(STAGES):
        v = _stage(v, ROWS, BLOCK, 1 << s)
    if INVERSE:
        v = v * factor
    tl.store(out_ptr + offs, v, mask=mask)


def hadamard(x: torch.Tensor, out: torch.Tensor, block_size: int, inverse: bool):
    """x, out: flat contiguous fp32, numel a multiple of block_size (zeropp.kernels.hadamard checks)."""
    n = x.numel()
    rows = max(1, _TILE // block_size)
    grid = (triton.cdiv(n // block_size, rows),)
    _hadamard_kernel[grid](x, out, n, 1.0 / block_size, BLOCK=block_size, ROWS=rows,
                           STAGES=block_size.bit_length() - 1, INVERSE=inverse, **_EXACT)
