"""Tests for zeropp.kernels.quant (torch reference) and zeropp.kernels.triton_quant (Triton kernels).

The Triton kernels run on CUDA when a GPU is present, else on CPU tensors under the
Triton interpreter: TRITON_INTERPRET=1 must be in the environment before
``zeropp.kernels.triton_quant`` is imported (the kernels are decorated at import); tests/conftest.py
sets it on machines without CUDA before any test module is collected.
"""
import math
import threading

import pytest
import torch

from zeropp.kernels import quant, torch_quant
from zeropp.kernels.format import ERROR_STEPS, SCALE_DIV
from zeropp.kernels.quant import DEFAULT_BLOCK_SIZE, QMAX, Quantized

_CUDA = torch.cuda.is_available()

SIZES = [1, 7, 127, 128, 129, 1000]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = [8, 4, 2]


def _rand(n, dtype, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if spread:  # blocks of very different magnitudes, to exercise per-block scales
        x = x * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 2)
    return x.to(dtype)


# ---------------------------------------------------------------------------------------
# fp64 hand computation

def _ref_quant(x, bits, bs):
    """fp64 reference: returns (q as int64 list per element, scales fp64) for padded x."""
    qmax = QMAX[bits]
    n = x.numel()
    nb = max(1, math.ceil(n / bs))
    xf = torch.zeros(nb * bs, dtype=torch.float64)
    xf[:n] = x.double()
    xb = xf.view(nb, bs)
    scales = xb.abs().amax(1) / {8: 127, 4: 7, 2: 2}[bits]   # INT2: a step of half the largest
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(xb / safe[:, None]).clamp(-qmax, qmax).long()
    return q.flatten(), scales


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES)
def test_matches_fp64_hand_computation(bits, n):
    bs = 32
    x = _rand(n, torch.float32, seed=n)
    q = quant.quantize(x, bits, bs, backend="torch")
    ref_q, ref_s = _ref_quant(x, bits, bs)
    nb = math.ceil(n / bs)
    assert q.numel == n and q.bits == bits and q.block_size == bs and q.num_blocks == nb
    assert q.scales.dtype == torch.float32 and q.scales.shape == (nb,)
    # fp32 scale = fp32(amax) / qmax correctly rounded == fp64 value rounded to fp32
    assert torch.equal(q.scales, ref_s.float())
    if bits == 8:
        assert q.data.dtype == torch.int8 and q.data.shape == (nb * bs,)
        vals = q.data.long()
    elif bits == 2:
        assert q.data.dtype == torch.uint8 and q.data.shape == (nb * bs // 4,)
        # packing: element 4i + k in bits 2k, 2k + 1 of byte i, 2-bit two's complement
        b = q.data.long()
        fields = [(b >> (2 * k)) & 3 for k in range(4)]
        vals = torch.stack([torch.where(f >= 2, f - 4, f) for f in fields], 1).flatten()
    else:
        assert q.data.dtype == torch.uint8 and q.data.shape == (nb * bs // 2,)
        # packing: element 2i in the low nibble of byte i, 2i+1 in the high nibble,
        # 4-bit two's complement
        b = q.data.long()
        lo, hi = b & 0xF, b >> 4
        lo = torch.where(lo >= 8, lo - 16, lo)
        hi = torch.where(hi >= 8, hi - 16, hi)
        vals = torch.stack([lo, hi], 1).flatten()
    # fp32 division may differ from fp64 only exactly at a .5 tie: allow 1 level there
    diff = (vals - ref_q).abs()
    assert diff.max() <= 1
    assert (diff > 0).sum() <= 2
    assert torch.all(vals[n:] == 0)  # padding quantizes to 0


def test_int4_packing_explicit():
    x = torch.tensor([1.0, -1.0, 7.0, -7.0, 0.0, 3.0, -2.0, 5.0])
    q = quant.quantize(x, 4, 8, backend="torch")
    assert q.scales.tolist() == [1.0]
    # pairs (1,-1) (7,-7) (0,3) (-2,5): low nibble first, -1 -> 0xF, -7 -> 0x9, -2 -> 0xE
    assert q.data.tolist() == [0xF1, 0x97, 0x30, 0x5E]
    assert torch.equal(quant.dequantize(q, backend="torch"), x)


def test_int2_packing_explicit():
    """Ternary values (qmax 1) with a step of half the largest: scale = max|x| / 2,
    q = round(clamp(x / scale, -1, 1)) in {-1, 0, 1}: cut at max|x| / 4, clipped above max|x| / 2."""
    x = torch.tensor([4.0, -4.0, 0.9, 1.1, -2.2, 0.0, 1.0, -0.9])
    q = quant.quantize(x, 2, 8, backend="torch")
    assert q.scales.tolist() == [2.0]
    # (1, -1, 0, 1) -> 0b01_00_11_01, (-1, 0, 0, 0): 1.0 / 2 ties to even (0), -0.9 / 2 -> 0
    assert q.data.tolist() == [0b01001101, 0b00000011]
    assert quant.dequantize(q, backend="torch").tolist() == [2.0, -2.0, 0.0, 2.0, -2.0, 0.0, 0.0, 0.0]


def test_int2_step_lowers_the_squared_error_of_a_gaussian_block():
    """Why INT2's step is half the largest: on Gaussian blocks of 128 the squared error falls
    to well under half of a step of max|x|'s (the clipped elements are few)."""
    x = torch.randn(128 * 512, generator=torch.Generator().manual_seed(0))
    err = (x - quant.dequantize(quant.quantize(x, 2, 128, backend="torch"), backend="torch")).pow(2).mean()
    xb = x.view(-1, 128)
    amax = xb.abs().amax(1, keepdim=True)
    full_step = (xb - torch.where(xb.abs() > amax / 2, amax * xb.sign(), 0.0)).pow(2).mean()
    assert err < 0.5 * full_step, (err, full_step)


def test_int8_explicit_and_rounding():
    x = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.4, -127.0])
    q = quant.quantize(x, 8, 8, backend="torch")
    assert q.scales.tolist() == [1.0]
    assert q.data[:6].tolist() == [127, 0, 2, -2, 63, -127]  # ties to even
    assert q.data[6:].tolist() == [0, 0]


