"""Throughput of the quantization API (zeropp.kernels.quant) against a plain copy of the same bytes.

GB/s counts the bytes of the *input* tensor (fp32/bf16 elements for quantize, the same
element count in the output dtype for dequantize, the k stacked parts' element count in
fp32 for the fused dequantize-reduce-requantize of qgZ's middle hop); the baseline is
``dst.copy_(src)`` of the input's bytes on the same device.  On CPU the torch path and the
compiled CPU kernels (zeropp.kernels.cpu_quant) run, one thread (as each rank of a CPU job); on
CUDA both the torch path and the Triton kernels, so the table shows the kernels against
the device's copy bandwidth.  Writes a table to stdout and JSON (default
bench/results/quant_bench.json, or quant_bench_cuda.json on CUDA).

    python -m bench.quant_bench [--device cuda] [--numel 16777216] [--repeats 5]
"""
import argparse
import json
import os
import time

import torch

from bench import cpu_model
from zeropp.kernels import quant, cpu_quant


def _time(fn, repeats, device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()  # warm-up (and Triton compilation)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--parts", type=int, default=4, help="k parts in the fused reduce (qgZ's ranks per node)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda":
        backends = ["torch", "triton"] if quant.triton_available() else ["torch"]
    else:
        torch.set_num_threads(1)
        backends = ["torch", "cpu"] if cpu_quant.available() else ["torch"]
    out = a.out or os.path.join(os.path.dirname(__file__), "results",
                                "quant_bench.json" if device.type == "cpu" else f"quant_bench_{device.type}.json")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(a.numel, device=device).to(dtype)
        nbytes = x.numel() * x.element_size()
        dst = torch.empty_like(x)
        t_copy = _time(lambda: dst.copy_(x), a.repeats, device)
        for bits in (8, 4):
            for backend in backends:
                q = quant.quantize(x, bits, backend=backend)
                t_q = _time(lambda: quant.quantize(x, bits, backend=backend), a.repeats, device)
                t_d = _time(lambda: quant.dequantize(q, dtype, backend=backend), a.repeats, device)
                row = dict(dtype=str(dtype).replace("torch.", ""), bits=bits, backend=backend,
                           block_size=q.block_size, numel=a.numel, input_bytes=nbytes, wire_bytes=q.nbytes(),
                           copy_GBps=nbytes / t_copy / 1e9, quantize_GBps=nbytes / t_q / 1e9,
                           dequantize_GBps=nbytes / t_d / 1e9, fused_GBps=None)
                if bits == 4:  # qgZ's middle hop: k parts in, one requantized part out
                    parts = quant.Quantized.stack([q] * a.parts)
                    t_f = _time(lambda: quant.dequantize_reduce_requantize(parts, 4, backend=backend),
                                a.repeats, device)
                    row["fused_GBps"] = a.parts * a.numel * 4 / t_f / 1e9
                rows.append(row)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"{cpu_model()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"device {device} ({name}), "
          f"{a.numel} elements; GB/s of input bytes; copy = dst.copy_(src) of the same bytes")
    print(f"{'dtype':9} {'bits':>4} {'backend':>7} {'block':>5} {'wire/in':>7} {'copy GB/s':>10} "
          f"{'quant GB/s':>10} {'dequant GB/s':>12} {'fused dqrq GB/s':>15}")
    for r in rows:
        fused = f"{r['fused_GBps']:15.2f}" if r["fused_GBps"] else f"{'-':>15}"
        print(f"{r['dtype']:9} {r['bits']:4d} {r['backend']:>7} {r['block_size']:5d} "
              f"{r['wire_bytes'] / r['input_bytes']:7.3f} {r['copy_GBps']:10.2f} {r['quantize_GBps']:10.2f} "
              f"{r['dequantize_GBps']:12.2f} {fused}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=str(device), device_name=name, torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
