"""The asynchronous outer step's arithmetic and bookkeeping, and the schedule's closed forms
(zeropp/outer/rounds.py, offers.py, wire.py, settings.py), on tensors: no ranks.

- with every group present and equal tokens, the step over the offers (sum_i w_i (g - l_i)) is the
  synchronous step over the members' mean (g - sum_i w_i l_i) within fp32 rounding of the sum;
- a straggler's outer gradient enters the new global values with its weight (its share of the
  tokens, what the log says), through the Nesterov step's -lr (1 + mu);
- INT4 and topk2 rows decode to the sum of each row's values times its weight;
- an offer older than the staleness bound is dropped and said; one for another fragment waits;
- the exchange schedule's and the memory bound's closed forms equal their loops, and take no time
  at H = 1e9 (they looped over range(H));
- no round after the final one; a final offer asks again after a round with no quorum; a final
  round a holder of the final model serves is that holder's model exactly."""
import random
import time

import pytest
import torch

from parallel.membership import Opened
from zeropp.kernels import sparse
from zeropp.kernels.format import Quantized
from zeropp.kernels.quant import dequantize
from zeropp.outer.diloco import nesterov
from zeropp.outer.offers import Board, Offer, versions
from zeropp.outer.rounds import Rounds, round_step
from zeropp.outer.settings import OuterSettings
from zeropp.outer.wire import decode_weighted, encode_outer, in_flight_bound, outer_wire_nbytes

EPS32 = torch.finfo(torch.float32).eps


