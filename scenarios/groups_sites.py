"""Groups on emulated sites: each group's ranks in a network namespace of its own (ftsite0, ...),
every site joined by a veth pair to one bridge in a hub namespace (fthub) where the Lighthouse
runs. Each site has a hostname of its own (a UTS namespace) that every site resolves
(/etc/netns/<site>/hosts, which `ip netns exec` mounts over /etc/hosts): torchft advertises the
group's TCPStore (MASTER_ADDR, set by torchrun from the hostname), its Manager server and its
checkpoint transport by that name. `link(site, up)` cuts a site off and back: the cell
link-outage (`python -m scenarios.faults groups --cells link-outage`).
Addresses are in 198.51.100.0/24 (a documentation range), which exists only inside these
namespaces. Needs root and iproute2 (ip, bridge veth)."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from scenarios.harness.jobs import (FIGURES, RUN, TIMEOUT, finals, iterations, launch_group, problem, samples_in_order,
                        start_lighthouse, stood_still, stop, wait_for)
from scenarios.harness.netns import sh

HUB, BRIDGE = "fthub", "ftbr"
HUB_ADDR = "198.51.100.254"
LIGHTHOUSE_PORT = 29510


def site(g: int) -> str:
    return f"ftsite{g}"


def address(g: int) -> str:
    return f"198.51.100.{g + 1}"


def can_make_sites() -> bool:
    """Root with iproute2 and unshare, and the right to make a network namespace."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        return False
    probe = f"ftprobe{os.getpid()}"
    made = sh("ip", "netns", "add", probe, check=False).returncode == 0
    sh("ip", "netns", "del", probe, check=False)
    return made


NO_SITES = "needs root and network namespaces (ip netns, unshare): not run"


