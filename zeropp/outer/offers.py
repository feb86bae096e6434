"""What the inner steps and the rounds' thread of the asynchronous outer synchronization
(zeropp/outer/asynchronous.py, zeropp/outer/rounds.py) hand each other, under one lock: the
group's offer (its outer gradient for the next round), the rounds committed, the fragments whose
global values its masters have not merged yet, whether the run ended, and the thread's failure."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

BEHIND = 0.8   # a group slower than this share of the fastest member's inner-step rate is in every round


def versions(rounds: int, f: int, fragments: int) -> int:
    """How many of the first `rounds` rounds exchanged fragment f (round r exchanges r mod F)."""
    return max(0, (rounds - 1 - f) // fragments + 1)


@dataclass
class Offer:
    fragment: int            # F: the final round's (every fragment: my masters)
    values: torch.Tensor     # base - local of the fragment (the final round: my masters)
    tokens: int              # inner steps trained since my last contribution to the fragment
    base_round: int          # the round my base of the fragment comes from
    merge_at: int            # the inner step from which its round's result is merged
    state: str = "waiting"   # "taken" by a round in flight, then "counted" (merged from merge_at)
    weight: float = 0.0      # its share of the round, once counted
    reseed: bool = False     # my outer gradient was not finite: my masters take the global values
    skipped: bool = False    # its round's outer step was skipped (not finite): nothing to merge


def fresh_log() -> dict:
    return {"rounds": 0, "counted": [], "dropped": 0, "late": 0}


class Board:
    """The hand-over between the two threads (every method under `lock`, a Condition)."""

    def __init__(self, fragments: int):
        self.fragments = fragments
        self.lock = threading.Condition()
        self.offer: Offer | None = None
        self.dirty: set[int] = set()         # fragments with global values my masters have not merged
        self.rounds = 0                      # rounds committed (torchft's step), as published
        self.glob_round = torch.zeros(fragments, dtype=torch.int64)   # the round each fragment's values come from
        self.finished = False                # the final round was taken: the run has ended
        self.final_mine = False              # ...and my masters were in it (else the others' final model)
        self.holders: set[int] = set()       # the groups known to hold the final model
        self.reset_masters = False           # healed before this group exchanged: its masters take the global values
        self.behind = False                  # slower than the others: in every round
        self.stopping, self.failure = False, None
        self.log = fresh_log()               # since the last log line
        self.counted_through = 0             # the last inner step whose work is in a committed round

    def wait_finished(self, seconds: float) -> bool:
        """Wait (holding `lock`) for the final round, a failure or `seconds`: whether the round came."""
        end = time.monotonic() + seconds
        while not self.finished and self.failure is None and time.monotonic() < end:
            self.lock.wait(timeout=0.5)
        return self.finished

    def busy(self) -> bool:
        """My offer is in a round or waits for its merge: no new one."""
        return self.offer is not None and self.offer.state in ("taken", "counted")

    def mergeable(self, steps: int) -> list[int]:
        """The fragments whose new global values my masters can take after inner step `steps`."""
        o = self.offer
        return [f for f in sorted(self.dirty) if o is None or o.fragment != f or o.state == "waiting"
                or (o.state == "counted" and steps >= o.merge_at)]

    def wants_round(self, exchanged: bool, seen: Offer | None) -> bool:
        """Whether the thread asks for a round: with an offer (a new one after a round with nothing
        exchanged; my final one until a final round is taken), or at once after each round while
        behind."""
        if self.finished:   # the final round is taken: no round after it (an offer left waiting is moot)
            return False
        o = self.offer
        if o is not None and o.state == "waiting" and (exchanged or o is not seen or o.fragment == self.fragments):
            return True
        return self.behind and exchanged

    def take(self, fragment: int, rounds: int, max_staleness: int, events) -> Offer | None:
        """My offer for a round of `fragment` (F: the final one), if there is one for it and it is
        not stale (then it is dropped, said in `events`: its steps stay in my masters)."""
        o = self.offer
        if o is None or o.state != "waiting" or o.fragment != fragment:
            return None
        stale = 0 if fragment == self.fragments else \
            versions(rounds, fragment, self.fragments) - versions(o.base_round, fragment, self.fragments)
        if stale > max_staleness:
            self.offer = None
            self.log["dropped"] += 1
            events.append(f"outer gradient of fragment {fragment} dropped: {stale} outer steps stale (bound "
                          f"{max_staleness}); its steps go with this group's next one")
            return None
        o.state = "taken"
        return o

    def window_line(self) -> str | None:
        """What the rounds did since the last call, for the log (None: nothing; takes the lock)."""
        with self.lock:
            log, self.log = self.log, fresh_log()
        if not log["rounds"] and not log["dropped"]:
            return None
        mine = log["counted"]
        return (f"{log['rounds']} round(s); this group's outer gradient in {len(mine)}"
                + (f", weight {sum(mine) / len(mine):.3f} on average" if mine else "")
                + (f"; {log['dropped']} dropped as stale" if log["dropped"] else "")
                + (f"; {log['late']} merged after their step" if log["late"] else "")
                + ("; in every round (slower than the others)" if self.behind else ""))

    def scalars(self) -> dict:
        o = self.offer   # a counted offer is merged at its step after a resume; a waiting one is offered again
        return {"rounds": self.rounds, "glob_round": self.glob_round.tolist(), "dirty": sorted(self.dirty),
                "counted": [[o.fragment, o.merge_at, o.tokens, o.reseed]] if o and o.state == "counted" else []}

    def load(self, saved: dict):
        self.rounds = saved.get("rounds", 0)
        self.glob_round = torch.tensor(saved.get("glob_round", [0] * self.fragments), dtype=torch.int64)
        self.dirty = set(saved.get("dirty", []))
        self.offer = None
        for f, at, tokens, reseed in saved.get("counted", []):
            self.offer = Offer(f, torch.zeros(0), tokens, 0, at, state="counted", reseed=reseed)