# ---------------------------------------------------------------------------------------
# error bound

def _check_bound(x, q):
    deq = quant.dequantize(q, torch.float32, backend="torch")
    assert deq.shape == (x.numel(),) and deq.dtype == torch.float32
    bs, n = q.block_size, x.numel()
    per_elem_scale = q.scales.repeat_interleave(bs)[:n].double()
    err = (x.double() - deq.double()).abs()
    amax = (per_elem_scale * SCALE_DIV[q.bits])
    slack = amax * 2 ** -21  # a few fp32 ulps of the block's max
    bound = per_elem_scale * ERROR_STEPS[q.bits]   # half a step (INT2: a step, it clips)
    assert torch.all(err <= bound + slack), (err - bound).max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES)
def test_half_step_error_bound(dtype, bits, n):
    x = _rand(n, dtype, seed=1000 + n)
    q = quant.quantize(x, bits, backend="torch")
    assert q.block_size == DEFAULT_BLOCK_SIZE[bits]
    _check_bound(x, q)
    # dequantize to another dtype == fp32 dequantize then cast
    for out in DTYPES:
        assert torch.equal(quant.dequantize(q, out, backend="torch"),
                           quant.dequantize(q, torch.float32, backend="torch").to(out))


@pytest.mark.parametrize("bits", BITS)
def test_all_zero_blocks(bits):
    x = torch.zeros(300)
    x[140:150] = torch.randn(10)  # block 1 (of 128-wide blocks) nonzero, 0 and 2 zero
    q = quant.quantize(x, bits, 128, backend="torch")
    assert q.scales[0] == 0 and q.scales[2] == 0 and q.scales[1] > 0
    deq = quant.dequantize(q, backend="torch")
    assert torch.isfinite(deq).all()
    assert torch.all(deq[:128] == 0) and torch.all(deq[256:] == 0)
    assert torch.all(quant.dequantize(quant.quantize(torch.zeros(5), bits, backend="torch")) == 0)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_propagates_to_scale(bits, bad):
    x = torch.randn(300)
    x[130] = bad
    q = quant.quantize(x, bits, 128, backend="torch")
    assert torch.isfinite(q.scales[0]) and torch.isfinite(q.scales[2])
    if math.isnan(bad):
        assert torch.isnan(q.scales[1])
    else:
        assert q.scales[1] == float("inf")
    deq = quant.dequantize(q, backend="torch")
    assert torch.isnan(deq[128:256]).all()  # never silently clamped to a finite value
    assert torch.isfinite(deq[:128]).all() and torch.isfinite(deq[256:]).all()
    # and it survives the qgZ middle hop
    r = quant.dequantize_reduce_requantize([q, quant.quantize(torch.randn(300), bits, 128)], 4)
    assert not torch.isfinite(r.scales[1]) and torch.isfinite(r.scales[0])


