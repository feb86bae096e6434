"""common/torchft_private.py: every private torchft attribute the product touches exists and
means what the product assumes, on the torchft installed; none is touched anywhere else."""
from __future__ import annotations

import ast
import inspect
from datetime import timedelta
from importlib.metadata import version

import pytest

from common import torchft_private as ftp
from tests.test_structure import ROOT, source_files



def torchft_manager():
    """torchft.manager, imported in the test that needs it, not at collection: torchft imports
    Triton, which must not be imported before tests/conftest.py sets TRITON_INTERPRET."""
    return pytest.importorskip("torchft.manager")


def test_checked_against_the_installed_torchft():
    torchft_manager()
    assert version("torchft") == ftp.CHECKED_TORCHFT, (
        f"torchft {version('torchft')} is installed; common/torchft_private.py was checked against "
        f"{ftp.CHECKED_TORCHFT}: run this file, check each attribute, then update CHECKED_TORCHFT")


def test_a_failed_quorum_is_kept_in_quorum_future_and_re_raised_by_the_next_start():
    """What forget_failed_quorum undoes: start_quorum waits on the last quorum's future first
    (re-raising its failure), then stores the new one in `_quorum_future`."""
    source = inspect.getsource(torchft_manager().Manager.start_quorum)
    wait = source.index("self._quorum_future.result()")
    store = source.index("self._quorum_future = self._executor.submit(")
    assert wait < store


def test_forget_failed_quorum_clears_it():
    class Stub:
        _quorum_future = object()
    m = Stub()
    ftp.forget_failed_quorum(m)
    assert m._quorum_future is None


def test_no_private_torchft_attribute_outside_the_one_module():
    names = {a.rsplit(".", 1)[-1] for a in ftp.ATTRIBUTES}
    found = []
    for mod, path in source_files().items():
        if path == ROOT / "common" / "torchft_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_a_process_group_is_made_in_configure_with_the_wrappers_timeout():
    """What gloo_within relies on: configure makes the backend through `_create_pg`, after the
    store client, and `_create_pg` hands gloo `self._timeout`."""
    pg_module = pytest.importorskip("torchft.process_group")
    configure = inspect.getsource(pg_module.ProcessGroupWrapper.configure)
    assert configure.index("create_store_client(") < configure.index("self._create_pg(")
    assert "BaseProcessGroupGloo(store, rank, world_size, self._timeout)" in inspect.getsource(
        pg_module.ProcessGroupGloo._create_pg)


def test_gloo_within_connects_on_a_fifth_of_the_timeout_and_gives_collectives_all_of_it(monkeypatch):
    """The connection's part (gloo waits GLOO_CONNECT_WAITS of it for a first connection:
    tests/unit/parallel/test_membership_cut.py shows it under a cut link); the collectives' timeout is the whole."""
    import torch
    import torch.distributed as dist
    pg_module = pytest.importorskip("torchft.process_group")
    made, gloo = [], pg_module.BaseProcessGroupGloo

    def backend(store, rank, world_size, timeout):
        made.append((timeout, gloo(store, rank, world_size, timeout)))
        return made[-1][1]
    monkeypatch.setattr(pg_module, "BaseProcessGroupGloo", backend)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    pg = ftp.gloo_within(timedelta(seconds=10))
    pg.configure(f"127.0.0.1:{store.port}/q1", "r0", 0, 1)
    assert [t for t, _ in made] == [timedelta(seconds=10) / ftp.GLOO_CONNECT_WAITS]
    assert made[0][1].options._timeout == timedelta(seconds=10)
    t = torch.ones(2)
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    assert t.tolist() == [1.0, 1.0]
