"""What a group's ranks agree on during an exchange (parallel/membership.py InGroup) waits at most
--outer-timeout: a rank whose group peer never comes to the exchange (stuck, or gone without
its launcher noticing) stops with one clear error within that time. It used to wait in the job's
process group, whose timeout is 30 minutes. One group of 2 ranks against a real Lighthouse, the
second rank absent from the exchange."""
import importlib.util
import time

import pytest

from scenarios.harness.jobs import start_lighthouse, stop
from tests.distributed import spawn_ranks

pytestmark = [pytest.mark.slow,   # two fresh rank processes that import torchft
              pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")]
TIMEOUT = 3.0


def exchange_without_my_peer(rank, world, url):
    from parallel.comm import Communicator
    from parallel.membership import GroupBroken
    from parallel.run_shape import RunShape
    from parallel.topology import topology_from_env
    from parallel.torchft_groups import TorchftGroups
    groups = TorchftGroups(Communicator(topology_from_env(2)), 0, 1, url, TIMEOUT)
    groups.register(lambda: {}, lambda state: None, RunShape())
    if rank == 1:   # never comes to the exchange (and leaves only after rank 0 has had its answer)
        time.sleep(6 * TIMEOUT)
        return None
    began = time.monotonic()
    try:
        groups.open(2, 0, 1)
        return "opened", time.monotonic() - began, ""
    except GroupBroken as e:
        return "broken", time.monotonic() - began, str(e)


def test_an_exchange_waits_for_a_rank_of_its_own_group_at_most_the_outer_timeout(tmp_path):
    lh, url = start_lighthouse(tmp_path / "lighthouse.log")
    try:
        results, error = spawn_ranks(exchange_without_my_peer, 2, (url,), timeout=120, fresh=True)
    finally:
        stop(lh)
    assert error is None, error
    outcome, seconds, said = results[0]
    assert outcome == "broken" and seconds < 3 * TIMEOUT, (outcome, seconds)
    assert said.startswith("a rank of this group did not answer within --outer-timeout 3 s during an exchange")
