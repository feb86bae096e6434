"""This machine's rates for the planner, measured at start-up on every rank (planner/auto.py).

    m = measure(model_cfg, dtype, device, micro_batch, seq_length, topology)

- links: parallel.link_probe.probe_links (bandwidth and latency between and inside nodes);
- compute: forward + backward of one transformer block of the real config (model.gpt.Block,
  real tensors, the compute dtype, dropout as configured), FLOP/s by Megatron's count for one
  layer, 72 B s h^2 (1 + s/6h) (model.flops_per_iteration without the logits). If the real
  micro-batch would take more than COMPUTE_S (a pilot matmul tells), fewer sequences, then
  shorter ones, are timed: the rate, not the step, is what is measured. The fastest of
  REPEATS runs counts (the least disturbed by other work on the machine), as for quantization;
- quantization: zeropp.quant.quantize + dequantize of QUANT_ELEMENTS elements of the compute
  dtype, INT8 with the qwZ block and INT4 with the qgZ block (elements/s through one kernel);
- the optimizer step: AdamW's update of one fp32 tensor (16 bytes per element, as the planner
  counts it).
All ranks measure at once (ranks sharing a machine share its cores, as in training) and every
time is all-reduced with MAX, so every rank gets the same figures. About 1 s in all on CPU ranks.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from model.gpt import Block, GPTConfig
from parallel.link_probe import LinkMeasurement, max_over_ranks, probe_links, start_together
from parallel.topology import Topology
from zeropp.quant import dequantize, quantize

COMPUTE_S = 0.1             # the most one timed forward + backward of a block may take
REPEATS = 3                 # timed runs of the block (the quantizers: 2); the fastest counts
QUANT_ELEMENTS = 2**22         # past the caches, as a bucket is
OPTIMIZER_ELEMENTS = 2**20


@dataclass(frozen=True)
class Measurements:
    links: LinkMeasurement
    flops_per_s: float          # the model's compute rate in its dtype, per rank
    int8_elements_per_s: float  # through one INT8 quantize or dequantize
    int4_elements_per_s: float
    optimizer_bytes_per_s: float
    seconds: float              # the whole probe's wall time (the slowest rank's)
    phase_seconds: dict = field(default_factory=dict)   # where that time went

    def timing(self) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in self.phase_seconds.items())

    def summary(self) -> str:
        return (f"compute {self.flops_per_s / 1e9:.3g} GFLOP/s per rank; (de)quantization "
                f"{self.int8_elements_per_s / 1e6:.0f} M elements/s INT8, {self.int4_elements_per_s / 1e6:.0f} "
                f"INT4; optimizer {self.optimizer_bytes_per_s / 1e9:.3g} GB/s")


def measure(cfg: GPTConfig, dtype: torch.dtype, device: torch.device, micro_batch: int, seq_length: int,
            topology: Topology, qw_block: int = 256, qg_block: int = 128, timeout_s: float = 30.0) -> Measurements:
    """Links, compute, quantization and optimizer rates (module docstring); collective on every rank."""
    marks = [time.perf_counter()]
    links = probe_links(topology, device, timeout_s)
    marks.append(time.perf_counter())
    sync = functools.partial(start_together, device, timeout_s)   # each timing runs on all ranks at once
    flops, block_s = _block_rate(cfg, dtype, device, micro_batch, seq_length, sync)
    marks.append(time.perf_counter())
    q8, q4 = _quant_times(dtype, device, qw_block, qg_block, sync)
    opt_s = _optimizer_time(device, sync)
    marks.append(time.perf_counter())
    spans = [b - a for a, b in zip(marks, marks[1:])] + [marks[-1] - marks[0]]
    block_s, q8, q4, opt_s, *spans = max_over_ranks([block_s, q8, q4, opt_s, *spans], device, timeout_s,
                                                    "compute timings")
    return Measurements(links, flops / block_s, QUANT_ELEMENTS / q8, QUANT_ELEMENTS / q4,
                        16 * OPTIMIZER_ELEMENTS / opt_s, spans[-1],
                        dict(zip(("links", "compute", "quantization and optimizer"), spans)))


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_flops(cfg: GPTConfig, batch: int, seq: int) -> float:
    """Megatron's forward + backward FLOPs of one transformer layer (no recomputation)."""
    h = cfg.hidden_size
    return 72 * batch * seq * h * h * (1 + seq / (6 * h))


def _block_rate(cfg: GPTConfig, dtype, device, micro_batch: int, seq_length: int, sync) -> tuple[float, float]:
    """(FLOPs timed, seconds) of one block's forward + backward."""
    h = cfg.hidden_size
    a = torch.randn(256, h, dtype=dtype, device=device)
    w = torch.randn(h, h, dtype=dtype, device=device)
    fastest = float("inf")
    for _ in range(3):   # the first call pays the library's set-up
        _sync(device)
        t0 = time.perf_counter()
        a @ w  # noqa: B018
        _sync(device)
        fastest = min(fastest, time.perf_counter() - t0)
    guess = 2 * 256 * h * h / max(fastest, 1e-9)   # FLOP/s of a plain matmul
    batch, seq = micro_batch, seq_length
    while block_flops(cfg, batch, seq) / guess > COMPUTE_S and (batch > 1 or seq > 16):
        batch, seq = (batch // 2, seq) if batch > 1 else (batch, max(16, seq // 2))
    torch.manual_seed(0)
    block = Block(cfg).to(device=device, dtype=dtype).train()
    x = torch.randn(batch, seq, h, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    times = []
    for _ in range(1 + REPEATS):   # the first pays allocation and kernel selection
        _sync(device)
        sync()
        t0 = time.perf_counter()
        block(x).backward(grad)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return block_flops(cfg, batch, seq), min(times[1:])   # the least disturbed by other work


def _quant_times(dtype, device, qw_block: int, qg_block: int, sync) -> tuple[float, float]:
    """Seconds per QUANT_ELEMENTS through one INT8 and one INT4 (de)quantization (their mean)."""
    x = torch.randn(QUANT_ELEMENTS, device=device).to(dtype)
    out = []
    for bits, block in ((8, qw_block), (4, qg_block)):
        dequantize(quantize(x[:4096], bits, block), dtype)   # warm-up (Triton compiles here on CUDA)
        times = []
        for _ in range(2):
            _sync(device)
            sync()
            t0 = time.perf_counter()
            dequantize(quantize(x, bits, block), dtype)
            _sync(device)
            times.append((time.perf_counter() - t0) / 2)
        out.append(min(times))
    return out[0], out[1]


def _optimizer_time(device, sync) -> float:
    """One AdamW update of OPTIMIZER_ELEMENTS fp32 elements, written out as torch's single-tensor
    AdamW does it (building a torch.optim optimizer costs a second of imports the first time)."""
    p, g, m, v = (torch.randn(OPTIMIZER_ELEMENTS, device=device) for _ in range(4))
    v.abs_()
    for _ in range(2):   # the first pays allocation
        _sync(device)
        sync()
        t0 = time.perf_counter()
        p.mul_(1 - 1e-6)
        m.lerp_(g, 0.1)
        v.mul_(0.95).addcmul_(g, g, value=0.05)
        p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-4)
        _sync(device)
        seconds = time.perf_counter() - t0
    return seconds


__all__ = ["Measurements", "block_flops", "measure"]
