"""Block-diagonal Walsh-Hadamard transform, for qgZ's optional smoothing of gradient
blocks before INT4 quantization (`zero_hadamard_gradients`; SDP4Bit, arXiv 2410.15526).

A flat fp32 tensor whose length is a multiple of the block size B (a power of two, qgZ's
quantization block) is cut into blocks of B and each block x becomes H x, H the B x B
Sylvester-Hadamard matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]). It spreads one
large element of a block over all B of them, so the block's max-abs scale shrinks
relative to the typical element and INT4's 7 levels per sign resolve the rest.

- Forward (`inverse=False`): unnormalized H x by the fast butterfly: log2(B) stages,
  stage s (h = 2**s) replaces each pair (i, i + h) of every group of 2h elements by
  (a + b, a - b). Per-block scaled quantization does not care about the factor.
- Inverse: the same butterfly, then times 1/B (exact: a power of two), since H H = B I.
  inverse(forward(x)) == x up to the fp32 rounding of the sums: each output is a sum of
  B terms added in a tree of depth log2(B), within log2(B) ulps of sum|x| per pass.

Two backends, bit-identical (tests/unit/kernels/test_hadamard.py), chosen by zeropp.kernels.quant.kernel:
a Triton kernel on CUDA (zeropp/kernels/triton_hadamard.py, the same stages, the same fp32 adds
and subtracts) and this vectorized torch path elsewhere, which works on chunks of whole blocks with one
reusable scratch chunk per thread (ping-pong between it and the result), so temporaries
stay about a MB whatever the tensor.
"""
from __future__ import annotations

import threading

import torch

from zeropp.kernels.quant import kernel

__all__ = ["hadamard", "check_hadamard_block"]

_CHUNK = 1 << 18          # elements per chunk (1 MB of fp32), as zeropp/kernels/torch_quant.py's
_SCRATCH = threading.local()


def check_hadamard_block(block_size: int) -> int:
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"the Hadamard block size must be a power of two >= 2, got {block_size}")
    return block_size


def _scratch(numel: int, device) -> torch.Tensor:
    key = torch.device(device)
    buf = _SCRATCH.__dict__.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.__dict__[key] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]


def _torch_chunk(src: torch.Tensor, dst: torch.Tensor, tmp: torch.Tensor, block_size: int):
    """The butterfly of whole blocks src -> dst (same length; may be the same memory), with
    tmp (disjoint from both) for the intermediate stages. Stage k writes dst if the stages
    left after it are even in number, else tmp, so the last one writes dst."""
    stages = block_size.bit_length() - 1
    if stages % 2 == 1 and src.data_ptr() == dst.data_ptr():
        tmp.copy_(src)      # the first stage would read and write the same memory
        src = tmp
    h = 1
    for k in range(stages):
        out = dst if (stages - 1 - k) % 2 == 0 else tmp
        s, d = src.view(-1, 2, h), out.view(-1, 2, h)
        a, b = s[:, 0], s[:, 1]
        torch.add(a, b, out=d[:, 0])
        torch.sub(a, b, out=d[:, 1])
        src, h = out, 2 * h


def _torch_hadamard(x: torch.Tensor, out: torch.Tensor, block_size: int, inverse: bool):
    """The torch backend, with triton_hadamard.hadamard's signature."""
    n = x.numel()
    step = max(1, _CHUNK // block_size) * block_size
    tmp = _scratch(min(step, n), x.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        _torch_chunk(x[lo:hi], out[lo:hi], tmp[:hi - lo], block_size)
        if inverse:
            out[lo:hi].mul_(1.0 / block_size)


def hadamard(x: torch.Tensor, block_size: int, inverse: bool = False, out: torch.Tensor | None = None,
             backend: str = "auto") -> torch.Tensor:
    """The block-diagonal transform of the flat contiguous fp32 `x` (numel a multiple of
    `block_size`), into `out` (same shape, `x` itself or memory disjoint from it; default:
    `x`, in place). 'auto': the
    Triton kernel for CUDA tensors when triton imports, else torch."""
    check_hadamard_block(block_size)
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"hadamard needs a contiguous fp32 tensor, got {x.dtype}"
                         f"{'' if x.is_contiguous() else ' (not contiguous)'}")
    if x.numel() % block_size:
        raise ValueError(f"hadamard: {x.numel()} elements are not whole blocks of {block_size}")
    if out is None:
        out = x
    elif out.dtype != torch.float32 or out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"hadamard: out must be contiguous fp32 of shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    if x.numel() == 0:
        return out
    kernel("hadamard", backend, x.device, block_size, torch_impl=_torch_hadamard)(x.view(-1), out.view(-1),
                                                                              block_size, inverse)
    return out
