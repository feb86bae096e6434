"""Block-wise symmetric quantization for ZeRO++ (qwZ: INT8 weights, qgZ: INT4 gradients, or INT2
across nodes with `zero_quantized_gradients_bits` 2; LoCo's errors kept in INT8).

One API, three backends giving the same bits, chosen in one place (`kernel`): Triton
kernels (``zeropp.kernels.triton_quant``) when the tensor is on CUDA and triton imports, C
kernels (``zeropp.kernels.cpu_quant``) for CPU tensors when they build, and the vectorized
torch reference (``zeropp.kernels.torch_quant``) everywhere else; `kernel` also chooses the
backend of the Hadamard transform (zeropp/kernels/hadamard.py).

Format
------
A flat tensor of ``numel`` elements is zero-padded to ``num_blocks * block_size``
elements and cut into blocks of ``block_size``.  Each block gets one fp32 scale::

    scale = max|x| / div             (div = qmax = 127 for INT8, 7 for INT4; INT2: qmax 1, div 2)
    q     = round_half_even(clamp(x / scale, -qmax, qmax))
    x'    = q * scale                (computed in fp32, then cast to the requested dtype)

* INT8: ``data`` is int8, shape ``[num_blocks * block_size]``.
* INT4: ``data`` is uint8, shape ``[num_blocks * block_size // 2]``; two values per byte,
  **low nibble first**: element ``2i`` is in bits 0-3 of byte ``i``, element ``2i+1`` in
  bits 4-7.  Each nibble is the 4-bit two's complement of q (q in [-7, 7]; -8 is never
  produced), i.e. ``byte = (q[2i] & 0xF) | ((q[2i+1] & 0xF) << 4)``.  ``block_size`` must
  be even so that blocks are byte aligned.
* INT2: ``data`` is uint8, shape ``[num_blocks * block_size // 4]``; four values per byte,
  element ``4i + k`` in bits ``2k, 2k+1`` of byte ``i``, each the 2-bit two's complement of
  q in {-1, 0, 1} (ternary: -2 is never produced).  ``block_size`` must be a multiple of 4.
  Its step is max|x| / 2, not max|x|: the codes cut at a quarter of the block's largest
  and stand for half of it, clipping what is above (format.py SCALE_DIV). On Gaussian blocks
  of 128 the mean squared error is 0.35 of a step of max|x|'s (0.21 against 0.59 variances,
  tests/unit/kernels/test_quant.py), near the least a ternary code reaches, and it kept qgZ's INT2 hop and
  the INT2 weight deltas closer to ZeRO-3 (docs/results.md, convergence).
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
max|x| for the rounding of the division and the product): max|x| / 254 of its block for
INT8, max|x| / 14 for INT4; INT2 clips, so a whole step, ``|x - x'| <= scale`` = max|x| / 2
(format.py ERROR_STEPS; qgZ sends it only with error feedback).
tests/unit/kernels/test_quant.py checks the bound for every format.

Default block sizes (``DEFAULT_BLOCK_SIZE``)
--------------------------------------------
* INT8 (qwZ weights): 256.  The fp32 scale costs 4/256 of the 1-byte data
  (M -> 0.508M instead of 0.5M); 127 levels make the error small even with wider blocks.
* INT4 (qgZ gradients): 128.  Only 7 levels per sign, so one outlier degrades the whole
  block: smaller blocks keep the error of gradient reduction small.  Overhead 4/64 of the
  data bytes (0.25M -> 0.266M).
Both are powers of two (required by the Triton kernels; the torch path accepts any
positive size, even for INT4) and multiples of 8, so the wire buffer of ``to_bytes`` is
4-byte aligned.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence, Union

import torch

from zeropp.kernels import cpu_quant, torch_quant
from zeropp.kernels.format import DEFAULT_BLOCK_SIZE, QMAX, Quantized, check_block_size, wire_nbytes
from zeropp.kernels.torch_quant import scratch_bound, scratch_bytes

__all__ = ["Quantized", "DEFAULT_BLOCK_SIZE", "QMAX", "forced_backend", "quantize", "dequantize", "dequantize_add",
           "dequantize_reduce_requantize", "dequantize_reduce", "wire_nbytes", "triton_available",
           "scratch_bytes", "scratch_bound", "kernel"]

_TRITON = None
_WARNED = False   # said once that the CPU kernels are missing


def triton_available() -> bool:
    """True if ``zeropp.kernels.triton_quant`` imports (triton installed)."""
    global _TRITON
    if _TRITON is None:
        try:
            from zeropp.kernels import triton_quant  # noqa: F401
            _TRITON = triton_quant
        except Exception:  # ImportError, or a broken triton install
            _TRITON = False
    return _TRITON is not False


def forced_backend() -> str:
    """ZEROPP_QUANT_BACKEND ('auto' when unset); a ValueError for a value that is no backend."""
    backend = os.environ.get("ZEROPP_QUANT_BACKEND", "") or "auto"
    if backend not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"ZEROPP_QUANT_BACKEND={backend!r}: use torch, cpu or triton (or leave it unset)")
    return backend


def kernel(op: str, backend: str, device: torch.device, block_size: int,
           dtype: Optional[torch.dtype] = None, torch_impl: Optional[Callable] = None) -> Optional[Callable]:
    """The function that runs `op` (a function name of the backend modules, or 'hadamard')
    for `backend` on tensors of `device`, `block_size` and `dtype` (None: any): `op` of the
    chosen backend's module, else torch_quant's (only it quantizes a sum in other blocks,
    'dequantize_reduce_quantize'), else None (no backend but the C one adds in one pass).
    Quantization: 'auto' -> 'triton' for CUDA tensors when triton imports and block_size is
    a power of two; 'cpu' (zeropp.kernels.cpu_quant, compiled) for CPU tensors of
    fp32/bf16/fp16 when it builds; else 'torch'. ZEROPP_QUANT_BACKEND=torch (or cpu) in the
    environment forces that one.
    'hadamard' (no C kernel, no environment override): 'auto' -> Triton for CUDA tensors when
    triton imports, else `torch_impl` (zeropp/kernels/hadamard.py's: that module imports this one)."""
    if op == "hadamard":
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
        if backend == "triton" or (backend == "auto" and device.type == "cuda" and triton_available()):
            from zeropp.kernels import triton_hadamard
            return triton_hadamard.hadamard
        return torch_impl
    if backend not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"backend must be auto, torch, triton or cpu, got {backend!r}")
    if backend == "auto":
        backend = forced_backend()
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' but triton is not importable")
    if backend == "cpu" and not cpu_quant.available():
        raise RuntimeError(f"backend='cpu': {cpu_quant.why_not()}")
    if backend == "auto":
        if device.type == "cuda" and block_size & (block_size - 1) == 0 and triton_available():
            backend = "triton"
        elif device.type == "cpu" and dtype in (None, torch.float32, torch.bfloat16, torch.float16):
            if cpu_quant.supports(block_size):
                backend = "cpu"
            else:
                global _WARNED
                if not _WARNED and not cpu_quant.available():
                    _WARNED = True
                    cpu_quant.warn_unavailable()   # its stacklevel: the caller of the public function
    module = {"triton": _TRITON, "cpu": cpu_quant}.get(backend, torch_quant)
    return getattr(module, op, None) or getattr(torch_quant, op, None)


