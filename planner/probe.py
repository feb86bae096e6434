"""This machine's rates for the planner, measured at start-up on every rank (planner/auto.py).

    m = measure(model_cfg, dtype, device, micro_batch, seq_length, topology)

- links: parallel.link_probe.probe_links (bandwidth and latency between and inside nodes);
- compute: forward + backward of one transformer block of the real config (model.gpt.Block,
  real tensors, the compute dtype, dropout as configured), FLOP/s by Megatron's count for one
  layer, 72 B s h^2 (1 + s/6h) (model.flops_per_iteration without the logits). If the real
  micro-batch would take more than COMPUTE_S (a pilot run of one short sequence tells), fewer
  sequences, then shorter ones, are timed: the rate, not the step, is what is measured. The
  fastest of REPEATS runs counts (the least disturbed by other work), as for quantization;
- quantization: the engine's own zeropp.kernels.quant calls for one qwZ gather and one qgZ reduction
  of about QUANT_ELEMENTS elements in the compute dtype (qwZ's and qgZ's block sizes), as
  elements/s in the planner's count of elements through the kernels (planner/comm.py);
- the optimizer step: AdamW's update of one fp32 tensor (16 bytes per element, as the planner
  counts it).
All ranks measure at once (ranks sharing a machine share its cores, as in training) and every
time is all-reduced with MAX, so every rank gets the same figures. About 1 s in all on idle CPU
ranks.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from model.gpt import Block, GPTConfig
from parallel.link_probe import LinkMeasurement, max_over_ranks, probe_links, start_together
from parallel.topology import Topology
from zeropp.kernels.quant import dequantize, dequantize_reduce, dequantize_reduce_requantize, quantize

COMPUTE_S = 0.1             # the most one timed forward + backward of a block may take
REPEATS = 2                 # timed runs of the block and of the quantizers; the fastest counts
QUANT_ELEMENTS = 2**20         # past the L2 cache, as a bucket is (the qgZ buffer of W rows)
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
    flops, block_s = _block_rate(cfg, dtype, device, micro_batch, seq_length, sync, timeout_s)
    marks.append(time.perf_counter())
    rate8, rate4 = _quant_rates(dtype, device, qw_block, qg_block, topology, sync)
    opt_s = _optimizer_time(device, sync)
    marks.append(time.perf_counter())
    spans = [b - a for a, b in zip(marks, marks[1:])] + [marks[-1] - marks[0]]
    # MAX of times (seconds per element for the quantizers): the slowest rank's rates
    block_s, q8, q4, opt_s, *spans = max_over_ranks([block_s, 1 / rate8, 1 / rate4, opt_s, *spans], device,
                                                    timeout_s, "compute timings")
    return Measurements(links, flops / block_s, 1 / q8, 1 / q4, 16 * OPTIMIZER_ELEMENTS / opt_s, spans[-1],
                        dict(zip(("links", "compute", "quantization and optimizer"), spans)))


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_flops(cfg: GPTConfig, batch: int, seq: int) -> float:
    """Megatron's forward + backward FLOPs of one transformer layer (no recomputation)."""
    h = cfg.hidden_size
    return 72 * batch * seq * h * h * (1 + seq / (6 * h))


def _block_rate(cfg: GPTConfig, dtype, device, micro_batch: int, seq_length: int, sync,
                timeout_s: float) -> tuple[float, float]:
    """(FLOPs timed, seconds) of one block's forward + backward, sized to about COMPUTE_S."""
    torch.manual_seed(0)
    block = Block(cfg).to(device=device, dtype=dtype).train()

    def run(batch: int, seq: int) -> float:
        x = torch.randn(batch, seq, cfg.hidden_size, dtype=dtype, device=device, requires_grad=True)
        grad = torch.randn_like(x)
        _sync(device)
        sync()
        t0 = time.perf_counter()
        block(x).backward(grad)
        _sync(device)
        return time.perf_counter() - t0

    batch, seq = 1, min(seq_length, 16)
    run(batch, seq)   # pays allocation and kernel selection
    pilot = max_over_ranks([run(batch, seq)], device, timeout_s, "compute timings")[0]
    rate = block_flops(cfg, batch, seq) / pilot   # a low guess: small shapes run below the peak
    # The largest shape up to the real micro-batch that the guess says fits COMPUTE_S (the same on
    # every rank: from the MAX-reduced time).
    batch, seq = micro_batch, seq_length
    while block_flops(cfg, batch, seq) / rate > COMPUTE_S and (batch > 1 or seq > 16):
        batch, seq = (batch // 2, seq) if batch > 1 else (batch, max(16, seq // 2))
    times = [run(batch, seq) for _ in range(REPEATS)]
    return block_flops(cfg, batch, seq), min(times)   # the least disturbed by other work


def _quant_rates(dtype, device, qw_block: int, qg_block: int, topology: Topology, sync) -> tuple[float, float]:
    """Elements per second through INT8 and INT4 (de)quantization, counted as planner/comm.py
    counts them: qwZ's gather of T elements = quantize T + dequantize W T; qgZ's reduction of
    rows of P = quantize W P, then dequantize-sum-requantize L parts of N P, then
    dequantize-sum N parts of P: (2W + N) P elements, through the functions the engine calls."""
    world, local = topology.world_size, topology.ranks_per_node
    nodes = world // local
    chunk = max(qg_block, QUANT_ELEMENTS // world // qg_block * qg_block)   # T = P: W of them fill the buffer
    x = torch.randn(world * chunk, device=device).to(dtype)

    gathered = quantize(x, 8, qw_block)   # what a gather of W shards of T brings
    received = [quantize(x[i * nodes * chunk:(i + 1) * nodes * chunk], 4, qg_block) for i in range(local)]
    last = [quantize(x[:chunk], 4, qg_block)] * nodes

    def qwz():
        quantize(x[:chunk], 8, qw_block)
        dequantize(gathered, dtype)

    def qgz():
        quantize(x, 4, qg_block)
        dequantize_reduce_requantize(received, 4, qg_block)
        dequantize_reduce(last, dtype, 1.0 / world)

    out = []
    for run, elements in ((qwz, (1 + world) * chunk), (qgz, (2 * world + nodes) * chunk)):
        run()   # warm-up: Triton compiles, the first touch of the buffers' pages (several times slower on CPU)
        times = []
        for _ in range(REPEATS):
            _sync(device)
            sync()
            t0 = time.perf_counter()
            run()
            _sync(device)
            times.append(time.perf_counter() - t0)
        out.append(elements / min(times))
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
