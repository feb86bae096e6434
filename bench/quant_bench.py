"""Throughput of the torch quantization path (zeropp.quant) on CPU vs a plain copy.

GB/s counts the bytes of the *input* tensor (fp32/bf16 elements for quantize, the same
element count in the output dtype for dequantize); the baseline is ``dst.copy_(src)`` of
that many bytes.  Writes a table to stdout and JSON to bench/results/quant_bench.json.

    python -m bench.quant_bench [--numel 16777216] [--repeats 5]
"""
import argparse
import json
import os
import time

import torch

from zeropp import quant


def _time(fn, repeats):
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quant_bench.json"))
    a = ap.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(a.numel).to(dtype)
        nbytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        t_copy = _time(lambda: dst.copy_(x), a.repeats)
        for bits in (8, 4):
            q = quant.quantize(x, bits, backend="torch")
            t_q = _time(lambda: quant.quantize(x, bits, backend="torch"), a.repeats)
            t_d = _time(lambda: quant.dequantize(q, dtype, backend="torch"), a.repeats)
            rows.append(dict(dtype=str(dtype).replace("torch.", ""), bits=bits, block_size=q.block_size,
                             numel=a.numel, input_bytes=nbytes, wire_bytes=q.nbytes(),
                             copy_GBps=nbytes / t_copy / 1e9, quantize_GBps=nbytes / t_q / 1e9,
                             dequantize_GBps=nbytes / t_d / 1e9))
    print(f"{'dtype':9} {'bits':>4} {'block':>5} {'wire/in':>7} {'copy GB/s':>10} {'quant GB/s':>10} {'dequant GB/s':>12}")
    for r in rows:
        print(f"{r['dtype']:9} {r['bits']:4d} {r['block_size']:5d} {r['wire_bytes'] / r['input_bytes']:7.3f} "
              f"{r['copy_GBps']:10.2f} {r['quantize_GBps']:10.2f} {r['dequantize_GBps']:12.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(device="cpu", torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
