"""Stop cleanly when the scheduler asks: SIGTERM (what SLURM and Kubernetes
send before preemption) or SIGINT (Ctrl-C) sets a flag; the training loop
finishes its step, agrees with the other ranks that someone was signalled,
saves and exits 0. A second SIGINT interrupts at once."""
from __future__ import annotations

import signal

import torch


class StopRequest:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame):
        self.signum = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once

    def agreed(self, comm, device: torch.device, bad_streak: int = 0) -> tuple[bool, int]:
        """(whether any rank was signalled, the longest `bad_streak` of any rank), the same on every
        rank of `comm` (collective: one 8-byte all-reduce). `comm` must span the job: a stop
        decided by part of it would leave the rest in the next collective."""
        flag = torch.tensor([self.signum or 0, bad_streak], dtype=torch.int32, device=device)
        comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, phase="other")
        signum, streak = (int(v) for v in flag.tolist())
        if self.signum is None and signum:
            self.signum = signum
        return bool(signum), streak

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def restore(self):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @classmethod
    def restore_defaults(cls):
        """Python's own handlers (a StopRequest left installed by an exception swallows SIGTERM)."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
