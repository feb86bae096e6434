"""The torch reference of zeropp/kernels/quant.py's block quantization (the format and its
rules are described there; zeropp/kernels/cpu_quant.py and triton_quant.py give the same bits).
Vectorized torch, any device, any positive block size: whole blocks at a time, in chunks of
about _CHUNK elements, so temporaries stay small (about a MB, in cache) whatever the tensor.
Called through zeropp.kernels.quant, which checks the arguments.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

import torch

from zeropp.kernels.format import QMAX, SCALE_DIV, Quantized, num_blocks

_CHUNK = 1 << 18   # 1 MB of fp32: per-op overhead amortized, temporaries still in cache
_STACKED_CHUNK = 4 * _CHUNK   # elements of a chunk over all the rows of a stacked tensor
_SCRATCH = threading.local()
_LITTLE_ENDIAN = sys.byteorder == "little"   # INT4 (un)packing reads a pair of int8 as one int16


def _scratch(slot: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable temporary for one chunk (contents undefined). The same few slots serve every
    call, so a chunk's temporaries are not allocated and freed each time (on CPU a freed MB
    can go back to the OS and page-fault in again, which made a quantization's time in a
    loop vary several-fold). At most `scratch_bound` bytes per thread."""
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
    uint8 [nb * bs / 2] for INT4, [nb * bs / 4] for INT2) and `scales_out` (fp32 [nb])."""
    qmax = QMAX[bits]
    # max|x| without an |x| temporary (amax and amin propagate NaN; aminmax is slower on CPU)
    scales = torch.maximum(xb.amax(dim=-1), xb.amin(dim=-1).neg_(), out=scales_out)
    scales.div_(SCALE_DIV[bits])
    finite = torch.isfinite(scales)
    safe = torch.where((scales == 0) | ~finite, torch.ones_like(scales), scales)
    y = torch.div(xb, safe.unsqueeze(-1), out=_scratch("quotient", xb.shape, torch.float32, xb.device))
    # clamp guards subnormal scales; round is ties-to-even, as the Triton kernels' rint trick
    y.clamp_(-qmax, qmax).round_()
    if not bool(finite.all()):  # non-finite block: data 0, the scale carries inf/nan
        y.masked_fill_(~finite.unsqueeze(-1), 0.0)
    if bits == 8:
        data_out.copy_(y.view(-1))
    elif bits == 2:   # four values per byte, element 4i + k in bits 2k, 2k + 1
        q = _scratch("int8", (y.numel() // 4, 4), torch.int8, y.device)
        q.copy_(y.view(-1, 4))
        u = q.view(torch.uint8).bitwise_and_(3)
        byte = _scratch("pack2", (y.numel() // 4,), torch.uint8, y.device)
        torch.bitwise_left_shift(u[:, 3], 6, out=byte)
        for k in (2, 1):
            byte.bitwise_or_(u[:, k] << (2 * k))
        data_out.copy_(byte.bitwise_or_(u[:, 0]))
    else:  # two values per byte, low nibble = even element
        q = _scratch("int8", (y.numel(),), torch.int8, y.device)
        q.copy_(y.view(-1))
        if not _LITTLE_ENDIAN:
            torch.bitwise_or(q[0::2] & 0xF, q[1::2] << 4, out=data_out.view(torch.int8))
            return
        # Each pair as one int16 (q[2i] the low byte): contiguous ops, faster on CPU
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
    every op is contiguous (faster on CPU than writing out[..., 0] and out[..., 1])."""
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


def _unpack2(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> int8 [..., 4m]: value k of byte i is bits 2k, 2k + 1, sign-extended
    ((v ^ 2) - 2 maps 0, 1, 2, 3 to 0, 1, -2, -1)."""
    out = _scratch("unpacked2", (*b.shape, 4), torch.int8, b.device)
    for k in range(4):
        v = out[..., k]
        torch.bitwise_right_shift(b, 2 * k, out=v.view(torch.uint8)).bitwise_and_(3)
        v.bitwise_xor_(2).sub_(2)
    return out.flatten(-2)


def _values(q: Quantized, b0: int, b1: int) -> torch.Tensor:
    """int8 [..., b1 - b0, bs]: the quantized values of blocks [b0, b1), unpacked."""
    bs = q.block_size
    if q.bits == 8:
        vals = q.data[..., b0 * bs:b1 * bs]
    elif q.bits == 2:
        vals = _unpack2(q.data[..., b0 * bs // 4:b1 * bs // 4])
    else:
        vals = _unpack4(q.data[..., b0 * bs // 2:b1 * bs // 2])
    return vals.reshape(*q.data.shape[:-1], b1 - b0, bs)


def _write(out: torch.Tensor, lo: int, hi: int, blocks: torch.Tensor):
    """Elements [lo, hi) of `out` ([..., numel]) from the fp32 `blocks` [..., nb, bs]."""
    out[..., lo:hi].copy_(blocks.reshape(*blocks.shape[:-2], -1)[..., :hi - lo])


def dequantize(q: Quantized, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    """q * scale computed in fp32 and rounded once into `out` ([..., numel], any float
    dtype): for fp32, one multiply straight into `out` for whole blocks; for 16-bit, an
    fp32 chunk then a cast (a mixed int8 x fp32 -> bf16 multiply is several times slower on CPU)."""
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
    return out


def quantize(x: torch.Tensor, bits: int, block_size: int, out: Optional[Quantized] = None) -> Quantized:
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


def dequantize_reduce_requantize(st: Quantized, bits_out: int, out: Optional[Quantized] = None) -> Quantized:
    bs = st.block_size
    out = out if out is not None else Quantized.empty(st.numel, bits_out, bs, st.data.device)
    per_byte = 8 // bits_out
    for b0, b1, acc in _summed_chunks(st):
        _quantize_blocks(acc, bits_out, out.data[b0 * bs // per_byte:b1 * bs // per_byte], out.scales[b0:b1])
    return out


def dequantize_reduce_quantize(st: Quantized, bits_out: int, block_size_out: int,
                               out: Optional[Quantized] = None) -> Quantized:
    """dequantize_reduce_requantize into blocks of another size (only this path does it):
    the whole sum in fp32, then quantized afresh."""
    bs = st.block_size
    total = torch.empty(st.num_blocks * bs, dtype=torch.float32, device=st.data.device)
    for b0, b1, acc in _summed_chunks(st):
        total[b0 * bs:b1 * bs].copy_(acc.view(-1))
    return quantize(total[:st.numel], bits_out, block_size_out, out)


def dequantize_reduce(st: Quantized, dtype: torch.dtype, scale: float, out: torch.Tensor) -> torch.Tensor:
    factor = torch.tensor(scale, dtype=torch.float32)
    bs = st.block_size
    for b0, b1, acc in _summed_chunks(st):
        if scale != 1.0:
            acc.mul_(factor)
        _write(out, b0 * bs, min(b1 * bs, st.numel), acc)
    return out
