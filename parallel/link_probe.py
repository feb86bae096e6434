"""A few timed collectives at start-up: how fast the links between and inside nodes are.

    links = probe_links(topology, device)      # every rank calls it, after the groups are built
    links.inter_node_bytes_per_s, links.intra_node_bytes_per_s, links.inter_node_latency_s, ...

What is timed (each rank times its own collective after a common start; the
times are then all-reduced with MAX, so every rank gets the same figures and
anything decided from them is decided alike everywhere):
- latency: an all-gather of one float over the world, and over the node's group,
  a few times; latency per hop = median time / (members - 1), the planner's
  `(n - 1) x latency` (planner/timing.py);
- inter-node bandwidth, per node: an all-gather over `topology.inter_node_group`
  (the ranks with my local index on every node), all local indices at once, as
  the engine's cross-node traffic shares the node's link. A pilot of 256 KiB per
  rank sizes the timed transfer to about TARGET_S (between 256 KiB and 16 MiB per
  rank), so a slow link is not probed for seconds and a fast one is not probed
  with a transfer too small to time; the pilot also drains a token-bucket
  shaper's burst. Bandwidth = the busiest node's cross-node bytes, charged as the
  Communicator charges them (`parallel.comm.wire_bytes`), / (median time - latency);
- intra-node bandwidth, per rank: the same over `topology.intra_node_group`.
The probe moves at most a few tens of MB and takes about a second over a
100 Mbit/s link. It calls torch.distributed directly, not the Communicator, so
its bytes never reach the training byte counts (CommStats).

A collective that fails or does not finish in `timeout_s` raises LinkProbeError
(a clear message naming the collective); nothing falls back to a guess.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.comm import all_gather_flat, wire_bytes
from parallel.topology import Topology

PILOT_BYTES = 256 * 2**10
MIN_BYTES, MAX_BYTES = 256 * 2**10, 16 * 2**20
TARGET_S = 0.1            # per timed cross-node transfer (three of them); half that inside a node
REPEATS = 3
LATENCY_REPEATS = 5


class LinkProbeError(RuntimeError):
    """A probe collective failed or timed out: the links could not be measured."""


@dataclass(frozen=True)
class LinkMeasurement:
    inter_node_bytes_per_s: float    # per node: bytes leaving the busiest node / s (0: one node)
    intra_node_bytes_per_s: float    # per rank (0: one rank per node)
    inter_node_latency_s: float      # per hop of a collective that spans nodes
    intra_node_latency_s: float      # per hop inside a node
    inter_probe_bytes: int           # bytes per rank of each timed cross-node transfer
    seconds: float                   # the probe's wall time (the slowest rank's)

    def summary(self) -> str:
        def rate(b):
            return f"{b * 8 / 1e9:.3g} Gbit/s" if b else "n/a"
        return (f"inter-node {rate(self.inter_node_bytes_per_s)} per node, latency "
                f"{self.inter_node_latency_s * 1e6:.0f} us; intra-node {rate(self.intra_node_bytes_per_s)} "
                f"per rank, latency {self.intra_node_latency_s * 1e6:.0f} us")


def max_over_ranks(values: list[float], device: torch.device, timeout_s: float = 30.0,
                   what: str = "the probe's timings") -> list[float]:
    """Each value's maximum over all ranks (an all-reduce MAX, uncounted): identical everywhere."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    _run(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), timeout_s,
         f"all-reduce of {what}")
    return t.tolist()


def start_together(device: torch.device, timeout_s: float = 30.0):
    """Return on every rank at about the same moment (a one-float all-reduce), so that what each
    rank times next runs while the others run it too, sharing the machine as training does."""
    _run(lambda: dist.all_reduce(torch.zeros(1, device=device), async_op=True), timeout_s,
         "start-up all-reduce")


