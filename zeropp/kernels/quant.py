"""Block-wise symmetric quantization for ZeRO++ (qwZ: INT8 weights, qgZ: INT4 gradients).

One API, two backends (REFERENCE.md section 7): Triton kernels (``zeropp.kernels.triton_quant``)
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
import sys
import threading
from typing import Optional, Sequence, Union

import torch

from zeropp.kernels import cpu_quant
from zeropp.kernels.format import (DEFAULT_BLOCK_SIZE, QMAX, Quantized, check_block_size, num_blocks,
                                 wire_nbytes)

__all__ = ["Quantized", "DEFAULT_BLOCK_SIZE", "QMAX", "forced_backend", "quantize", "dequantize", "dequantize_add",
           "dequantize_reduce_requantize", "dequantize_reduce", "wire_nbytes", "triton_available",
           "scratch_bytes", "scratch_bound"]

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


def _pick_backend(backend: str, device: torch.device, block_size: int,
                  dtype: Optional[torch.dtype] = None) -> str:
    """'auto' -> 'triton' for CUDA tensors when triton imports and block_size is a power of
    two; 'cpu' (zeropp.kernels.cpu_quant, compiled) for CPU tensors of fp32/bf16/fp16 when it builds;
    else 'torch'. ZEROPP_QUANT_BACKEND=torch (or cpu) in the environment forces that one."""
    if backend not in ("auto", "torch", "triton", "cpu"):
        raise ValueError(f"backend must be auto, torch, triton or cpu, got {backend!r}")
    if backend == "auto":
        backend = forced_backend()
    if backend != "auto":
        if backend == "triton" and not triton_available():
            raise RuntimeError("backend='triton' but triton is not importable")
        if backend == "cpu" and not cpu_quant.available():
            raise RuntimeError(f"backend='cpu': {cpu_quant.why_not()}")
        return backend
    if device.type == "cuda" and block_size & (block_size - 1) == 0 and triton_available():
        return "triton"
    if device.type == "cpu" and dtype in (None, torch.float32, torch.bfloat16, torch.float16):
        if cpu_quant.supports(block_size):
            return "cpu"
        global _WARNED
        if not _WARNED and not cpu_quant.available():
            _WARNED = True
            cpu_quant.warn_unavailable()
    return "torch"


# ---------------------------------------------------------------------------------------
# torch reference implementation: whole blocks at a time, in chunks of about _CHUNK
# elements, so temporaries stay small (about a MB, in cache) whatever the tensor

_CHUNK = 1 << 18   # 1 MB of fp32: per-op overhead amortized, temporaries still in cache
_STACKED_CHUNK = 4 * _CHUNK   # elements of a chunk over all the rows of a stacked tensor
_SCRATCH = threading.local()
_LITTLE_ENDIAN = sys.byteorder == "little"   # INT4 (un)packing reads a pair of int8 as one int16


def _scratch(slot: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable temporary for one chunk (contents undefined). The same few slots serve every
    call, so a chunk's temporaries are not allocated and freed each time (on CPU a freed MB
    can go back to the OS and page-fault in again: one INT8 quantization of 327,680 bf16
    elements took 0.55-1.5 ms in a loop here, a steady 0.36 with the slots). At most
    `scratch_bound` bytes per thread (about 11 MB)."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = max(1, numel * dtype.itemsize)
    slots = _SCRATCH.__dict__.setdefault(torch.device(device), {})
    buf = slots.get(slot)
    if buf is None or buf.numel() < nbytes:
        buf = slots[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf[:nbytes].view(dtype).view(shape)


def _chunks(num_blocks_: int, block_size: int, rows: int = 1):
    """(first block, last block + 1) of each chunk: _CHUNK elements of each row, and at
    most _STACKED_CHUNK over `rows` stacked tensors, so that the temporaries stay bounded
    however many rows (ranks) there are, and the chunks few (per-op overhead)."""
    step = max(1, min(_CHUNK, _STACKED_CHUNK // rows) // block_size)
    for b0 in range(0, num_blocks_, step):
        yield b0, min(num_blocks_, b0 + step)


def scratch_bytes(device) -> int:
    """Bytes the torch path's scratch slots hold now in this thread (for `device`)."""
    return sum(b.numel() for b in _SCRATCH.__dict__.get(torch.device(device), {}).values())


