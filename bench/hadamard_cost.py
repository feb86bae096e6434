"""Host cost of qgZ's Hadamard smoothing (`zero_hadamard_gradients`, zeropp/kernels/hadamard.py)
against the INT4 quantization it precedes, on this machine's CPU.

    .venv/bin/python -m bench.hadamard_cost            # ~2.5M fp32 elements, blocks of 128
    .venv/bin/python -m bench.hadamard_cost --out bench/results/hadamard_host_cost.json

Times (median of --reps, after a warm-up) of the forward transform, the inverse, one INT4
quantization and one dequantization of the same tensor, all through the public API
(`backend="auto"`: on CPU the torch transform and the compiled quantizer when it builds),
at 1 thread and at torch's default thread count.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from zeropp.kernels.hadamard import hadamard
from zeropp.kernels import cpu_quant
from zeropp.kernels.quant import dequantize, quantize


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # no lscpu
        return platform.processor() or "unknown"


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(numel: int, block: int, reps: int) -> dict:
    x = torch.randn(numel)
    work = x.clone()
    q = quantize(x, 4, block)
    deq = torch.empty(numel)
    ops = {
        "hadamard_forward": lambda: hadamard(work, block),
        "hadamard_inverse": lambda: hadamard(work, block, inverse=True),
        "hadamard_forward_into_out": lambda: hadamard(x, block, out=work),
        "quantize_int4": lambda: quantize(x, 4, block, out=q),
        "dequantize_int4": lambda: dequantize(q, torch.float32, out=deq),
    }
    return {name: round(_median_ms(fn, reps), 3) for name, fn in ops.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=19532 * 128, help="elements (default 2,500,096)")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    default_threads = torch.get_num_threads()
    result = {"numel": a.numel, "block": a.block, "reps": a.reps, "cpu": _cpu_name(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "quant_backend": "cpu (compiled)" if cpu_quant.supports(a.block) else "torch",
              "ms": {}}
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        result["ms"][f"{threads}_threads"] = m = measure(a.numel, a.block, a.reps)
        m["forward_over_quantize"] = round(m["hadamard_forward"] / m["quantize_int4"], 2)
    torch.set_num_threads(default_threads)
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
