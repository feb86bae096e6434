"""Session-wide: the pooled rank processes of tests/distributed.py end with the session; a test
that uses a fixture which trains on several ranks or launches train.py is slow, as the fixture is."""
import pytest

from common import forget_notes
from scenarios.harness import spawn

# module fixtures that train (several ranks, or a train.py process) before their tests read the result
SLOW_FIXTURES = {"runs", "short_run_done", "saved_4_ranks_stage3", "checkpoint"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    spawn.close_pools()


@pytest.fixture(autouse=True)
def _fresh_notes():
    """Each test hears its own notes (a note is printed once per process)."""
    forget_notes()