def scratch_bound(block_size: int, rows: int = 1) -> int:
    """The most `scratch_bytes` can reach for blocks of `block_size` and up to `rows` stacked
    tensors (a chunk is at least one block of every row). Bytes per element of a chunk: of
    one row, input, quotient, sum and term (fp32), int8, pack and pack_low (1 each); of all
    its rows, product (fp32), unpacked and unpacked_low (int16 per pair: 1 each)."""
    return 19 * max(_CHUNK, block_size) + 6 * max(_STACKED_CHUNK, block_size * rows)


def _quantize_blocks(xb: torch.Tensor, bits: int, data_out: torch.Tensor, scales_out: torch.Tensor):
    """xb: fp32 [nb, bs] -> the quantized blocks into `data_out` (int8 [nb * bs], or packed
    uint8 [nb * bs / 2] for INT4) and `scales_out` (fp32 [nb])."""
    qmax = QMAX[bits]
    # max|x| without an |x| temporary (amax and amin propagate NaN; aminmax is slower on CPU)
    scales = torch.maximum(xb.amax(dim=-1), xb.amin(dim=-1).neg_(), out=scales_out)
    scales.div_(qmax)
    finite = torch.isfinite(scales)
    safe = torch.where((scales == 0) | ~finite, torch.ones_like(scales), scales)
    y = torch.div(xb, safe.unsqueeze(-1), out=_scratch("quotient", xb.shape, torch.float32, xb.device))
    # clamp guards subnormal scales; round is ties-to-even, as the Triton kernels' rint trick
    y.clamp_(-qmax, qmax).round_()
    if not bool(finite.all()):  # non-finite block: data 0, the scale carries inf/nan
        y.masked_fill_(~finite.unsqueeze(-1), 0.0)
    if bits == 8:
        data_out.copy_(y.view(-1))
    else:  # two values per byte, low nibble = even element
        q = _scratch("int8", (y.numel(),), torch.int8, y.device)
        q.copy_(y.view(-1))
        if not _LITTLE_ENDIAN:
            torch.bitwise_or(q[0::2] & 0xF, q[1::2] << 4, out=data_out.view(torch.int8))
            return
        # Each pair as one int16 (q[2i] the low byte): contiguous ops, ~3x faster on CPU
        # than the strided q[0::2], q[1::2].
        pair = q.view(torch.int16)
        byte = _scratch("pack", pair.shape, torch.int16, y.device)
        low = _scratch("pack_low", pair.shape, torch.int16, y.device)
        torch.bitwise_right_shift(pair, 4, out=byte).bitwise_and_(0xF0)     # q[2i+1]'s nibble, bits 4-7
        byte.bitwise_or_(torch.bitwise_and(pair, 0x0F, out=low))             # q[2i]'s nibble, bits 0-3
        data_out.copy_(byte)


