"""Session-wide: the pooled rank processes of tests/distributed.py end with the session."""
import pytest

from parallel import spawn


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    spawn.close_pools()
