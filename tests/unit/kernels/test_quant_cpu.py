"""zeropp.kernels.cpu_quant (the compiled CPU kernels) against the torch reference path: the same
bits for every dtype, size, block size and special value, and the build's behaviour when
there is no compiler or several ranks build at once."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zeropp.kernels import cache, quant, cpu_quant
from zeropp.kernels.quant import Quantized
from tests import REPO

SIZES = [1, 7, 127, 128, 129, 1000, 70001]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_kernels = pytest.mark.skipif(not cpu_quant.available(), reason=f"no CPU kernels: {cpu_quant.why_not()}")


def _rand(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * 2)   # blocks of other magnitudes
    return x.to(dtype)


def _same_bits(a, b):
    if isinstance(a, Quantized):
        assert (a.numel, a.bits, a.block_size, a.data.dtype) == (b.numel, b.bits, b.block_size, b.data.dtype)
        assert torch.equal(a.data, b.data)
        assert torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32))   # NaN == NaN
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bs", [2, 4, 64, 256])
def test_quantize_and_dequantize_give_the_torch_paths_bits(dtype, bits, n, bs):
    if bs * bits % 8:
        pytest.skip("INT2 blocks are whole bytes: 4 elements at least")
    x = _rand(n, dtype, seed=n + bs)
    x[n // 2] = 0.0
    ref = quant.quantize(x, bits, bs, backend="torch")
    got = quant.quantize(x, bits, bs, backend="cpu")
    _same_bits(ref, got)
    for out in DTYPES:
        _same_bits(quant.dequantize(ref, out, backend="torch"), quant.dequantize(got, out, backend="cpu"))


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(bits, dtype):
    x = torch.randn(64 * 6).to(dtype)
    x[:64] = 0.0                          # all-zero block: scale 0, exact zeros back
    x[70] = float("inf")                  # inf: scale inf, data 0
    x[140] = float("-inf")
    x[200] = float("nan")                 # NaN: scale NaN
    x[260], x[270] = float("nan"), float("inf")
    x[320:384] = 1e-40 if dtype == torch.float32 else 0.0   # subnormal: scale underflows to 0
    ref = quant.quantize(x, bits, 64, backend="torch")
    got = quant.quantize(x, bits, 64, backend="cpu")
    _same_bits(ref, got)
    assert got.scales[0] == 0 and torch.isinf(got.scales[1:3]).all() and torch.isnan(got.scales[3:5]).all()
    for out in DTYPES:
        a = quant.dequantize(got, out, backend="cpu")
        _same_bits(quant.dequantize(ref, out, backend="torch"), a)
        assert torch.all(a[:64] == 0) and torch.isnan(a[64:320]).all()


@needs_kernels
@pytest.mark.parametrize("bits_in,bits_out", [(4, 4), (8, 4), (4, 8), (8, 8), (4, 2), (2, 2), (2, 4)])
@pytest.mark.parametrize("n", [1, 129, 1000])
@pytest.mark.parametrize("k", [1, 3])
def test_reductions_give_the_torch_paths_bits(bits_in, bits_out, n, k):
    parts = [quant.quantize(_rand(n, torch.float32, seed=s), bits_in, 64, backend="torch") for s in range(k)]
    ref = quant.dequantize_reduce_requantize(parts, bits_out, backend="torch")
    _same_bits(ref, quant.dequantize_reduce_requantize(parts, bits_out, backend="cpu"))
    # a [k, nbytes] receive buffer: strided views of data and scales
    wire = Quantized.from_bytes(torch.stack([p.to_bytes() for p in parts]), n, bits_in, 64)
    _same_bits(ref, quant.dequantize_reduce_requantize(wire, bits_out, backend="cpu"))
    for dtype in DTYPES:
        for scale in (1.0, 0.25, 1 / 3):
            _same_bits(quant.dequantize_reduce(parts, dtype, scale, backend="torch"),
                       quant.dequantize_reduce(wire, dtype, scale, backend="cpu"))
        _same_bits(quant.dequantize(Quantized.stack(parts), dtype, backend="torch"),
                   quant.dequantize(wire, dtype, backend="cpu"))


@needs_kernels
def test_into_wire_rows_and_the_middle_hop_from_strided_rows():
    bits, bs, rows, n = 4, 128, 3, 1000
    padded = -(-n // bs) * bs
    bufs = {}
    for backend in ("torch", "cpu"):
        buf = torch.full((quant.wire_nbytes(rows * padded, bits, bs),), 0xAB, dtype=torch.uint8)
        wire = Quantized.from_bytes(buf, rows * padded, bits, bs)
        for r in range(rows):
            got = quant.quantize(_rand(n, torch.bfloat16, r), bits, bs, backend=backend, out=wire.row(r, n))
            assert got.data.data_ptr() == wire.row(r, n).data.data_ptr()   # in place
        two = Quantized.from_bytes(torch.stack([buf, buf]), rows * padded, bits, bs).row(1, n)
        dest = torch.zeros(quant.wire_nbytes(n, bits, bs), dtype=torch.uint8)
        quant.dequantize_reduce_requantize(two, bits, bs, backend=backend, out=Quantized.from_bytes(dest, n, bits, bs))
        bufs[backend] = (buf, dest)
    assert torch.equal(bufs["torch"][0], bufs["cpu"][0]) and torch.equal(bufs["torch"][1], bufs["cpu"][1])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 129, 1000])
def test_dequantize_add_gives_the_torch_paths_bits_on_strided_rows(dtype, n):
    """out += dequantize(q) (INT4 weight deltas' receivers): the rows of q are strided views of
    a receive buffer, the rows of out every other row of a weight; the sum is the fp32 sum
    rounded once, as a 16-bit out.add_(fp32) gives it."""
    k, bs = 3, 64
    parts = [quant.quantize(_rand(n, torch.float32, seed=s) * 1e-2, 4, bs, backend="torch") for s in range(k)]
    parts[1].scales[0] = float("nan")     # a non-finite block stays NaN in the sum
    wire = Quantized.from_bytes(torch.stack([p.to_bytes() for p in parts]), n, 4, bs)
    base = _rand(2 * k * n, dtype, seed=99).view(k, 2, n)
    results = {}
    for backend in ("torch", "cpu"):
        out = base.clone()
        got = quant.dequantize_add(wire, out[:, 1], backend=backend)
        assert got.data_ptr() == out[:, 1].data_ptr() and torch.equal(out[:, 0], base[:, 0])   # only its rows
        results[backend] = out
    _same_bits(results["torch"], results["cpu"])
    expect = base.clone()
    expect[:, 1].add_(quant.dequantize(Quantized.stack(parts), torch.float32, backend="torch"))
    _same_bits(expect, results["cpu"])
    short = base[0, 0, :n - 1].clone()    # one part's first n - 1 elements (a weight's last, short chunk)
    quant.dequantize_add(parts[0].row(0, n - 1), short, backend="cpu")
    _same_bits(base[0, 0, :n - 1].clone().add_(quant.dequantize(parts[0], torch.float32)[:n - 1]), short)
    with pytest.raises(ValueError, match="dequantize_add: out must have shape"):
        quant.dequantize_add(wire, base[:, 1, :n - 1])


@needs_kernels
def test_auto_uses_the_kernels_on_cpu_unless_told_otherwise(monkeypatch):
    calls = []
    real = cpu_quant.quantize
    monkeypatch.setattr(cpu_quant, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    quant.quantize(torch.randn(300), 8)
    assert calls == [1]
    quant.quantize(torch.randn(300, dtype=torch.float64), 8)   # not a kernel dtype: torch path
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")
    quant.quantize(torch.randn(300), 8)
    assert calls == [1]
    with pytest.raises(ValueError, match="at most"):
        quant.quantize(torch.randn(300), 8, 8192, backend="cpu")
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "fast")
    with pytest.raises(ValueError, match="ZEROPP_QUANT_BACKEND='fast': use torch, cpu or triton"):
        quant.quantize(torch.randn(300), 8)


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=str(REPO), timeout=300)


def test_no_compiler_says_so_once_and_uses_the_torch_path(tmp_path):
    res = _python("""
        import warnings, torch
        from zeropp.kernels import quant, cpu_quant
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            x = torch.randn(1000)
            a = quant.quantize(x, 4)
            quant.quantize(x, 4)
        assert not cpu_quant.available()
        assert len(w) == 1 and "could not be built" in str(w[0].message), [str(m.message) for m in w]
        assert torch.equal(a.data, quant.quantize(x, 4, backend="torch").data)
        try:
            quant.quantize(x, 4, backend="cpu")
        except RuntimeError as e:
            print("refused:", e)
        """, {"CC": "false", "ZEROPP_CACHE_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert "refused: backend='cpu': the CPU quantization kernels could not be built" in res.stdout
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.slow
@needs_kernels
def test_ranks_building_at_once_build_one_library(tmp_path):
    code = """
        import torch
        from zeropp.kernels import cpu_quant, quant
        assert cpu_quant.available(), cpu_quant.why_not()
        x = torch.randn(5000)
        assert torch.equal(quant.quantize(x, 8, backend="cpu").data, quant.quantize(x, 8, backend="torch").data)
        """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, "ZEROPP_CACHE_DIR": str(tmp_path)},
                              cwd=str(REPO), stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    assert len(list(tmp_path.glob("*.so"))) == 1 and not list(tmp_path.glob("*.tmp"))


def test_the_cache_key_follows_the_source_the_flags_and_the_processor(monkeypatch, tmp_path):
    def key(source=cpu_quant._KERNELS.source, flags=cache.Kernels.FLAGS):
        return cache.key_of(cache.key_inputs(source, flags, "true"))
    a = key()
    edited = tmp_path / "quant_cpu.c"
    edited.write_bytes(cpu_quant._KERNELS.source.read_bytes() + b"\n")
    assert key(source=edited) != a and key(flags=cache.Kernels.FLAGS[1:]) != a and key() == a
    monkeypatch.setattr(cache, "cpu_features", lambda: "flags: another processor")
    assert key() != a
