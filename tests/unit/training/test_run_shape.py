"""The header the members of a quorum exchange (parallel/run_shape.py), with the two all-reduces
done here over simulated members: a group whose shape is not the run's is refused (and only it:
the most senior member's shape is the run's), a second job with a group id is refused (the later
one), the others skip that exchange and go on; the weights are the shares of the tokens."""
import torch

from parallel.run_shape import Header, Mine, RunShape

RUN = RunShape({"model": "layers=2/hidden=32", "outer": "lr=0.7", "data": "kjv", "groups": "3"})


def quorum(members: list[Mine], tokens: list[float], groups: int = 3) -> list[Header]:
    """Each member's header after the MAX and the SUM all-reduces over all of them."""
    heads = [Header(m, len(members), rank, groups) for rank, m in enumerate(members)]
    top = torch.stack([h.max_vector() for h in heads]).amax(0)
    for h in heads:
        h.read_max(top)
    total = torch.stack([h.sum_vector(t, t > 0) for h, t in zip(heads, tokens)]).sum(0)
    for h in heads:
        h.read_sum(total)
    return heads


def shape(**changed) -> RunShape:
    return RunShape({**RUN.parts, **changed})


def test_a_group_of_another_model_is_refused_and_the_others_go_on():
    members = [Mine(0.0, 120, 0, 10.0, RUN), Mine(0.0, 120, 1, 11.0, RUN),
               Mine(0.0, 0, 2, 50.0, shape(model="layers=2/hidden=64"))]   # group 2 restarted, another model
    heads = quorum(members, [4, 4, 0])
    refused = [h.refusal() for h in heads]
    assert refused[:2] == [None, None]
    assert str(refused[2]).startswith("this group's model flags (--num-layers, --hidden-size, ...) and ranks per group "
                                      "differ from the run's (the groups that exchanged the most: 120 exchanges)")
    assert heads[0].void() == heads[1].void() and "was refused; this exchange is skipped" in heads[0].void()


def test_other_outer_flags_are_named_and_a_clean_start_takes_the_lowest_group_id():
    members = [Mine(0.0, 0, 0, 10.0, RUN), Mine(0.0, 0, 1, 9.0, shape(outer="lr=0.3"))]
    heads = quorum(members, [0, 0], groups=2)
    assert heads[0].refusal() is None and heads[0].differing() == []
    assert "outer settings (--outer-*)" in str(heads[1].refusal()) and heads[1].differing() == ["outer"]


def test_a_second_job_with_a_group_id_is_refused_the_first_goes_on():
    members = [Mine(0.0, 7, 0, 100.0, RUN), Mine(0.0, 0, 1, 50.0, RUN), Mine(0.0, 0, 1, 60.0, RUN)]
    heads = quorum(members, [1, 1, 1])
    assert heads[0].refusal() is None and heads[1].refusal() is None
    assert str(heads[2].refusal()).startswith("another job is already group 1 of this run (it started first)")
    assert all(h.void() == "a second job claimed group 1: it was refused, this exchange is skipped" for h in heads)
    # the two with one id are both the most senior (no exchange yet): nobody's shape is judged meanwhile
    members = [Mine(0.0, 0, 0, 50.0, RUN), Mine(0.0, 0, 0, 60.0, RUN), Mine(0.0, 0, 1, 70.0, RUN)]
    heads = quorum(members, [0, 0, 0])
    assert heads[2].refusal() is None and heads[0].refusal() is None and heads[1].refusal() is not None


def test_the_weights_are_the_shares_of_the_tokens_of_those_that_count():
    members = [Mine(0.0, 3, g, 1.0 + g, RUN) for g in range(3)]
    heads = quorum(members, [8, 0, 2])
    assert heads[0].weights() == [0.8, 0.0, 0.2] and heads[0].void() is None
    heads = quorum(members, [0, 0, 0])
    assert heads[1].weights() == [0.0, 0.0, 0.0]