def _as_stacked(parts: Union[Quantized, Sequence[Quantized]]) -> Quantized:
    if isinstance(parts, Quantized):
        return parts if parts.stacked else Quantized.stack([parts])
    if len(parts) == 0:
        raise ValueError("need at least one part")
    return Quantized.stack(list(parts))


def quantize(x: torch.Tensor, bits: int = 8, block_size: Optional[int] = None,
             backend: str = "auto", out: Optional[Quantized] = None) -> Quantized:
    """Quantize the flattened ``x`` (fp32/fp16/bf16) to ``bits`` (8 or 4) with one fp32 scale
    per ``block_size`` elements (default ``DEFAULT_BLOCK_SIZE[bits]``). ``out``: where to
    write (``Quantized.check_out``), e.g. views into a wire buffer; default new tensors."""
    block_size = check_block_size(bits, block_size)
    if not x.is_floating_point():
        raise TypeError(f"quantize needs a floating tensor, got {x.dtype}")
    if out is not None:
        out.check_out(x.numel(), bits, block_size)
    return kernel("quantize", backend, x.device, block_size, x.dtype)(x, bits, block_size, out=out)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, backend: str = "auto",
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Back to a flat ``dtype`` tensor of exactly ``q.numel`` elements (``[k, numel]`` if
    ``q`` is stacked).  Computed in fp32 (``q * scale``), then cast.  ``out``: a contiguous
    tensor of that shape and ``dtype`` to write into (no new tensor)."""
    if out is None:
        out = torch.empty(*q.data.shape[:-1], q.numel, dtype=dtype, device=q.data.device)
    elif out.dtype != dtype or out.shape != (*q.data.shape[:-1], q.numel) or not out.is_contiguous():
        raise ValueError(f"dequantize: out must be contiguous {dtype} of shape "
                         f"{(*q.data.shape[:-1], q.numel)}, got {out.dtype} {tuple(out.shape)}")
    return kernel("dequantize", backend, q.data.device, q.block_size, dtype)(q, dtype, out=out)


def dequantize_add(q: Quantized, out: torch.Tensor, backend: str = "auto",
                   scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out += dequantize(q)``: the sum in fp32, rounded once to ``out``'s dtype (a 16-bit
    ``out.add_(fp32)`` gives the same bits, an order of magnitude slower on CPU). ``out``: ``[numel]``, or
    ``[k, numel]`` for a stacked ``q`` with rows that may be strided. One pass on CPU;
    elsewhere a dequantization into ``scratch`` (fp32, at least ``out.numel()``) then the add."""
    if out.shape != (*q.data.shape[:-1], q.numel) or out.stride(-1) != 1:
        raise ValueError(f"dequantize_add: out must have shape {(*q.data.shape[:-1], q.numel)} with "
                         f"contiguous rows, got {tuple(out.shape)}")
    one_pass = kernel("dequantize_add", backend, q.data.device, q.block_size, out.dtype)
    if one_pass is not None:
        return one_pass(q, out)
    scratch = torch.empty(out.numel(), device=out.device) if scratch is None else scratch[:out.numel()]
    delta = dequantize(q, torch.float32, backend, out=scratch.view(out.shape))
    return out.copy_(delta.add_(out))


