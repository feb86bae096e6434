"""The rounds of the asynchronous outer synchronization (zeropp/outer/asynchronous.py): a thread of
each rank's own, beside its inner steps, that takes its group's offers to torchft quorums.

A round is a torchft quorum (parallel/torchft_groups.py `meet`) of whoever is there. It exchanges
fragment R mod F, R the rounds committed so far (torchft's step; a heal sets it to the peer's),
over the members whose offer is for that fragment and not older than `max_staleness` outer steps
of it; the outer gradient is the offers' token-weighted sum, sum_i w_i D_i (exact, or INT4 /
topk2 rows decoded with their weights), then the Nesterov step of zeropp/outer/diloco.py on the
global values, which the thread publishes (zeropp/outer/offers.py Board). A round nobody offered
to is not committed. The final round (any member offers its masters) sets the global values to
the exact mean of the masters offered; once a member holds the final model (it serves it to the
groups that were not in that round), one holder's masters alone, bit for bit.

The thread asks for a round when its group has an offer, or, while the group is behind (slower
than 0.8 of the fastest member), at once after each round: then it is in every round, no round
waits for it and it never falls behind the global values. A group that does fall behind (cut off,
stopped) heals from a peer through torchft: the global values and the momentum, never its masters
nor its own base once it has exchanged."""
from __future__ import annotations

import threading
import time

import torch

from zeropp.outer.diloco import group_check, nesterov
from zeropp.outer.offers import BEHIND, Offer
from zeropp.outer.settings import PHASE
from zeropp.outer.wire import decode_weighted, encode_outer, outer_wire_nbytes

PAUSE_S = 0.5   # between rounds that repeat (a final offer asking again, the holders serving): no spinning


def round_step(glob: torch.Tensor, mom: torch.Tensor | None, delta: torch.Tensor, s) -> torch.Tensor:
    """A fragment's new global values from the offers' weighted sum `delta` = sum_i w_i D_i: the
    synchronous Nesterov step (zeropp/outer/diloco.py) with the members' mean g - delta."""
    return nesterov(glob - delta, delta, mom, s)


