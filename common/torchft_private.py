"""Every private torchft attribute the product touches, in one place (checked against torchft
0.2.0); tests/unit/common/test_torchft_private.py fails loudly when torchft renames one or changes it.

| attribute | used for |
|---|---|
| Manager._quorum_future | after a quorum that failed (a timeout: the group is cut off), torchft's next start_quorum re-raises that failure for good; clearing it lets the group try again at its next exchange |
| ProcessGroupGloo._create_pg, ProcessGroupWrapper._timeout | gloo waits five times its timeout for a pair's first connection (`Pair::waitUntil` in gloo/transport/tcp/pair.h): the cross-group process group is made with a fifth of the exchange timeout, so that a link cut during a reconfiguration holds the groups one exchange timeout, not five; its collectives then get the whole timeout |
"""
from __future__ import annotations

from datetime import timedelta

CHECKED_TORCHFT = "0.2.0"
ATTRIBUTES = ("Manager._quorum_future", "ProcessGroupGloo._create_pg", "ProcessGroupWrapper._timeout")
GLOO_CONNECT_WAITS = 5   # gloo's pair.h: `timeout_ * 5` for a first connection (tests/unit/parallel/test_membership_cut.py)


def forget_failed_quorum(manager) -> None:
    """Let `manager` start a new quorum after one that raised."""
    manager._quorum_future = None


def gloo_within(timeout: timedelta):
    """torchft's reconfigurable gloo process group whose reconfiguration waits about `timeout`
    for a peer (its address in the store, then the connection), and whose collectives wait
    `timeout`."""
    from torchft.process_group import ProcessGroupGloo

    class GlooWithin(ProcessGroupGloo):
        def _create_pg(self, store, rank: int, world_size: int):
            whole, self._timeout = self._timeout, self._timeout / GLOO_CONNECT_WAITS
            try:
                pg = super()._create_pg(store, rank, world_size)
            finally:
                self._timeout = whole
            pg.set_timeout(whole)
            return pg

    return GlooWithin(timeout=timeout)