def dequantize_reduce_requantize(parts: Union[Quantized, Sequence[Quantized]], bits_out: int = 4,
                                 block_size_out: Optional[int] = None,
                                 backend: str = "auto", out: Optional[Quantized] = None) -> Quantized:
    """qgZ's middle hop: dequantize k quantized tensors of the same numel (a list, or one
    stacked Quantized), sum them in fp32 (sequentially, part 0 first) and quantize the sum
    to ``bits_out`` with ``block_size_out`` (default: the parts' block size if valid for
    ``bits_out``, else ``DEFAULT_BLOCK_SIZE[bits_out]``). ``out`` as for ``quantize``."""
    st = _as_stacked(parts)
    if block_size_out is None:
        block_size_out = st.block_size if st.block_size * bits_out % 8 == 0 else None
    block_size_out = check_block_size(bits_out, block_size_out)
    if out is not None:
        out.check_out(st.numel, bits_out, block_size_out)
    if block_size_out == st.block_size:
        return kernel("dequantize_reduce_requantize", backend, st.data.device, st.block_size)(st, bits_out, out=out)
    return kernel("dequantize_reduce_quantize", backend, st.data.device, st.block_size)(st, bits_out,
                                                                                         block_size_out, out)


def dequantize_reduce(parts: Union[Quantized, Sequence[Quantized]], dtype: torch.dtype = torch.float32,
                      scale: float = 1.0, backend: str = "auto", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """qgZ's last hop: dequantize k parts, sum in fp32 (part 0 first), multiply by ``scale``
    (e.g. 1/world_size for averaging) in fp32, cast to ``dtype``.  Returns ``[numel]``, in
    ``out`` (contiguous, ``dtype``) when given."""
    st = _as_stacked(parts)
    if out is None:
        out = torch.empty(st.numel, dtype=dtype, device=st.data.device)
    elif out.dtype != dtype or out.shape != (st.numel,) or not out.is_contiguous():
        raise ValueError(f"dequantize_reduce: out must be contiguous {dtype} of shape ({st.numel},), "
                         f"got {out.dtype} {tuple(out.shape)}")
    return kernel("dequantize_reduce", backend, st.data.device, st.block_size, dtype)(st, dtype, scale, out=out)
