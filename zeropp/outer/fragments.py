"""Where streaming DiLoCo's fragments (zeropp/outer/diloco.py) lie in a rank's fp32 masters: the
rank's shard (its owned masters, in order) cut into F runs of equal bytes. A run may start or
end inside a parameter; the rank that holds the same shard in every other group cuts it the same."""
from __future__ import annotations

import torch


def fragment_bounds(owned: int, fragments: int) -> list[int]:
    """Where `owned` elements are cut into `fragments` runs of equal size (the first ones one
    element shorter when it does not divide)."""
    return [f * owned // fragments for f in range(fragments + 1)]


class FragmentLayout:
    def __init__(self, shards, fragments: int, device: torch.device):
        self.shards, self.device = shards, device
        self.owned = [s for s in shards if s.valid]
        self.bounds = fragment_bounds(sum(s.valid for s in self.owned), fragments)

    def views(self, flat: torch.Tensor | None) -> "FragmentViews | None":
        """Each fragment's part of `flat` (a tensor over my shard), as views."""
        return None if flat is None else FragmentViews(flat, self.bounds)

    def per_parameter(self, flat: torch.Tensor):
        """(shard, its part of `flat`, a view) for every parameter, empty where I own none of it."""
        off, empty = 0, torch.zeros(0, device=self.device)
        for s in self.shards:
            yield s, flat[off:off + s.valid] if s.valid else empty
            off += s.valid

    def pieces(self, f: int):
        """Fragment `f` as (shard, start, end): the runs of owned masters' elements it covers."""
        a, b, off = self.bounds[f], self.bounds[f + 1], 0
        for s in self.owned:
            lo, hi = max(a - off, 0), min(b - off, s.valid)
            if lo < hi:
                yield s, lo, hi
            off += s.valid

    def local(self, f: int) -> torch.Tensor:
        """My group's values of fragment `f` (a copy)."""
        ms = [s.master.detach().reshape(-1)[lo:hi] for s, lo, hi in self.pieces(f)]
        return torch.cat(ms) if ms else torch.zeros(0, device=self.device)

    def local_all(self) -> torch.Tensor:
        """My group's values of every fragment, in order (a copy of my whole shard of masters)."""
        ms = [s.master.detach().reshape(-1)[:s.valid] for s in self.owned]
        return torch.cat(ms) if ms else torch.zeros(0, device=self.device)

    def set_all(self, values: torch.Tensor):
        """Every fragment's masters <- `values` (over my whole shard, `local_all`'s order)."""
        off = 0
        with torch.no_grad():
            for s in self.owned:
                s.master.view(-1)[:s.valid].copy_(values[off:off + s.valid])
                off += s.valid

    def per_fragment(self, values: torch.Tensor) -> torch.Tensor:
        """[F, values.shape[1:]] sums of `values` [owned, ...] over each fragment's elements."""
        lengths = torch.tensor([b - a for a, b in zip(self.bounds, self.bounds[1:])], device=values.device)
        ids = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths)
        return torch.zeros(len(lengths), *values.shape[1:], dtype=values.dtype,
                           device=values.device).index_add_(0, ids, values)

    def elementwise(self, flags: torch.Tensor) -> torch.Tensor:
        """Each fragment's flag [F] repeated over its elements [owned]."""
        lengths = torch.tensor([b - a for a, b in zip(self.bounds, self.bounds[1:])], device=flags.device)
        return torch.repeat_interleave(flags, lengths)

    def set(self, f: int, keep: float, values: torch.Tensor):
        """Fragment `f`'s masters <- keep * masters + (1 - keep) * `values`."""
        off = 0
        with torch.no_grad():
            for s, lo, hi in self.pieces(f):
                part, mine = values[off:off + hi - lo], s.master.view(-1)[lo:hi]
                mine.mul_(keep).add_(part, alpha=1.0 - keep) if keep else mine.copy_(part)
                off += hi - lo


class FragmentViews:
    """Fragment f's part of a flat tensor over the shard as `views[f]`, made when asked (F may be
    large: a view per fragment of several tensors would be a lot of objects)."""

    def __init__(self, flat: torch.Tensor, bounds: list[int]):
        self.flat, self.bounds = flat, bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, f: int) -> torch.Tensor:
        if not 0 <= f < len(self):
            raise IndexError(f)
        return self.flat[self.bounds[f]:self.bounds[f + 1]]

    def numels(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]


class StepsSince:
    """Inner steps trained since each fragment's last exchange, `since[f]`, with one count per step
    (not one per fragment: F may be large)."""

    def __init__(self, fragments: int):
        self.fragments, self.total, self.at = fragments, 0, {}

    def __getitem__(self, f: int) -> int:
        return self.total - self.at.get(f, 0)

    def __setitem__(self, f: int, value: int):
        self.at[f] = self.total - value

    def tick(self):
        self.total += 1

    def reset(self):
        self.total, self.at = 0, {}

    def as_list(self) -> list[int]:
        return [self[f] for f in range(self.fragments)]

    def load(self, counts: list[int]):
        self.total = max(counts, default=0)
        self.at = {f: self.total - n for f, n in enumerate(counts) if n != self.total}