def probe_links(topology: Topology, device: torch.device = torch.device("cpu"),
                timeout_s: float = 30.0) -> LinkMeasurement:
    """Measure the links (module docstring); a collective on every rank of the job."""
    if not dist.is_initialized():
        raise LinkProbeError("the link probe needs the process group (torch.distributed) initialised first")
    multi_node = topology.num_nodes > 1
    if (multi_node and topology.inter_node_group is None) or topology.intra_node_group is None:
        raise LinkProbeError("the link probe needs the topology's process groups: call Topology.build_groups() "
                             "(parallel.topology.topology_from_env does) before probing")
    start = time.perf_counter()
    probe = _Probe(topology, device, timeout_s)
    probe.sync()   # every rank is here: the timings start together
    world = list(range(topology.world_size))
    node = topology.node_ranks(topology.node)
    inter_lat = probe.latency(None, world) if multi_node else 0.0
    intra_lat = probe.latency(topology.intra_node_group, node) if len(node) > 1 else 0.0
    inter_bw, inter_bytes = 0.0, 0
    if multi_node:
        inter_bw, inter_bytes = probe.bandwidth(topology.inter_node_group, topology.peer_ranks,
                                                inter_lat, cross_node=True)
    intra_bw = 0.0
    if len(node) > 1:
        intra_bw, _ = probe.bandwidth(topology.intra_node_group, lambda r: topology.node_ranks(
            topology.node_of(r)), intra_lat, cross_node=False)
    seconds = max_over_ranks([time.perf_counter() - start], device, timeout_s)[0]
    return LinkMeasurement(inter_bw, intra_bw, inter_lat, intra_lat, inter_bytes, seconds)


def _run(issue, timeout_s: float, what: str):
    """Issue an async collective and wait for it at most `timeout_s`; any failure is a LinkProbeError."""
    try:
        work = issue()
        if not work.wait(timeout=timedelta(seconds=timeout_s)):
            raise LinkProbeError(f"link probe: the {what} did not finish in {timeout_s:g} s")
    except LinkProbeError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the transport raises, said plainly
        msg = " ".join(str(e).split())[:300]
        raise LinkProbeError(f"link probe: the {what} failed or did not finish in {timeout_s:g} s "
                             f"({type(e).__name__}: {msg}); check the network between the nodes") from None


class _Probe:
    def __init__(self, topology: Topology, device: torch.device, timeout_s: float):
        self.topology, self.device, self.timeout_s = topology, device, timeout_s

    def sync(self):
        start_together(self.device, self.timeout_s)

    def _timed_gather(self, group, members: int, nbytes: int, what: str) -> float:
        """One all-gather of `nbytes` per rank over `group`, timed from a common start; this rank's time."""
        shard = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=self.device)
        out = torch.empty(members * shard.numel(), dtype=torch.float32, device=self.device)
        self.sync()
        t0 = time.perf_counter()
        _run(lambda: all_gather_flat(out, shard, group=group, async_op=True), self.timeout_s, what)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def latency(self, group, members: list[int]) -> float:
        where = "world" if group is None else "node"
        times = [self._timed_gather(group, len(members), 4, f"4-byte all-gather over the {where} group")
                 for _ in range(LATENCY_REPEATS)]
        times = max_over_ranks(times, self.device, self.timeout_s)
        return statistics.median(times) / (len(members) - 1)

    def bandwidth(self, group, group_of, latency: float, cross_node: bool) -> tuple[float, int]:
        """(bytes/s, bytes per rank timed): per node across nodes, per rank inside one."""
        topo = self.topology
        members = len(group_of(topo.local_rank if cross_node else topo.rank))
        what = f"all-gather over the {'inter' if cross_node else 'intra'}-node group"

        def charged(nbytes: int) -> int:
            """The busiest node's cross-node bytes, or the busiest rank's in-node bytes (ring charging)."""
            per_rank = {r: wire_bytes("all_gather", group_of(r % topo.ranks_per_node if cross_node else r), r,
                                      nbytes, topo.node_of) for r in range(topo.world_size)}
            if not cross_node:
                return max(intra for intra, _ in per_rank.values())
            return max(sum(per_rank[r][1] for r in topo.node_ranks(n)) for n in range(topo.num_nodes))

        hop = latency * (members - 1)
        pilot = max_over_ranks([self._timed_gather(group, members, PILOT_BYTES, what)], self.device,
                               self.timeout_s)[0]
        rate = charged(PILOT_BYTES) / max(pilot - hop, pilot / 10)
        # The same size on every rank (from MAX-reduced times), a multiple of 64 KiB.
        target = TARGET_S if cross_node else TARGET_S / 2
        nbytes = int(min(MAX_BYTES, max(MIN_BYTES, rate * target * PILOT_BYTES / charged(PILOT_BYTES))))
        nbytes -= nbytes % (64 * 2**10)
        times = [self._timed_gather(group, members, nbytes, what) for _ in range(REPEATS)]
        t = statistics.median(max_over_ranks(times, self.device, self.timeout_s))
        return charged(nbytes) / max(t - hop, t / 10), nbytes


__all__ = ["LinkMeasurement", "LinkProbeError", "max_over_ranks", "probe_links", "start_together"]
