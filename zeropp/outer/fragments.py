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

    def views(self, flat: torch.Tensor | None) -> list[torch.Tensor] | None:
        """Each fragment's part of `flat` (a tensor over my shard), as views."""
        return None if flat is None else [flat[a:b] for a, b in zip(self.bounds, self.bounds[1:])]

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

    def set(self, f: int, keep: float, values: torch.Tensor):
        """Fragment `f`'s masters <- keep * masters + (1 - keep) * `values`."""
        off = 0
        with torch.no_grad():
            for s, lo, hi in self.pieces(f):
                part, mine = values[off:off + hi - lo], s.master.view(-1)[lo:hi]
                mine.mul_(keep).add_(part, alpha=1.0 - keep) if keep else mine.copy_(part)
                off += hi - lo