def _unpack4(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> int8 [..., 2m]: arithmetic shifts sign-extend each nibble (4-bit
    two's complement). Built as one int16 per byte, the low nibble in the low byte, so
    every op is contiguous (~3x faster on CPU than writing out[..., 0] and out[..., 1])."""
    if not _LITTLE_ENDIAN:
        out = _scratch("unpacked", (*b.shape[:-1], b.shape[-1], 2), torch.int8, b.device)
        torch.bitwise_right_shift((b << 4).view(torch.int8), 4, out=out[..., 0])
        torch.bitwise_right_shift(b.view(torch.int8), 4, out=out[..., 1])
        return out.flatten(-2)
    word = _scratch("unpacked", b.shape, torch.int16, b.device)
    low = _scratch("unpacked_low", b.shape, torch.int16, b.device)
    word.copy_(b)                                                              # 0..255
    torch.bitwise_left_shift(word, 12, out=low).bitwise_right_shift_(12).bitwise_and_(0xFF)
    word.bitwise_left_shift_(8).bitwise_right_shift_(4).bitwise_and_(-256)    # high nibble, high byte
    return word.bitwise_or_(low).view(torch.int8)


def _values(q: Quantized, b0: int, b1: int) -> torch.Tensor:
    """int8 [..., b1 - b0, bs]: the quantized values of blocks [b0, b1), unpacked."""
    bs = q.block_size
    if q.bits == 8:
        vals = q.data[..., b0 * bs:b1 * bs]
    else:
        vals = _unpack4(q.data[..., b0 * bs // 2:b1 * bs // 2])
    return vals.reshape(*q.data.shape[:-1], b1 - b0, bs)


def _write(out: torch.Tensor, lo: int, hi: int, blocks: torch.Tensor):
    """Elements [lo, hi) of `out` ([..., numel]) from the fp32 `blocks` [..., nb, bs]."""
    out[..., lo:hi].copy_(blocks.reshape(*blocks.shape[:-2], -1)[..., :hi - lo])


def _dequant_into(q: Quantized, out: torch.Tensor):
    """q * scale computed in fp32 and rounded once into `out` ([..., numel], any float
    dtype): for fp32, one multiply straight into `out` for whole blocks; for 16-bit, an
    fp32 chunk then a cast (a mixed int8 x fp32 -> bf16 multiply is ~7x slower on CPU)."""
    bs, n = q.block_size, q.numel
    lead = q.data.shape[:-1]
    for b0, b1 in _chunks(q.num_blocks, bs, lead.numel()):
        lo, hi = b0 * bs, min(b1 * bs, n)
        vals, scales = _values(q, b0, b1), q.scales[..., b0:b1].unsqueeze(-1)
        if out.dtype == torch.float32 and hi - lo == (b1 - b0) * bs:
            torch.mul(vals, scales, out=out[..., lo:hi].view(*lead, b1 - b0, bs))
        else:
            _write(out, lo, hi, torch.mul(vals, scales, out=_scratch("product", vals.shape, torch.float32,
                                                                    vals.device)))


def _torch_quantize(x: torch.Tensor, bits: int, block_size: int, out: Optional[Quantized] = None) -> Quantized:
    n, bs = x.numel(), block_size
    nb = num_blocks(n, bs)
    x = x.reshape(-1)
    out = out if out is not None else Quantized.empty(n, bits, bs, x.device)
    data, scales = out.data, out.scales
    per_byte = 8 // bits
    for b0, b1 in _chunks(nb, bs):
        lo, hi = b0 * bs, min(b1 * bs, n)
        if x.dtype == torch.float32 and hi - lo == (b1 - b0) * bs:
            xf = x[lo:hi]
        else:   # 16-bit in an fp32 chunk, zero-padded to whole blocks
            xf = _scratch("input", ((b1 - b0) * bs,), torch.float32, x.device)
            xf[:hi - lo].copy_(x[lo:hi])
            xf[hi - lo:].zero_()
        _quantize_blocks(xf.view(b1 - b0, bs), bits, data[lo // per_byte:b1 * bs // per_byte], scales[b0:b1])
    return out


def _as_stacked(parts: Union[Quantized, Sequence[Quantized]]) -> Quantized:
    if isinstance(parts, Quantized):
        return parts if parts.stacked else Quantized.stack([parts])
    if len(parts) == 0:
        raise ValueError("need at least one part")
    return Quantized.stack(list(parts))


def _summed_chunks(st: Quantized):
    """(b0, b1, fp32 [b1 - b0, bs]): the sum over the k parts of blocks [b0, b1),
    accumulated sequentially (part 0, then +1, ...), each product rounded before the sum
    (no fused multiply-add): the Triton kernel's order, so both give identical bits."""
    for b0, b1 in _chunks(st.num_blocks, st.block_size, len(st)):
        vals, scales = _values(st, b0, b1), st.scales[:, b0:b1].unsqueeze(-1)
        acc = torch.mul(vals[0], scales[0], out=_scratch("sum", vals.shape[1:], torch.float32, vals.device))
        term = _scratch("term", acc.shape, torch.float32, acc.device)
        for i in range(1, len(st)):
            acc.add_(torch.mul(vals[i], scales[i], out=term))
        yield b0, b1, acc


# ---------------------------------------------------------------------------------------
# public API

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
    chosen = _pick_backend(backend, x.device, block_size, x.dtype)
    if chosen == "triton":
        from zeropp.kernels import triton_quant
        return triton_quant.quantize(x, bits, block_size, out=out)
    if chosen == "cpu":
        return cpu_quant.quantize(x, bits, block_size, out=out)
    return _torch_quantize(x, bits, block_size, out)


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
    chosen = _pick_backend(backend, q.data.device, q.block_size, dtype)
    if chosen == "triton":
        from zeropp.kernels import triton_quant
        return triton_quant.dequantize(q, dtype, out=out)
    if chosen == "cpu":
        return cpu_quant.dequantize(q, dtype, out=out)
    _dequant_into(q, out)
    return out


def dequantize_add(q: Quantized, out: torch.Tensor, backend: str = "auto",
                   scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out += dequantize(q)``: the sum in fp32, rounded once to ``out``'s dtype (a 16-bit
    ``out.add_(fp32)`` gives the same bits, ~15x slower on CPU). ``out``: ``[numel]``, or
    ``[k, numel]`` for a stacked ``q`` with rows that may be strided. One pass on CPU;
    elsewhere a dequantization into ``scratch`` (fp32, at least ``out.numel()``) then the add."""
    if out.shape != (*q.data.shape[:-1], q.numel) or out.stride(-1) != 1:
        raise ValueError(f"dequantize_add: out must have shape {(*q.data.shape[:-1], q.numel)} with "
                         f"contiguous rows, got {tuple(out.shape)}")
    if _pick_backend(backend, q.data.device, q.block_size, out.dtype) == "cpu":
        return cpu_quant.dequantize_add(q, out)
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
        block_size_out = st.block_size if (bits_out == 8 or st.block_size % 2 == 0) else None
    block_size_out = check_block_size(bits_out, block_size_out)
    if out is not None:
        out.check_out(st.numel, bits_out, block_size_out)
    chosen = _pick_backend(backend, st.data.device, st.block_size)
    if chosen == "triton" and block_size_out == st.block_size:
        from zeropp.kernels import triton_quant
        return triton_quant.dequantize_reduce_requantize(st, bits_out, out=out)
    if chosen == "cpu" and block_size_out == st.block_size:
        return cpu_quant.dequantize_reduce_requantize(st, bits_out, out=out)
    bs = st.block_size
    if block_size_out != bs:   # requantize the whole sum in the other block size
        total = torch.empty(st.num_blocks * bs, dtype=torch.float32, device=st.data.device)
        for b0, b1, acc in _summed_chunks(st):
            total[b0 * bs:b1 * bs].copy_(acc.view(-1))
        return _torch_quantize(total[:st.numel], bits_out, block_size_out, out)
    out = out if out is not None else Quantized.empty(st.numel, bits_out, bs, st.data.device)
    per_byte = 8 // bits_out
    for b0, b1, acc in _summed_chunks(st):
        _quantize_blocks(acc, bits_out, out.data[b0 * bs // per_byte:b1 * bs // per_byte], out.scales[b0:b1])
    return out


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
    chosen = _pick_backend(backend, st.data.device, st.block_size, dtype)
    if chosen == "triton":
        from zeropp.kernels import triton_quant
        return triton_quant.dequantize_reduce(st, dtype, scale, out=out)
    if chosen == "cpu":
        return cpu_quant.dequantize_reduce(st, dtype, scale, out=out)
    factor = torch.tensor(scale, dtype=torch.float32)
    bs = st.block_size
    for b0, b1, acc in _summed_chunks(st):
        if scale != 1.0:
            acc.mul_(factor)
        _write(out, b0 * bs, min(b1 * bs, st.numel), acc)
    return out
