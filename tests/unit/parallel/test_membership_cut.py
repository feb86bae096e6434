"""The cross-group process group (common/torchft_private.py `gloo_within`) under a link cut while
it is reconfigured: gloo waits five times its timeout for a pair's first connection, so a group
whose peer wrote its address and was then cut off stood still five exchange timeouts (50 s
with a 10 s timeout in a groups job). Two ranks on two emulated sites (scenarios/groups_sites.py),
torchft's configure as the Manager calls it."""
import importlib.util
import json
import subprocess
import sys
import time

import pytest

from scenarios.groups_sites import NO_SITES, address, can_make_sites, in_site, link, sites_down, sites_up

pytestmark = [pytest.mark.slow,   # a 15 s outage
              pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed"),
              pytest.mark.skipif(not can_make_sites(), reason=NO_SITES)]

TIMEOUT, PORT, DOWN = 5.0, 29530, 15.0

RANK = """
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from common.torchft_private import gloo_within
rank, folder, timeout, port = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
if rank == 0:   # the store torchft's configure reaches (the Manager's, in a groups job)
    store = dist.TCPStore(sys.argv[5], port, 2, is_master=True, wait_for_workers=False)
pg = gloo_within(timedelta(seconds=timeout))

def when(name):
    while not os.path.exists(os.path.join(folder, name)):
        time.sleep(0.02)

def configure(quorum):
    start = time.monotonic()
    try:
        pg.configure(f"{sys.argv[5]}:{port}/q{quorum}", f"r{rank}", rank, 2)
        return "ok", time.monotonic() - start
    except Exception as e:
        return type(e).__name__, time.monotonic() - start

if rank == 0:
    empty = store.num_keys()
    open(os.path.join(folder, "store"), "w").close()
    while store.num_keys() == empty:   # until rank 1 wrote its address
        time.sleep(0.02)
    open(os.path.join(folder, "addressed"), "w").close()
    when("go")
    print(json.dumps(["cut", *configure(1)]), flush=True)   # the peer's address is there: connects
else:
    when("store")
    print(json.dumps(["cut", *configure(1)]), flush=True)   # writes its address, then is cut off
when("back")
print(json.dumps(["back", *configure(2)]), flush=True)
time.sleep(0 if rank == 0 else 2 * timeout / 5)   # later than the connection's wait, within the exchange's
t = torch.ones(3) * (rank + 1)
pg.allreduce([t], dist.AllreduceOptions()).wait()
print(json.dumps(["sum", t.tolist()]), flush=True)
"""


def test_a_link_cut_while_the_groups_connect_holds_them_one_exchange_timeout_not_five(tmp_path):
    sites_up(2)
    try:
        ranks = [subprocess.Popen(in_site(g, ["env", f"GLOO_SOCKET_IFNAME=s{g}", sys.executable, "-c", RANK, str(g),
                                              str(tmp_path), str(TIMEOUT), str(PORT), address(0)]),
                                  stdout=subprocess.PIPE, text=True)
                 for g in (0, 1)]
        deadline = time.monotonic() + 60
        while not (tmp_path / "addressed").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        link(1, up=False)
        (tmp_path / "go").touch()
        time.sleep(DOWN)
        link(1, up=True)
        (tmp_path / "back").touch()
        outs = [r.communicate(timeout=120)[0] for r in ranks]
    finally:
        sites_down(2)
    said = [{line[0]: line[1:] for line in map(json.loads, filter(lambda s: s.startswith('["'), out.split("\n")))}
            for out in outs]
    outcome, seconds = said[0]["cut"]
    assert outcome != "ok" and seconds < TIMEOUT + 2, (
        f"rank 0 waited {seconds:.1f} s for a peer cut off (the exchange timeout is {TIMEOUT:g} s)")
    # once the link is back the groups meet, and their collectives wait the whole timeout
    assert [s["back"][0] for s in said] == ["ok", "ok"], said
    assert [s["sum"] for s in said] == [[[3.0, 3.0, 3.0]]] * 2, said
