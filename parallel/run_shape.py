"""What the groups of one run must share (the run's shape), and the header the members of a quorum
exchange before an exchange (parallel/membership.py TorchftGroups): where each is, its weight,
whether their shapes agree and whether two jobs claim one group id. Pure: two tensors to all-reduce
(one MAX, one SUM) and what to make of them."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from common import ConfigError

# what a category covers, for the line that refuses a group
CATEGORIES = {"model": "model flags (--num-layers, --hidden-size, ...) and ranks per group",
              "outer": "outer settings (--outer-*)",
              "data": "data (--data-path, --split, --seed, --seq-length, --global-batch-size, --tokenizer-*)",
              "groups": "--num-groups"}
SPAN = 2 ** 16   # seniority: rounds * SPAN + (SPAN - 1 - group id), exact in float64


def crc24(text: str) -> int:
    """A 24-bit hash: exact as a float64, and its negation too."""
    return zlib.crc32(text.encode()) & 0xFFFFFF


@dataclass(frozen=True)
class RunShape:
    """category -> what this group says it is (a text; compared through its hash)."""
    parts: dict = field(default_factory=dict)

    def hashes(self) -> list[float]:
        return [float(crc24(self.parts.get(c, ""))) for c in CATEGORIES]

    @property
    def fingerprint(self) -> int:
        return crc24("|".join(self.parts.get(c, "") for c in CATEGORIES))


@dataclass
class Mine:
    """What this group brings to a quorum's header."""
    key: float                 # the largest wins: the exchange the members agree on
    rounds: int                # exchanges committed before this quorum (torchft's step)
    group_id: int
    started: float             # when this job started (wall clock): of two jobs with one id, the later is refused
    shape: RunShape
    extra: list = field(default_factory=list)   # more fields agreed by their maximum


class Header:
    """Two all-reduces over the quorum: `max_vector` (MAX), then `sum_vector` (SUM)."""

    def __init__(self, mine: Mine, size: int, rank: int, num_groups: int):
        self.mine, self.size, self.rank, self.groups = mine, size, rank, num_groups
        self.k, self.e = len(CATEGORIES), len(mine.extra)

    def seniority(self) -> float:
        return float(self.mine.rounds * SPAN + SPAN - 1 - self.mine.group_id)

    def max_vector(self) -> torch.Tensor:
        h = self.mine.shape.hashes()
        slots = [-float("inf")] * self.groups
        slots[self.mine.group_id] = -self.mine.started   # the earliest start of each group id
        return torch.tensor([self.mine.key, self.seniority(), *h, *(-x for x in h), *map(float, self.mine.extra),
                             *slots], dtype=torch.float64)

    def read_max(self, t: torch.Tensor):
        v = t.tolist()
        k, e = self.k, self.e
        self.key, self.senior = v[0], v[1]
        self.hash_max, self.hash_min = v[2:2 + k], [-x for x in v[2 + k:2 + 2 * k]]
        self.extra = v[2 + 2 * k:2 + 2 * k + e]
        self.earliest = [-x for x in v[2 + 2 * k + e:]]
        self.run_rounds = int(self.senior) // SPAN   # the most exchanges any member committed

    def sum_vector(self, tokens: float, counts: bool) -> torch.Tensor:
        n, t = self.size, torch.zeros(2 * self.size + self.groups + self.k, dtype=torch.float64)
        t[self.rank], t[n + self.rank] = tokens if counts else 0.0, float(counts)
        t[2 * n + self.mine.group_id] = 1.0
        if self.seniority() == self.senior:   # the run's shape is the most senior member's
            t[2 * n + self.groups:] = torch.tensor(self.mine.shape.hashes(), dtype=torch.float64)
        return t

    def read_sum(self, t: torch.Tensor):
        v, n = t.tolist(), self.size
        self.tokens, self.counting = v[:n], v[n:2 * n]
        self.claims = v[2 * n:2 * n + self.groups]
        self.reference = v[2 * n + self.groups:]

    def weights(self) -> list[float]:
        """Each member's weight (by its place in the quorum): its share of the tokens of those that
        count, or an equal share among them when none trained any."""
        total, members = sum(self.tokens), sum(self.counting)
        if total > 0:
            return [x / total for x in self.tokens]
        return [c / members if members else 0.0 for c in self.counting]

    def refusal(self) -> ConfigError | None:
        """This group refused (it exits 2 with the line; the others go on): a second job with its
        group id, or a shape that is not the run's."""
        g = self.mine.group_id
        if self.claims[g] > 1 and self.mine.started > self.earliest[g]:
            return ConfigError(f"another job is already group {g} of this run (it started first); this one stops: "
                               f"give each job its own --group-id below --num-groups {self.groups}")
        differ = self.differing()
        if differ and max(self.claims) <= 1:   # (two jobs with one id may both look senior: not judged now)
            return ConfigError(f"this group's {' and '.join(CATEGORIES[c] for c in differ)} differ from the run's "
                               f"(the groups that exchanged the most: {self.run_rounds} exchanges); start it with the "
                               f"same flags as the others")
        return None

    def differing(self) -> list[str]:
        """The categories where my shape is not the run's (empty when every member's agrees)."""
        if self.hash_max == self.hash_min:
            return []
        return [c for c, a, b in zip(CATEGORIES, self.mine.shape.hashes(), self.reference) if a != b]

    def void(self) -> str | None:
        """Why nobody exchanges in this quorum (a member was refused), for the groups that go on."""
        twice = [g for g, n in enumerate(self.claims) if n > 1]
        if twice:
            return f"a second job claimed group {twice[0]}: it was refused, this exchange is skipped"
        if self.hash_max != self.hash_min:
            differ = [c for c, a, b in zip(CATEGORIES, self.hash_max, self.hash_min) if a != b]
            return (f"a group whose {' and '.join(CATEGORIES[c] for c in differ)} differ from the run's was refused; "
                    f"this exchange is skipped")
        return None
