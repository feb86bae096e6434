"""Two emulated "nodes" on one machine: network namespaces nodeA and nodeB joined
by a veth pair vA <-> vB (192.0.2.1 / 192.0.2.2, a documentation range that exists
only inside the namespaces), rate-limited in both directions with tc tbf; the
processes started in them, tracked so that a crash or Ctrl-C leaves nothing behind.
Needs root and iproute2 (ip, tc); `missing()` says why not here."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

# BENCH_NETNS renames the namespaces (e.g. for a test beside a real run): <prefix>A, <prefix>B.
NS = tuple(os.environ.get("BENCH_NETNS", "node") + n for n in "AB")
IF = ("vA", "vB")
ADDR = ("192.0.2.1", "192.0.2.2")
RANKS_PER_NODE = 2
TBF_LATENCY = "400ms"

_live_groups: list[int] = []   # process-group ids of the processes we started and not yet reaped


def missing() -> str | None:
    """Why the emulated link cannot run here (None: it can)."""
    import shutil
    tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
    return ("not root" if os.geteuid() != 0 else f"{' and '.join(tools)} not found" if tools else None)


def sh(*cmd, check=True, timeout=30):
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def netns_down():
    """Kill the torchruns we started (by their process group), then remove the namespaces."""
    for pgid in list(_live_groups):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        _live_groups.remove(pgid)
    listed = sh("ip", "netns", "list", check=False).stdout.split()
    for ns in NS:
        if ns in listed:
            sh("ip", "netns", "del", ns, check=False)


def netns_up():
    netns_down()  # leftovers of a crashed run
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", IF[0], "netns", NS[0], "type", "veth", "peer", "name", IF[1], "netns", NS[1])
    for ns, ifname, addr in zip(NS, IF, ADDR):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
        sh("ip", "-n", ns, "link", "set", ifname, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def tbf_burst(rate_mbit: int) -> int:
    """Bucket size in bytes: 256 KiB, or 5 ms at the rate if larger (tbf needs
    burst >= rate / HZ; a bigger one lets fast links reach their rate)."""
    return max(256 * 1024, int(rate_mbit * 1e6 / 8 * 0.005))


def set_rate(rate_mbit: int):
    for ns, ifname in zip(NS, IF):
        sh("tc", "-n", ns, "qdisc", "del", "dev", ifname, "root", check=False)
        if rate_mbit:
            sh("tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", "tbf", "rate", f"{rate_mbit}mbit",
               "burst", str(tbf_burst(rate_mbit)), "latency", TBF_LATENCY)


def link_counters() -> dict:
    """tx/rx bytes of both veth ends, from outside (ip -s -j link show)."""
    out = {}
    for ns, ifname in zip(NS, IF):
        s = json.loads(sh("ip", "-n", ns, "-s", "-j", "link", "show", ifname).stdout)[0]["stats64"]
        out[ifname] = {"tx_bytes": s["tx"]["bytes"], "rx_bytes": s["rx"]["bytes"]}
    return out


def qdisc_stats() -> dict:
    out = {}
    for ns, ifname in zip(NS, IF):
        try:
            q = json.loads(sh("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", ifname).stdout)
            root = next((x for x in q if x.get("root")), q[0] if q else {})
            out[ifname] = {k: root.get(k) for k in ("kind", "bytes", "packets", "drops", "overlimits")}
        except Exception as e:  # informational only
            out[ifname] = {"error": str(e)}
    return out


def start_tracked(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """Popen in a new process group that netns_down() kills if we never stop it."""
    p = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    _live_groups.append(p.pid)
    return p


def stop(p: subprocess.Popen):
    """SIGTERM, then SIGKILL, the process group of `p`."""
    if p.poll() is None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                pass
    if p.pid in _live_groups:
        _live_groups.remove(p.pid)