# ---------------------------------------------------------------------------------------
# reduce hops

@pytest.mark.parametrize("bits_in,bits_out", [(4, 4), (8, 4), (4, 8), (8, 8), (4, 2), (2, 2), (2, 4)])
@pytest.mark.parametrize("n", [7, 129, 1000])
def test_dequantize_reduce_requantize(bits_in, bits_out, n):
    k = 3
    parts = [quant.quantize(_rand(n, torch.float32, seed=s), bits_in, backend="torch") for s in range(k)]
    summed = sum(quant.dequantize(p, backend="torch") for p in parts)  # sequential, fp32
    expect = quant.quantize(summed, bits_out, parts[0].block_size, backend="torch")
    got = quant.dequantize_reduce_requantize(parts, bits_out, backend="torch")
    assert torch.equal(got.data, expect.data) and torch.equal(got.scales, expect.scales)
    _check_bound(summed, got)
    # stacked input (e.g. an all-to-all receive buffer) gives the same result
    got2 = quant.dequantize_reduce_requantize(Quantized.stack(parts), bits_out, backend="torch")
    assert torch.equal(got2.data, got.data) and torch.equal(got2.scales, got.scales)
    # different output block size
    got3 = quant.dequantize_reduce_requantize(parts, bits_out, 64, backend="torch")
    _check_bound(summed, got3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_reduce(dtype):
    n, k = 1000, 4
    parts = [quant.quantize(_rand(n, torch.float32, seed=s), 4, backend="torch") for s in range(k)]
    summed = sum(quant.dequantize(p, backend="torch") for p in parts)
    got = quant.dequantize_reduce(parts, dtype, scale=1 / k, backend="torch")
    assert got.dtype == dtype and got.shape == (n,)
    assert torch.equal(got, (summed * torch.tensor(1 / k)).to(dtype))


@pytest.mark.parametrize("bits, bs", [(8, 256), (4, 128), (4, 6), (2, 128), (2, 12)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_torch_path_equals_one_pass_and_writes_into_out(monkeypatch, bits, bs, dtype):
    """The torch path works chunk by chunk (bounded temporaries); chunk boundaries, a
    padded last block and `out=` give the same bits as one pass over the whole tensor."""
    n, k = 3 * torch_quant._CHUNK + bs // 2 + 1, 3
    xs = [_rand(n, dtype, seed=s) for s in range(k)]

    def everything():
        parts = [quant.quantize(x, bits, bs, backend="torch") for x in xs]
        st = Quantized.stack(parts)
        outs = (torch.empty(k, n, dtype=dtype), torch.empty(n, dtype=dtype))
        quant.dequantize(st, dtype, backend="torch", out=outs[0])
        quant.dequantize_reduce(st, dtype, scale=1 / k, backend="torch", out=outs[1])
        drr = quant.dequantize_reduce_requantize(st, bits, bs, backend="torch")
        return [p.data for p in parts] + [p.scales for p in parts] + list(outs) + [drr.data, drr.scales,
                quant.dequantize(st, dtype, backend="torch")]

    chunked = everything()
    monkeypatch.setattr(torch_quant, "_CHUNK", 1 << 30)
    monkeypatch.setattr(torch_quant, "_STACKED_CHUNK", 1 << 30)
    monkeypatch.setattr(torch_quant, "_SCRATCH", threading.local())   # the whole-tensor slots die with the test
    whole = everything()
    for a, b in zip(chunked, whole):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [2, 16, 64])
def test_scratch_stays_within_its_bound_and_strided_packing_gives_the_same_bits(monkeypatch, rows):
    """The torch path keeps its chunk temporaries for reuse; with many stacked rows (ranks)
    they stay within scratch_bound (which the engine reports), and the int16 (un)packing of
    INT4 equals the plain strided one (kept for big-endian hosts)."""
    monkeypatch.setattr(torch_quant, "_SCRATCH", threading.local())
    n = torch_quant._CHUNK // 2 + 77
    xs = torch.randn(rows, n, dtype=torch.bfloat16)

    def everything():
        st = Quantized.stack([quant.quantize(x, 4, 128, backend="torch") for x in xs])
        w = Quantized.stack([quant.quantize(x, 8, 256, backend="torch") for x in xs])
        return [st.data, st.scales, quant.dequantize(w, torch.bfloat16, backend="torch"),
                quant.dequantize(st, torch.bfloat16, backend="torch"),
                quant.dequantize_reduce(st, torch.float32, 1 / rows, backend="torch"),
                quant.dequantize_reduce_requantize(st, 4, 128, backend="torch").data]

    fast = everything()
    held = quant.scratch_bytes("cpu")
    assert 0 < held <= quant.scratch_bound(256, rows)
    monkeypatch.setattr(torch_quant, "_LITTLE_ENDIAN", False)
    for a, b in zip(fast, everything()):
        assert torch.equal(a, b)


def _rows_into_wire(backend, bits, bs, rows, n, device="cpu"):
    """`rows` tensors of n elements quantized one by one into their rows of one wire buffer
    (Quantized.row over from_bytes), as qgZ fills its first hop."""
    xs = [_rand(n, torch.bfloat16, seed=10 + r).to(device) for r in range(rows)]
    padded = -(-n // bs) * bs
    buf = torch.full((quant.wire_nbytes(rows * padded, bits, bs),), 0xAB, dtype=torch.uint8, device=device)
    wire = Quantized.from_bytes(buf, rows * padded, bits, bs)
    for r, x in enumerate(xs):
        got = quant.quantize(x, bits, bs, backend=backend, out=wire.row(r, n))
        assert got.data.data_ptr() == wire.row(r, n).data.data_ptr()   # written in place, no copy
    return xs, buf.cpu(), wire


@pytest.mark.parametrize("bits, bs", [(8, 256), (4, 128), (4, 6), (2, 128)])
def test_quantize_into_wire_rows_equals_quantizing_the_padded_rows(bits, bs):
    rows, n = 3, 1000
    xs, buf, wire = _rows_into_wire("torch", bits, bs, rows, n)
    padded = -(-n // bs) * bs
    slots = torch.zeros(rows, padded, dtype=torch.bfloat16)
    for r, x in enumerate(xs):
        slots[r, :n] = x
    assert torch.equal(buf, quant.quantize(slots.view(-1), bits, bs, backend="torch").to_bytes())
    # the middle hop's sum of row 1 over two stacked copies, straight into another wire buffer
    two = Quantized.from_bytes(torch.stack([buf, buf]), rows * padded, bits, bs).row(1, n)
    dest = Quantized.from_bytes(torch.empty(quant.wire_nbytes(n, bits, bs), dtype=torch.uint8), n, bits, bs)
    quant.dequantize_reduce_requantize(two, bits, bs, backend="torch", out=dest)
    want = quant.dequantize_reduce_requantize(Quantized.stack([wire.row(1, n)] * 2), bits, bs, backend="torch")
    assert torch.equal(dest.data, want.data) and torch.equal(dest.scales, want.scales)


def test_quantize_refuses_an_out_that_does_not_fit():
    x = torch.randn(1000)
    for bad in (Quantized.empty(999, 8, 256, "cpu"), Quantized.empty(1000, 4, 256, "cpu"),
                Quantized.empty(1000, 8, 128, "cpu")):
        with pytest.raises(ValueError, match="out does not hold 1000 elements"):
            quant.quantize(x, 8, 256, backend="torch", out=bad)


def test_dequantize_out_must_fit():
    q = quant.quantize(torch.randn(100), 8, backend="torch")
    with pytest.raises(ValueError, match="out must be contiguous"):
        quant.dequantize(q, torch.float32, backend="torch", out=torch.empty(99))
    with pytest.raises(ValueError, match="out must be contiguous"):
        quant.dequantize_reduce([q, q], torch.bfloat16, backend="torch", out=torch.empty(100))


# ---------------------------------------------------------------------------------------
# wire format

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 129, 1000])
def test_to_from_bytes(bits, n):
    q = quant.quantize(_rand(n, torch.bfloat16), bits, backend="torch")
    buf = q.to_bytes()
    assert buf.dtype == torch.uint8 and buf.shape == (q.nbytes(),) == (quant.wire_nbytes(n, bits),)
    r = Quantized.from_bytes(buf, n, bits)
    assert torch.equal(r.data, q.data) and torch.equal(r.scales, q.scales) and r.data.dtype == q.data.dtype
    # stacked: k buffers in one [k, nbytes] tensor
    parts = [quant.quantize(_rand(n, torch.float32, seed=s), bits, backend="torch") for s in range(3)]
    st = Quantized.from_bytes(torch.stack([p.to_bytes() for p in parts]), n, bits)
    assert len(st) == 3 and torch.equal(st.to_bytes(), torch.stack([p.to_bytes() for p in parts]))
    for i in range(3):
        assert torch.equal(st[i].data, parts[i].data) and torch.equal(st[i].scales, parts[i].scales)
    with pytest.raises(ValueError):
        Quantized.from_bytes(buf[:-1], n, bits)


def test_bad_args():
    with pytest.raises(ValueError):
        quant.quantize(torch.randn(10), 3)
    with pytest.raises(ValueError):
        quant.quantize(torch.randn(10), 4, 7)
    with pytest.raises(TypeError):
        quant.quantize(torch.arange(10), 8)


# ---------------------------------------------------------------------------------------
# Triton kernels == torch path, bit for bit

qt = None
_TRITON_SKIP = None
try:
    from zeropp.kernels import triton_quant as qt
    from triton.runtime.interpreter import InterpretedFunction

    if not _CUDA and not isinstance(qt._quantize_kernel, InterpretedFunction):
        _TRITON_SKIP = "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)"
except ImportError as e:  # triton not installed
    _TRITON_SKIP = f"triton not importable: {e}"

needs_triton = pytest.mark.skipif(_TRITON_SKIP is not None, reason=str(_TRITON_SKIP))
_DEV = "cuda" if _CUDA else "cpu"


def _same(a: Quantized, b: Quantized):
    assert (a.numel, a.bits, a.block_size) == (b.numel, b.bits, b.block_size)
    assert a.data.dtype == b.data.dtype
    assert torch.equal(a.data.cpu(), b.data.cpu())
    # compare scale bits (NaN == NaN)
    assert torch.equal(a.scales.cpu().view(torch.int32), b.scales.cpu().view(torch.int32))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES)
def test_triton_quantize_dequantize(dtype, bits, n):
    x = _rand(n, dtype, seed=7 + n)
    x[n // 2] = 0.0
    bs = 64  # small blocks: several programs even for small n
    ref = quant.quantize(x, bits, bs, backend="torch")
    got = qt.quantize(x.to(_DEV), bits, bs)
    _same(ref, got)
    for out in (torch.float32, dtype):
        d = qt.dequantize(got, out)
        assert d.dtype == out and d.shape == (n,)
        assert torch.equal(d.cpu(), quant.dequantize(ref, out, backend="torch"))


@needs_triton
@pytest.mark.parametrize("bits", BITS)
def test_triton_special_values(bits):
    x = torch.randn(320)
    x[:64] = 0.0              # all-zero block
    x[70] = float("inf")      # block 1
    x[140] = float("-inf")    # block 2
    x[200] = float("nan")     # block 3
    ref = quant.quantize(x, bits, 64, backend="torch")
    got = qt.quantize(x.to(_DEV), bits, 64)
    _same(ref, got)
    assert ref.scales[0] == 0 and torch.isinf(ref.scales[1:3]).all() and torch.isnan(ref.scales[3])
    a = qt.dequantize(got, torch.float32).cpu()
    b = quant.dequantize(ref, backend="torch")
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())
    a16 = qt.dequantize(got, torch.bfloat16).cpu()
    assert torch.equal(torch.isnan(a16), torch.isnan(b)) and torch.all(a16[:64] == 0)


@needs_triton
@pytest.mark.parametrize("bits, bs", [(8, 256), (4, 128), (2, 128)])
def test_triton_quantizes_into_wire_rows_as_torch(bits, bs):
    _, buf_triton, _ = _rows_into_wire("triton", bits, bs, 3, 1000, _DEV)
    _, buf_torch, _ = _rows_into_wire("torch", bits, bs, 3, 1000)
    assert torch.equal(buf_triton, buf_torch)
    # the middle hop into a wire buffer, from row 1 of two stacked (strided) copies
    padded = -(-1000 // bs) * bs
    sums = []
    for backend, dev in (("triton", _DEV), ("torch", "cpu")):
        two = Quantized.from_bytes(torch.stack([buf_torch, buf_torch]).to(dev), 3 * padded, bits, bs).row(1, 1000)
        dest = torch.zeros(quant.wire_nbytes(1000, 4, bs), dtype=torch.uint8, device=dev)
        quant.dequantize_reduce_requantize(two, 4, bs, backend=backend, out=Quantized.from_bytes(dest, 1000, 4, bs))
        sums.append(dest.cpu())
    assert torch.equal(*sums)


@needs_triton
@pytest.mark.parametrize("bits_in,bits_out", [(4, 4), (8, 4), (4, 8), (8, 8), (4, 2), (2, 2), (2, 4)])
@pytest.mark.parametrize("n", [1, 7, 129, 1000])
def test_triton_dequantize_reduce_requantize(bits_in, bits_out, n):
    parts = [quant.quantize(_rand(n, torch.float32, seed=s), bits_in, 64, backend="torch") for s in range(3)]
    ref = quant.dequantize_reduce_requantize(parts, bits_out, backend="torch")
    st = Quantized.stack(parts)
    st = Quantized(st.data.to(_DEV), st.scales.to(_DEV), st.numel, st.bits, st.block_size)
    _same(ref, qt.dequantize_reduce_requantize(st, bits_out))
    # a [k, nbytes] receive buffer (strided views of data/scales) works too
    wire = Quantized.from_bytes(torch.stack([p.to_bytes() for p in parts]).to(_DEV), n, bits_in, 64)
    _same(ref, qt.dequantize_reduce_requantize(wire, bits_out))
    for dtype in DTYPES:
        a = qt.dequantize_reduce(st, dtype, 1 / 3).cpu()
        assert torch.equal(a, quant.dequantize_reduce(parts, dtype, 1 / 3, backend="torch"))


@needs_triton
def test_dispatch_auto_uses_torch_on_cpu(monkeypatch):
    called = []
    monkeypatch.setattr(qt, "quantize", lambda *a, **k: called.append(1))
    quant.quantize(torch.randn(10), 8)  # cpu tensor, backend auto -> torch
    assert not called
    quant.quantize(torch.randn(10), 8, backend="triton")
    assert called