def sites_up(groups: int):
    """The hub with its bridge, and `groups` sites on it, each with its hosts file."""
    sites_down(groups)   # leftovers of a crashed run
    sh("ip", "netns", "add", HUB)
    sh("ip", "-n", HUB, "link", "set", "lo", "up")
    sh("ip", "-n", HUB, "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "-n", HUB, "addr", "add", f"{HUB_ADDR}/24", "dev", BRIDGE)
    sh("ip", "-n", HUB, "link", "set", BRIDGE, "up")
    hosts = "127.0.0.1 localhost\n" + "".join(f"{address(g)} {site(g)}\n" for g in range(groups))
    for g in range(groups):
        ns = site(g)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", f"s{g}", "netns", ns, "type", "veth", "peer", "name", f"h{g}", "netns", HUB)
        sh("ip", "-n", ns, "addr", "add", f"{address(g)}/24", "dev", f"s{g}")
        sh("ip", "-n", ns, "link", "set", f"s{g}", "up")
        sh("ip", "-n", HUB, "link", "set", f"h{g}", "master", BRIDGE)
        sh("ip", "-n", HUB, "link", "set", f"h{g}", "up")
        folder = Path("/etc/netns") / ns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(hosts)


def sites_down(groups: int = 8):
    listed = sh("ip", "netns", "list", check=False).stdout.split()
    for ns in [HUB, *(site(g) for g in range(groups))]:
        if ns in listed:
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def in_site(g: int, argv: list[str]) -> list[str]:
    """`argv` run in site g under its own hostname (exec all the way: the pid is argv's)."""
    return ["ip", "netns", "exec", site(g), "unshare", "--uts", "sh", "-c", f'hostname {site(g)} && exec "$@"',
            "sh", *argv]


def in_hub(argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", HUB, *argv]


def link(g: int, up: bool):
    """Site g's link to the hub (and through it to every other site) up or down."""
    sh("ip", "-n", HUB, "link", "set", f"h{g}", "up" if up else "down")


def bytes_into(g: int) -> int:
    """What the hub has sent site g over its link so far."""
    shown = sh("ip", "-n", HUB, "-s", "-j", "link", "show", f"h{g}").stdout
    return json.loads(shown)[0]["stats64"]["tx"]["bytes"]


def link_outage(base, tmp: Path, iters: int = 2400, seconds: float = 60.0) -> str:
    """Three groups on three sites; once all three exchange, site 2's link is down for `seconds`,
    then up. Groups 0 and 1 go on together (never standing still past two exchange timeouts),
    group 2 goes on alone (its quorums time out) and rejoins them, healing and taking their inner
    step. Every group reads its own samples in order (none skipped or read twice; a group that
    fell behind continues at the others' inner step: how many it took is in the JSON), exits 0
    and ends on the same global model."""
    if not can_make_sites():
        return NO_SITES
    groups, cut_off = 3, 2
    argv = [*RUN, "--train-iters", str(iters), "--global-batch-size", str(4 * groups)]
    logs = [tmp / f"group{g}.log" for g in range(groups)]
    started, procs = [], []   # whatever fails from here, these are stopped and the namespaces go
    try:
        sites_up(groups)
        lh, url = start_lighthouse(tmp / "lighthouse.log", port=LIGHTHOUSE_PORT, host=HUB_ADDR, wrap=in_hub)
        started.append(lh)
        for g in range(groups):
            procs.append(launch_group(g, groups, url, [*base(tmp / f"g{g}"), *argv], logs[g],
                                      wrap=lambda a, g=g: in_site(g, a)))
            started.append(procs[-1])
        if not wait_for(logs[cut_off], rf"quorum: {groups} groups", 300, procs[cut_off]):
            return problem(logs[cut_off], "the three groups never exchanged together")
        link(cut_off, up=False)
        mark = len(logs[cut_off].read_text(errors="replace"))
        time.sleep(seconds)
        link(cut_off, up=True)
        back = time.time()
        rcs = [p.wait(timeout=1800) for p in procs]
    finally:
        stop(*reversed(started))
        sites_down(groups)
    if any(rcs):
        return problem(logs[next(g for g, rc in enumerate(rcs) if rc)], f"exit statuses {rcs}")
    taken = {}
    for g, log in enumerate(logs):   # a group that falls behind continues at the others' inner step
        seen = [it for _, it in iterations(log)]
        if seen[-1:] != [iters] or seen != sorted(set(seen)) or not samples_in_order(log):
            return problem(log, f"group {g} repeated an iteration, or skipped or repeated a sample")
        taken[f"group{g}"] = iters - len(seen)
    stamps = [[t for t, _ in iterations(log)] for log in logs]
    FIGURES["link-outage"] = {"inner_steps_taken_from_the_others": taken, "longest_stall_s": {
        f"group{g}": max(b - a for a, b in zip(ts, ts[1:])) for g, ts in enumerate(stamps)},
        "iterations_alone_while_cut_off": sum(back - seconds < t <= back for t in stamps[cut_off])}
    for log in logs[:cut_off]:
        # the cut-off group's quorum request may reach the Lighthouse as the link returns, after it
        # gave up on it: the others then wait out one process-group configuration and exchange
        if still := stood_still(log, timeouts=2):
            return still
        if not re.search(rf"quorum of {groups - 1} group\(s\), was {groups}[\s\S]*quorum of {groups} group\(s\), "
                         rf"was {groups - 1}", log.read_text(errors="replace")):
            return problem(log, "the others did not go on without the cut-off group and then meet it again")
    after = logs[cut_off].read_text(errors="replace")[mark:]
    if "goes on alone" not in after or not re.search(rf"quorum of {groups} group\(s\)", after.split("goes on alone")[-1]):
        return problem(logs[cut_off], "the cut-off group did not go on alone and then rejoin")
    if not [t for t, _ in iterations(logs[cut_off]) if t > back + 2 * TIMEOUT]:
        return problem(logs[cut_off], f"the run ended before the link was back for long: raise iters ({iters})")
    ends = finals(*logs)
    if not all(ends) or any(f != ends[0] for f in ends):
        return problem(logs[cut_off], f"the groups end on different global models: {ends}")
    return ""


def heal_interrupted(base, tmp: Path, iters: int = 3000, rate_mbit: float = 4, seconds: float = 15.0) -> str:
    """Two groups on two sites. Group 1 starts late and must heal from group 0, over a link
    slowed to `rate_mbit` so that the heal takes seconds; the link goes down while it fetches
    the outer state, for `seconds`, then comes back at full speed. The cut heal must leave nothing half-loaded: group 1 goes on
    (alone), heals once the link is back and exchanges with group 0; group 0 never stands still
    past two exchange timeouts and reads its samples in order; both end on the same global
    model."""
    if not can_make_sites():
        return NO_SITES
    from scenarios.harness.netns import tbf_burst
    argv = [*RUN, "--train-iters", str(iters)]
    logs = [tmp / "group0.log", tmp / "group1.log"]
    started, procs = [], []   # whatever fails from here, these are stopped and the namespaces go

    def launch(g):
        procs.append(launch_group(g, 2, url, [*base(tmp / f"g{g}"), *argv], logs[g], wrap=lambda a: in_site(g, a)))
        started.append(procs[-1])
    try:
        sites_up(2)
        lh, url = start_lighthouse(tmp / "lighthouse.log", port=LIGHTHOUSE_PORT, host=HUB_ADDR, wrap=in_hub)
        started.append(lh)
        launch(0)
        if not wait_for(logs[0], r"iteration +20/", 120, procs[0]):
            return problem(logs[0], "group 0 never trained")
        # slow only while group 1 heals (what reaches its site: the outer state it fetches)
        sh("tc", "-n", HUB, "qdisc", "add", "dev", "h1", "root", "tbf", "rate", f"{int(rate_mbit * 1000)}kbit",
           "burst", str(tbf_burst(rate_mbit)), "latency", "400ms")
        launch(1)
        if not wait_for(logs[1], r"healing is required", 120, procs[1]):
            return problem(logs[1], "the late group never started to heal")
        # cut once the outer state flows (the process group's set-up before it is a few KiB)
        start, end = bytes_into(1), time.time() + 60
        while bytes_into(1) - start < 32 * 1024 and time.time() < end:
            time.sleep(0.05)
        link(1, up=False)
        cut = len(logs[1].read_text(errors="replace"))
        time.sleep(seconds)
        meanwhile = logs[1].read_text(errors="replace")[cut:]
        sh("tc", "-n", HUB, "qdisc", "del", "dev", "h1", "root")
        link(1, up=True)
        back = time.time()
        rcs = [p.wait(timeout=1200) for p in procs]
    finally:
        stop(*reversed(started))
        sites_down(2)
    if any(rcs):
        return problem(logs[next(g for g, rc in enumerate(rcs) if rc)], f"exit statuses {rcs}")
    if "healed from a peer" in meanwhile:
        return problem(logs[1], "the heal finished while the link was down: it was not interrupted")
    seen = [it for _, it in iterations(logs[0])]
    if seen[-1:] != [iters] or seen != sorted(set(seen)) or not samples_in_order(logs[0]):
        return problem(logs[0], "group 0 repeated an iteration, or skipped or repeated a sample")
    if still := stood_still(logs[0], timeouts=2):
        return still
    if not [t for t, _ in iterations(logs[0]) if t > back + 2 * TIMEOUT]:
        return problem(logs[0], f"group 0 ended before the link was back for long: raise iters ({iters})")
    late = logs[1].read_text(errors="replace")
    if "healed from a peer" in late[:cut]:
        return problem(logs[1], f"the heal ended before the link went down: slow the link below {rate_mbit} Mbit/s")
    if "healed from a peer" not in late[cut:] or "quorum: 2 groups" not in late[cut:].split("healed from a peer")[-1]:
        return problem(logs[1], "group 1 did not heal after the link came back and exchange with group 0")
    ends = finals(*logs)
    if not all(ends) or ends[0] != ends[1]:
        return problem(logs[1], f"the groups end on different global models: {ends}")
    return ""
