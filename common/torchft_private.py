"""Every private torchft attribute the product touches, in one place (checked against torchft
0.2.0); tests/test_torchft_private.py fails loudly when torchft renames one or changes it.

| attribute | used for |
|---|---|
| Manager._quorum_future | after a quorum that failed (a timeout: the group is cut off), torchft's next start_quorum re-raises that failure for good; clearing it lets the group try again at its next exchange |
"""
from __future__ import annotations

CHECKED_TORCHFT = "0.2.0"
ATTRIBUTES = ("Manager._quorum_future",)


def forget_failed_quorum(manager) -> None:
    """Let `manager` start a new quorum after one that raised."""
    manager._quorum_future = None
