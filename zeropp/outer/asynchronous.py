"""The asynchronous outer synchronization (--outer-async): groups that never wait for each other.

The inner steps' side; the exchanges run in a thread of their own (zeropp/outer/rounds.py), the two
meet in zeropp/outer/offers.py's Board.

- At its exchange steps (the synchronous schedule) a group offers its outer gradient for the
  fragment of the next round, D = base - local: its progress against the global values it last
  merged (its own base, FedBuff-style), weighted by the inner steps it trained since it last
  contributed that fragment. It does not wait for the round.
- After each inner step it merges what the rounds published: a round it contributed to at its
  merge step (--outer-sync-delay after the offer), as the synchronous mode merges (local <- alpha
  local + (1 - alpha) global; topk2: by the global step and what it sent); a round it took
  without contributing at once, by rebasing (local <- local + (global - base): it keeps all its
  own steps). What a group's ranks do at a step (merge, end, fail) is agreed in one small
  all-reduce inside the group, since a merge is collective.
- The end: the first group at --train-iters offers its masters to the final round (the exact
  mean of the masters offered); a group still training takes it and ends there too. One not in
  that round (between its rounds, cut off, started late) is served the final model by the groups
  that hold it, for up to --outer-timeout (zeropp/outer/rounds.py `serve_final`).

With every group present, equal tokens and rounds that complete within the merge delay, this is
the synchronous outer step up to fp32 rounding (sum_i w_i (g - l_i) instead of g - sum_i w_i l_i;
tests/unit/outer/test_outer_rounds.py states the bound)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zeropp.collectives.partition import FlatState
from zeropp.outer.diloco import OuterSync
from zeropp.outer.offers import Board, Offer
from zeropp.outer.rounds import Rounds
from zeropp.outer.settings import KEY, OuterSettings


class AsyncOuterSync(OuterSync):
    """OuterSync whose exchanges run beside the inner steps and are never waited for."""

    def __init__(self, engine, cross, settings: OuterSettings):
        super().__init__(engine, cross, settings)
        self.flat["base"] = self.flat["global"].clone()   # the global values my masters last merged (per group)
        self.base = self.layout.views(self.flat["base"])
        self.base_round = torch.zeros(settings.fragments, dtype=torch.int64)   # the round each base comes from
        self.board = Board(settings.fragments)
        self.rounds = Rounds(self)
        self.rate, self._last = 0.0, None    # inner steps per second (a moving average; the thread reads it)
        self.owed = False                    # an exchange step passed while my last offer was in a round
        self.end_iteration = None            # --train-iters: where a group taken to the end stops
        self._saved = None                   # checkpoint_state()'s scalars, for scalar_state()
        cross.deferred = True   # the thread's bytes are counted here (settle_bytes)

    # -- after every inner step ---------------------------------------------------------------
    def end_step(self, applied: bool) -> str | None:
        now = time.monotonic()
        if self._last is not None:
            rate = 1.0 / max(now - self._last, 1e-6)
            self.rate = 0.8 * self.rate + 0.2 * rate if self.rate else rate
        self._last = now
        self.steps += 1
        self.since.tick()
        self.cross.settle_bytes()
        board = self.board
        with board.lock:
            ready = bool(board.mergeable(self.steps)) or board.reset_masters
            flags = torch.tensor([float(ready), float(board.finished), float(board.failure is not None),
                                  float(board.rounds), -float(board.rounds), float(board.busy())])
        self.comm.all_reduce(flags, op=dist.ReduceOp.MAX, phase="outer_membership")   # my group's ranks agree
        merge, finished, failed, rmax, rmin, busy = flags.tolist()
        if failed:
            self._raise()
        with board.lock:
            if finished:
                self._wait_final()
                self._take_final()
            elif merge:
                self._merge(board.mergeable(self.steps))
            self.owed = self.owed or bool(self.s.due(self.steps))
            if self.owed and not busy and rmax == -rmin and not board.finished:   # my ranks agree on the round
                self._post_offer()
                self.owed = False
        if merge or finished:
            self.engine.masters_changed()
        return None

    def _merge(self, fragments: list[int]):
        """My masters take the new global values of `fragments` (under the lock)."""
        board, keep = self.board, self.s.merge_alpha if self.s.delay else 0.0
        if board.reset_masters:   # healed before it ever exchanged: the global values are its masters
            self._take_final()
            board.reset_masters = False
            return
        for f in fragments:
            o, g, base = board.offer, self.glob[f], self.base[f]
            if o is not None and o.fragment == f and o.state == "counted":   # mine: as the synchronous merge
                if o.reseed:
                    self._set_masters(f, 0.0, g)
                elif o.skipped:   # my steps stay in my masters for the next offer
                    pass
                elif self.s.quantization == "topk2":   # what I did not send stays in my masters
                    self._set_masters(f, 0.0, self.local(f).add_(g - base + self.err[f], alpha=1.0 - keep))
                    self.err[f].zero_()
                else:
                    self._set_masters(f, keep, g)
                if not o.skipped:
                    self.since[f] = max(0, self.since[f] - o.tokens)
                board.log["late"] += self.steps > o.merge_at
                board.offer = None
            else:   # a round I took without contributing: my own steps stay, on the new global values
                self._set_masters(f, 0.0, self.local(f).add_(g - base))
                if o is not None and o.fragment == f:   # measured against the old base: offered anew when due
                    board.offer = None
            base.copy_(g)
            self.base_round[f] = board.glob_round[f]
            board.dirty.discard(f)

    def _post_offer(self):
        """My outer gradient for the next round's fragment, to the thread (under the lock)."""
        f = self.board.rounds % self.s.fragments
        self.board.offer = Offer(f, self.base[f] - self.local(f), self.since[f], int(self.base_round[f]),
                                 self.steps + self.s.delay)
        self.board.lock.notify_all()

    def _wait_final(self):
        """Every rank of my group takes the same final round: wait for mine (bounded; under the lock)."""
        board = self.board
        if not board.wait_finished(self.cross.timeout_s):
            board.failure = board.failure or RuntimeError("the final round reached only part of this group")
            self._raise()

    def _take_final(self):
        """My masters and my base are the global values (under the lock)."""
        self.layout.set_all(self.flat["global"])
        self.flat["base"].copy_(self.flat["global"])
        self.base_round.copy_(self.board.glob_round)
        self.board.dirty.clear()
        self.board.offer = None
        self.board.reset_masters = False
        if self.board.finished and self.end_iteration is not None:
            self.steps = max(self.steps, self.end_iteration)

    def _raise(self):
        self.rounds.stop()
        raise self.board.failure or RuntimeError("another rank of this group stopped in an exchange (its error above)")

    # -- the start and the end --------------------------------------------------------------------
    def join(self) -> str:
        """Before the first inner step (no thread yet): one round with whoever is there, waiting for
        the groups that start with this one (bounded), a heal if this group is behind; then the
        thread starts. A group that comes after the run's end, while the others serve the final
        model, takes it and the run's last iteration."""
        opened, o = self.rounds.meet(at_start=True)
        self.rounds.exchange(opened, o)
        self.joined = True
        with self.board.lock:
            ended = self.board.finished   # the others had ended and served their final model: mine now
            self._take_final() if ended else self._merge(self.board.mergeable(self.steps))
        self.engine.masters_changed()   # (every rank of my group: the round was agreed in it)
        if ended:
            return f"the run had ended: this group takes the final model the others served, at iteration {self.steps}"
        self.rounds.start()
        if not opened.quorum:
            return "no quorum at the start: this group trains alone until one forms"
        return (f"joined a quorum of {opened.size} group(s)" + (" and healed from a peer" if opened.healed else "")
                + f"; {self.board.rounds} rounds committed so far; no group waits for another from here")

    def final(self) -> str | None:
        """The end of training: my masters offered to the final round, its exact mean taken (a group
        that took it already ends with it); then the final model served to the groups not in it."""
        board = self.board
        with board.lock:   # (checked under the lock: a round in flight may be the others' final one)
            if not board.finished:
                board.offer = Offer(self.s.fragments, self.layout.local_all(), 1, board.rounds, self.steps)
                board.lock.notify_all()
                board.wait_finished(2 * self.cross.timeout_s)
            theirs = board.finished and not board.final_mine
        # every rank of my group on one path: a final round may end on one rank's thread before another's
        flags = torch.tensor([float(board.finished), float(board.failure is None), float(theirs)])
        self.comm.all_reduce(flags, op=dist.ReduceOp.MIN, phase="outer_membership")   # every shard's final round
        if not flags[1]:
            self._raise()
        self.rounds.stop()
        if not flags[0]:
            return "no final round with the others in time: this group's own model"
        with board.lock:
            self._take_final()
        self.engine.masters_changed()
        theirs = "the final round of the groups that reached the end first" if flags[2] else None
        return "; ".join(n for n in (theirs, self.rounds.serve_final()) if n) or None

    # -- evaluation, checkpoints, logs --------------------------------------------------------------
    def global_values(self) -> torch.Tensor:
        with self.board.lock:
            return self.flat["global"].clone()

    def checkpoint_state(self, world: int) -> dict[str, FlatState]:
        """My slices of the outer state: while the thread runs, a consistent copy to save (it may
        publish meanwhile); before it starts (a load fills them), the tensors themselves."""
        with self.board.lock:
            running = self.rounds.thread is not None and self.rounds.thread.is_alive()
            flats = {k: v.clone() if running else v for k, v in self.flat.items()}
            self._saved = self._scalars()
        return {f"{KEY}.{name}.{s.name}": FlatState(part, s.numel, sharded=True, per_group=name in ("error", "base"))
                for name, flat in flats.items() for s, part in self.layout.per_parameter(flat)}

    def scalar_state(self) -> dict:
        """Of the same moment as checkpoint_state()'s copy (else of now)."""
        saved, self._saved = self._saved, None
        if saved is None:
            with self.board.lock:
                saved = self._scalars()
        return saved

    def _scalars(self) -> dict:
        return {**super().scalar_state(), **self.board.scalars(), "base_round": self.base_round.tolist(),
                "membership": {**self.cross.state_dict(), "step": self.board.rounds}}

    def load_scalar_state(self, saved: dict | None) -> str | None:
        note = super().load_scalar_state(saved)
        if note is None and saved is not None:
            with self.board.lock:
                self.board.load(saved)
            self.base_round = torch.tensor(saved.get("base_round", [0] * self.s.fragments), dtype=torch.int64)
        else:
            self.flat["base"].copy_(self.flat["global"])
        return note

    def drain(self) -> int:
        self.rounds.stop()
        return 0

    def summary(self) -> str | None:
        self.rounds.stop()
        return (f"outer synchronization: {self.outer_steps} outer steps in {self.board.rounds} rounds over up to "
                f"{self.cross.num_groups} groups, asynchronous (every {self.s.interval} inner steps, "
                f"{self.s.fragments} fragment(s), {self.s.quantization} outer gradients)")
