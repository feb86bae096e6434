"""Two collectives in a row, the second started once the first is done: the shape of
qgZ's hierarchical reduction (inside the node, then across: zeropp/techniques/qgz.py and
loco.py) and of the INT4 weight deltas' gather (across, then inside the hpZ group:
zeropp/techniques/deltas.py)."""
from __future__ import annotations

from typing import Callable

from parallel.comm import Work


class TwoHops(Work):
    """`second()` starts the second collective once `first` is done; its result is the result.
    The second starts on `start_second()` (a caller that must keep hops in issue order), on
    `progress()` once the first has completed (the gradient reducer calls it as each gradient
    comes in, so qgZ's second hop starts while backward goes on), or in `wait()`."""

    def __init__(self, first: Work, second: Callable[[], Work]):
        super().__init__()
        self._first, self._start_second = first, second
        self._second: Work | None = None

    def start_second(self):
        if self._second is None:
            self._first.wait()
            self._second = self._start_second()

    def progress(self) -> bool:
        """Either hop may itself be several (HSDP's replica reduction: the hop inside the node, then
        qgZ's hop across, then the gather): each is advanced in turn."""
        if self._second is None:
            if not self._first.progress():
                return False
            self.start_second()
        return self._second.progress()

    def is_completed(self) -> bool:
        return self._second is not None and self._second.is_completed()

    def wait(self):
        self.start_second()
        return self._second.wait()