def fragment(n=4096, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


def test_with_equal_tokens_the_step_over_offers_is_the_synchronous_step_within_rounding():
    s = OuterSettings(4)   # lr 0.7, Nesterov 0.9
    g, m = fragment(seed=1), fragment(seed=2, scale=1e-2)
    locals_ = [g + fragment(seed=3 + i, scale=1e-2) for i in range(3)]
    w = [1 / 3] * 3
    mean = sum(wi * li for wi, li in zip(w, locals_))
    m_sync, m_async = m.clone(), m.clone()
    sync = nesterov(mean, g - mean, m_sync, s)
    delta = sum(wi * (g - li) for wi, li in zip(w, locals_))
    got = round_step(g, m_async, delta, s)
    # sum_i w_i (g - l_i) and g - sum_i w_i l_i differ by the rounding of the sums: a few ulp of g
    bound = 8 * EPS32 * g.abs().max().item()
    assert (got - sync).abs().max().item() <= bound
    assert (m_async - m_sync).abs().max().item() <= bound
    assert not torch.equal(got, g)


def test_a_stragglers_outer_gradient_enters_with_its_logged_weight():
    s = OuterSettings(4)
    g, m = fragment(seed=1), fragment(seed=2, scale=1e-2)
    tokens = [8, 8, 2]   # the straggler trained a quarter of the others' steps since its last offer
    w = [t / sum(tokens) for t in tokens]
    d = [fragment(seed=10 + i, scale=1e-2) for i in range(3)]
    push = fragment(seed=20, scale=1e-3)

    def new(straggler):
        delta = w[0] * d[0] + w[1] * d[1] + w[2] * straggler
        return round_step(g, m.clone(), delta, s)
    moved = new(d[2] + push) - new(d[2])
    # new = g - lr (1 + mu) delta - lr mu^2 m: the straggler's push moves it by -lr (1 + mu) w_C push
    want = -s.lr * (1 + s.momentum) * w[2] * push
    assert torch.allclose(moved, want, rtol=1e-3, atol=64 * EPS32 * g.abs().max().item())
    assert w[2] == pytest.approx(0.111, abs=1e-3)


@pytest.mark.parametrize("quantization", ["int4", "topk2"])
def test_weighted_rows_decode_to_each_rows_values_times_its_weight(quantization):
    s = OuterSettings(4, quantization=quantization)
    values = [fragment(5000, seed=i) for i in range(3)]
    wires, decoded = zip(*(encode_outer(v, s) for v in values))
    rows = torch.stack(list(wires))
    w = [0.5, 0.0, 0.25]
    got = decode_weighted(rows, 5000, w, s)
    want = sum(wi * di for wi, di in zip(w, decoded))
    assert torch.allclose(got, want, rtol=0, atol=4 * EPS32 * want.abs().max().item())
    zero = torch.zeros(outer_wire_nbytes(5000, s), dtype=torch.uint8)   # a member that offered nothing
    got0 = decode_weighted(torch.stack([wires[0], zero]), 5000, [1.0, 0.0], s)
    assert torch.equal(got0, decode_weighted(wires[0].unsqueeze(0), 5000, [1.0], s))
    if quantization == "int4":
        q = Quantized.from_bytes(rows, 5000, 4, s.block_size)
        assert torch.allclose(decoded[2], dequantize(q[2]))
    else:
        assert torch.equal(decoded[2], sparse.decode(sparse.SparseTopK.from_bytes(wires[2], 5000, s.topk_fraction)))


def test_versions_count_the_rounds_of_a_fragment():
    for F in (1, 2, 3, 5):
        for rounds in range(20):
            for f in range(F):
                assert versions(rounds, f, F) == sum(1 for r in range(rounds) if r % F == f)


def test_an_offer_is_taken_for_its_fragment_dropped_when_stale_and_said():
    board, events = Board(2), []
    board.offer = Offer(1, torch.zeros(3), tokens=4, base_round=2, merge_at=9)
    assert board.take(0, rounds=4, max_staleness=1, events=events) is None   # round 4 exchanges fragment 0
    assert board.offer.state == "waiting" and events == []
    o = board.take(1, rounds=5, max_staleness=1, events=events)   # round 3 of fragment 1 since its base: 1 stale
    assert o is board.offer and o.state == "taken" and board.busy()
    board.offer = Offer(1, torch.zeros(3), tokens=4, base_round=2, merge_at=9)
    assert board.take(1, rounds=7, max_staleness=1, events=events) is None   # rounds 3 and 5: 2 stale
    assert board.offer is None and board.log["dropped"] == 1
    assert events == ["outer gradient of fragment 1 dropped: 2 outer steps stale (bound 1); its steps go with this "
                      "group's next one"]
    board.offer = Offer(2, torch.zeros(3), tokens=1, base_round=0, merge_at=9)   # the final one: never stale
    assert board.take(2, rounds=50, max_staleness=0, events=events) is board.offer


def test_a_merge_waits_for_its_round_and_its_step():
    board = Board(2)
    board.dirty = {0, 1}
    board.offer = Offer(1, torch.zeros(3), tokens=4, base_round=0, merge_at=9, state="taken")
    assert board.mergeable(8) == [0]   # fragment 1's round is in flight
    board.offer.state = "counted"
    assert board.mergeable(8) == [0] and board.mergeable(9) == [0, 1]


def test_the_schedule_and_the_memory_bound_in_closed_form():
    def due_loop(step, H, F):
        return [f for f in range(F) if step % H == f * H // F]

    def bound_loop(numels, s, groups):   # the loop over range(H) it replaces
        def held(n):
            return 8 * n + (0 if s.quantization == "none" else (groups + 1) * outer_wire_nbytes(n, s))
        w, H, F = max(s.delay, 1), s.interval, s.fragments
        return max(sum(held(n) for f, n in enumerate(numels) if (step - f * H // F) % H < w) for step in range(H))
    draw = random.Random(0)
    for _ in range(200):
        H = draw.randint(1, 40)
        F = draw.randint(1, 2 * H)   # (the command line keeps F <= H; the engine's API does not)
        s = OuterSettings(H, fragments=F, delay=draw.randint(0, H - 1), quantization=draw.choice(["none", "int4"]))
        numels = [draw.randint(0, 300) for _ in range(F)]
        assert in_flight_bound(numels, s, 3) == bound_loop(numels, s, 3), (H, F, s.delay)
        for step in range(1, 2 * H + 2):
            assert list(s.due(step)) == due_loop(step, H, F)
    start = time.perf_counter()
    huge = OuterSettings(10 ** 9)
    assert in_flight_bound([1000], huge, 2) == 8000 and list(huge.due(10 ** 9)) == [0] and not huge.due(7)
    wide = OuterSettings(300000, fragments=300000)
    assert in_flight_bound([1] * 300000, wide, 2) == 8 and list(wide.due(299999)) == [299999]
    assert time.perf_counter() - start < 5


def test_no_round_after_the_final_one():
    """Two groups reached the end together: one rank's final offer came back 'waiting' from the
    others' final round (its group's other rank had none yet), its thread asked for one more round,
    met alone and ended the group on its own masters, not on the mean the others took."""
    board = Board(2)
    board.offer = Offer(2, torch.zeros(3), 1, 0, 10)
    assert board.wants_round(True, None)
    board.finished = True
    board.behind = True
    assert not board.wants_round(True, None) and not board.wants_round(False, None)


def test_a_final_offer_asks_again_after_a_round_with_no_quorum():
    """A group that reached the end when its last quorum had failed (cut off, asking again after
    the timeout) left its final offer waiting and never asked again: it ended alone on its own
    masters while the others served the final model. An ordinary offer waits for the next one."""
    board = Board(2)
    board.offer = Offer(0, torch.zeros(3), 1, 0, 10)
    assert not board.wants_round(False, board.offer)
    board.offer = Offer(2, torch.zeros(3), 1, 0, 10)
    assert board.wants_round(False, board.offer)


class Met:
    """What torchft_groups.TorchftGroups.meet hands `claim`: the members' extra fields' maximum."""

    def __init__(self, extra):
        self.extra = extra


class Cross:
    """A membership whose quorum's header is given: meet calls claim with it."""

    def __init__(self, group_id, header_extra, num_groups=3):
        self.group_id, self.num_groups, self.header_extra, self.events = group_id, num_groups, header_extra, []
        self.sent = None

    def rounds(self):
        return 7

    def meet(self, steps, key, claim, extra):
        self.sent = list(extra)
        opened = Opened(steps, 0, 2, 0, None, quorum=True)
        opened.counted = claim(opened, Met(self.header_extra))[1]
        return opened


class Sync:
    def __init__(self, cross, board):
        self.cross, self.board, self.s = cross, board, OuterSettings(4, fragments=2)
        self.rate, self.steps = 1.0, 100


@pytest.mark.parametrize("me, holder, counts", [(2, 0, False), (0, 0, True), (1, 0, False), (2, -1, True)])
def test_a_final_round_with_a_holder_is_one_holders_model_exactly(me, holder, counts):
    """A final round a holder of the final model serves: only that holder's masters count (weight
    1: the model, bit for bit, not a mean of copies that rounds); a group at its own end takes it
    instead of its own; with no holder there, the masters offered are averaged as before."""
    board = Board(2)
    board.offer = Offer(2, torch.ones(3), 1, 0, 100)
    board.finished = me == holder
    board.holders = {0, 1} if board.finished else set()
    cross = Cross(me, [1.0, 1.0, float(holder + 1), 1.0, 1.0, 0.0])
    opened, mine = Rounds(Sync(cross, board)).meet()
    assert opened.fragment == 2 and (mine is not None) == counts and opened.counted == counts
    assert cross.sent[2] == (me + 1 if me == holder else 0) and cross.sent[3:] == [float(g in board.holders)
                                                                                   for g in range(3)]