class Rounds:
    """The thread of one rank (its state is the sync's: global values, momentum, error)."""

    def __init__(self, sync):
        self.sync, self.board, self.cross, self.s = sync, sync.board, sync.cross, sync.s
        self.thread = None

    def start(self):
        self.board.stopping = False
        self.thread = threading.Thread(target=self._loop, name="outer-rounds", daemon=True)
        self.thread.start()

    def stop(self):
        with self.board.lock:
            self.board.stopping = True
            self.board.lock.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            # (a thread still waiting for a quorum is left to the process's end: a daemon, in torchft's Rust)
            self.thread.join(timeout=min(5.0, self.cross.timeout_s))

    def _loop(self):
        board, exchanged = self.board, True
        try:
            while True:
                with board.lock:
                    seen = board.offer
                    while not board.stopping and not board.wants_round(exchanged, seen):
                        board.lock.wait(timeout=1.0)
                    if board.stopping:
                        return
                exchanged = self.round()
                if not exchanged:   # (a final offer asks again: not faster than this, a new offer wakes it)
                    with board.lock:
                        board.lock.wait(timeout=PAUSE_S)
        except BaseException as e:   # noqa: BLE001 (raised in the inner steps' thread at its next step)
            with board.lock:
                board.failure = e
                board.lock.notify_all()

    def round(self, at_start: bool = False) -> bool:
        """One round: whether anything was exchanged in it (the start's runs before the thread, in
        the inner steps' own thread)."""
        return self.exchange(*self.meet(at_start))

    def meet(self, at_start: bool = False):
        """The quorum and its header: (what was agreed, my offer if it counts in it)."""
        cross, board, F, taken = self.cross, self.board, self.s.fragments, []

        def claim(opened, header):
            rounds, final, holder = cross.rounds(), header.extra[1] > 0, int(header.extra[2]) - 1
            opened.fragment = F if final else rounds % F
            if holder >= 0 and holder != cross.group_id:   # one holder's final model is the round's, exactly
                return 0.0, False
            with board.lock:
                o = board.take(opened.fragment, rounds, self.s.max_staleness, cross.events)
            taken.extend([o] if o is not None else [])
            return (float(o.tokens), True) if o is not None else (0.0, False)

        with board.lock:   # (rate, final, the holder of the final model serving it + 1, the holders known)
            final = board.offer is not None and board.offer.fragment == F
            extra = (self.sync.rate, float(final), float(cross.group_id + 1 if board.finished else 0),
                     *(float(g in board.holders) for g in range(cross.num_groups)))
        steps = self.sync.steps

        def once():
            return cross.meet(steps, float(steps), claim, extra)
        opened = cross.at_start(once) if at_start else once()
        o = taken[-1] if taken else None
        if o is not None and not (opened.counted and not opened.failed):
            with board.lock:   # not in this round after all (my group's other ranks had none, or it failed)
                o.state = "waiting"
            o = None
        return opened, o

    def exchange(self, opened, o) -> bool:
        cross, board, s, sync, F = self.cross, self.board, self.s, self.sync, self.s.fragments
        if not opened.quorum:
            return False
        if opened.failed:
            cross.commit()   # (says no: torchft's error on a rank)
            return True
        payload, behind = cross.any_in_group(sum(opened.weights) > 0, 0 < sync.rate < BEHIND * opened.extra[0])
        board.behind = behind
        if not payload:   # nobody offered for this fragment: nothing to commit
            return False
        f, w = opened.fragment, opened.weights[opened.rank]
        final = f == F
        flat = sync.flat["global"]
        mine = o.values if o is not None else torch.zeros(flat.numel() if final else sync.glob[f].numel(),
                                                          device=flat.device)
        sent = None
        if final or s.quantization == "none":
            delta = mine * w
            cross.all_reduce(delta, PHASE, async_op=False)
        else:   # each member's wire (zeros from one that offered nothing), decoded with its weight
            send = mine + sync.err[f] if o is not None else None
            wire, sent = encode_outer(send, s) if o is not None else (
                torch.zeros(outer_wire_nbytes(mine.numel(), s), dtype=torch.uint8, device=mine.device), None)
            rows = torch.empty(opened.size, wire.numel(), dtype=torch.uint8, device=wire.device)
            cross.all_gather(rows, wire, PHASE).wait()
            delta = decode_weighted(rows, mine.numel(), opened.weights, s)
        if not cross.commit():   # a member failed during it: nobody applies it
            if o is not None:
                with board.lock:
                    o.state = "waiting"
            return True
        finite, reseed, drift = group_check(cross, delta, mine)
        with board.lock:
            board.rounds = cross.rounds()
            if not finite:   # every member skips it; a group whose own outer gradient is not finite reseeds
                cross.events.append(f"outer step of fragment {f} skipped: its outer gradient is not finite")
            if final:
                if finite:
                    flat.copy_(delta)
                if not board.finished:
                    board.final_mine = o is not None
                board.finished = True
                board.holders |= set(opened.groups) | {g for g, x in enumerate(opened.extra[3:]) if x > 0}
            else:
                if finite:
                    sync.glob[f].copy_(round_step(sync.glob[f], None if sync.mom is None else sync.mom[f], delta, s))
                    if o is not None and s.quantization == "int4":   # what quantization left, for the next offer
                        sync.err[f].copy_(send - sent)
                    elif o is not None and s.quantization == "topk2":   # what went: the merge moves my masters by it
                        sync.err[f].copy_(sent)
                    sync.outer_steps += 1
                    sync.drift = drift
                board.glob_round[f] = board.rounds
                board.dirty.add(f)   # (merged even when skipped: my offer resolves, a bad copy reseeds)
            if o is not None:
                o.state, o.weight, o.reseed, o.skipped = "counted", w, reseed and not final, not finite
                board.log["counted"].append(w)
                if finite:
                    sync.counted_through = max(sync.counted_through, o.merge_at - (0 if final else s.delay))
            board.log["rounds"] += 1
            board.lock.notify_all()
        return True

    def serve_final(self) -> str | None:
        """A group between its rounds when the final one formed (a straggler) is still training:
        while a group of the run is not known to hold the final model, and for at most
        --outer-timeout, the holders meet in rounds that hand it over exactly (one holder's masters:
        `claim` in `meet`); a group that takes it ends there. After `stop` (never two rounds at once)."""
        board, cross, sync, F = self.board, self.cross, self.sync, self.s.fragments
        end, before = time.monotonic() + cross.timeout_s, set(board.holders)
        while True:
            running = self.thread is not None and self.thread.is_alive()
            if any(cross.any_in_group(board.holders >= set(range(cross.num_groups)), running, time.monotonic() >= end)):
                break
            with board.lock:
                board.offer = Offer(F, sync.layout.local_all(), 1, board.rounds, sync.steps)
            self.exchange(*self.meet())
            time.sleep(PAUSE_S)
        with board.lock:
            board.offer = None
            served, missing = board.holders - before, set(range(cross.num_groups)) - board.holders
        return "; ".join(
            ([f"the final model served to group(s) {sorted(served)}"] if served else [])
            + ([f"group(s) {sorted(missing)} did not come for the final model within --outer-timeout "
                f"{cross.timeout_s:g} s: they end on their own"] if missing else [])) or None

    # -- torchft's callbacks: what a peer that is behind takes, and a heal -------------------------
    def outer_state(self) -> dict:
        """What a peer that is behind takes from me (torchft's thread asks: a consistent copy)."""
        sync = self.sync
        with self.board.lock:
            return {"outer_steps": sync.outer_steps, "fingerprint": self.cross.fingerprint,
                    **{k: sync.flat[k].clone() for k in ("global", "momentum") if k in sync.flat}}

    def heal(self, state: dict):
        """A peer's global values and momentum (inside a quorum). A group that has exchanged keeps
        its masters and its own base: its offer is still measured against what it trained from, and
        it merges every fragment's new global values by rebasing; one that has not takes the global
        values as its masters (and its error feedback is zeroed)."""
        sync, board = self.sync, self.board
        if state.get("fingerprint") != self.cross.fingerprint:   # the quorum's header refuses it
            return
        with board.lock:
            if board.finished:   # it holds the final model and serves it: nothing a peer has replaces it
                return
            for k in ("global", "momentum"):
                if k in sync.flat:
                    sync.flat[k].copy_(state[k])
            sync.outer_steps, board.rounds = state["outer_steps"], self.cross.rounds()
            board.glob_round.fill_(board.rounds)
            if sync.joined:
                board.dirty = set(range(self.s.fragments))
            else:
                board.reset_masters = True
            if "error" in sync.flat:
                kept = sync.joined
                if not kept:
                    sync.flat["error"].zero_()
                self.cross.events.append("its error feedback " + ("kept: this group keeps its masters" if kept
                                                                  else "zeroed: this group takes the global values"))
