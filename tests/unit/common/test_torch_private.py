"""common/torch_private.py: every private torch attribute the product uses exists and means what
the product assumes, on the torch installed. When torch changes one, a test here fails by name;
a torch outside the releases they were checked against (SUPPORTED, pyproject.toml's range) fails
the first test, and the plug-in refuses it in one line. scripts/test.sh --torch 2.14.1 runs this
file (and the plug-in's tests) on the second release."""
from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from packaging.requirements import Requirement

from common import torch_private as tp
from tests.distributed import run_distributed
from tests.test_structure import ROOT, source_files


def test_the_installed_torch_is_in_the_supported_range():
    assert tp.unsupported(torch.__version__) is None, (
        f"{tp.unsupported(torch.__version__)}: run this file and the plug-in's tests on it "
        f"(scripts/test.sh --torch), check each attribute in its source, then widen SUPPORTED, MOVED and pyproject.toml")


def test_a_release_outside_the_range_is_refused_in_one_line():
    first, last = tp.SUPPORTED
    for inside in (f"{first[0]}.{first[1]}.0", f"{last[0]}.{last[1]}.9+cu130", torch.__version__):
        assert tp.unsupported(inside) is None, inside
    for outside in (f"{first[0]}.{first[1] - 1}.2", f"{last[0]}.{last[1] + 1}.0", f"{last[0] + 1}.0.0+cpu", "1.13.1"):
        line = tp.unsupported(outside)
        assert line is not None and f"torch {outside} is outside {tp.CHECKED}" in line and "\n" not in line, line


def test_pyproject_declares_the_supported_range():
    """pip installs what SUPPORTED says: every release inside, none outside."""
    spec = Requirement(re.search(r'^    "(torch[<>=!~].*?)",', (ROOT / "pyproject.toml").read_text(), re.M)[1]).specifier
    for major, minor in [(1, 13)] + [(2, m) for m in range(0, 30)] + [(3, 0)]:
        inside = tp.SUPPORTED[0] <= (major, minor) <= tp.SUPPORTED[1]
        for patch in (0, 1, 9):
            assert spec.contains(f"{major}.{minor}.{patch}") == inside, (f"{major}.{minor}.{patch}", str(spec))


def test_setup_refuses_a_release_outside_the_range_before_installing():
    for version in ("2.10.0", f"{tp.SUPPORTED[1][0]}.{tp.SUPPORTED[1][1] + 1}.0"):
        venv = ROOT / f".venv-torch{version.rsplit('.', 1)[0]}"
        assert not venv.exists(), venv
        done = subprocess.run(["bash", "scripts/setup.sh", "--torch", version], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and f"torch {version} is outside pyproject.toml" in done.stderr, done.stderr
        assert not venv.exists(), venv


def test_moved_attributes_cover_the_range_once():
    """Each moved attribute says how every supported release reaches it: rows in order, no gap,
    no overlap, none outside the range."""
    for attribute, rows in tp.MOVED.items():
        assert attribute in tp.ATTRIBUTES and rows[0][0] == tp.SUPPORTED[0] and rows[-1][1] == tp.SUPPORTED[1], rows
        for (_, last, _), (first, _, _) in zip(rows, rows[1:]):
            assert first == (last[0], last[1] + 1), (attribute, rows)
        for first, last, name in rows:
            assert first <= last and (name is None or attribute.split(".")[0] + "." + name in tp.ATTRIBUTES), rows
            assert tp.reached(attribute, f"{last[0]}.{last[1]}.0") == name
    assert tp.reached("FSDPState._fsdp_param_groups", "2.11.0") == "_fsdp_param_group"
    assert tp.reached("FSDPParamGroup.reduce_scatter_unused_params", "2.12.1") is None


def test_a_torch_without_an_autograd_attribute_fails_at_import_in_one_line(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    spec = importlib.util.spec_from_file_location("torch_private_copy", tp.__file__)
    with pytest.raises(ImportError) as e:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    message = str(e.value)
    assert "torch._C._current_graph_task_id" in message and f"torch {torch.__version__}" in message, message
    assert "\n" not in message, message


FOREACH = "torch._foreach_"   # torch's documented multi-tensor ops (the optimizers' foreach path), not internals


def test_no_private_torch_attribute_outside_the_one_module():
    """`torch._x`, a listed attribute's name, or an import from a private torch module anywhere
    else in the product: none."""
    found = []
    for mod, path in source_files().items():
        if path == ROOT / "common" / "torch_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                text = ast.unparse(node)
                if text.startswith(FOREACH):
                    continue
                if text.startswith("torch.") or node.attr in {a.rsplit(".", 1)[-1] for a in tp.ATTRIBUTES}:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {text}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch") and (
                    "._" in node.module or any(a.name.startswith("_") for a in node.names)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import ...")
    assert found == []


def test_autograd_attributes():
    seen = {}

    def hook(grad):
        seen["inside"] = tp.in_backward()
        tp.queue_backward_callback(lambda: seen.setdefault("callback", tp.in_backward()))
        return grad
    x = torch.ones(2, requires_grad=True)
    y = (x * 2)
    y.register_hook(hook)
    assert not tp.in_backward()
    y.sum().backward()
    assert seen == {"inside": True, "callback": True}, seen

    def pack(t):
        return t
    assert tp.top_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, pack):
        assert tp.top_saved_tensors_hooks()[0] is pack

    p = nn.Parameter(torch.ones(2))
    assert not tp.has_post_accumulate_grad_hooks(p)
    p.register_post_accumulate_grad_hook(lambda _: None)
    assert tp.has_post_accumulate_grad_hooks(p)


def fsdp_attributes(rank, world):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    out = {}
    group = tp.param_group(model[0])
    params = tp.group_params(group)
    out["params"] = [tp.sharded_param(p) is q for p, q in zip(params, model[0].parameters())]
    out["unsharded_before"] = tp.unsharded_param(params[0]) is None
    out["ranks"] = (tp.post_forward_ranks(group), tp.post_forward_ranks(tp.param_group(model)))
    made: dict = {}
    tp.set_post_forward_ranks(group, 2, made)
    tp.set_post_forward_ranks(tp.param_group(model), 2, made)
    out["set"] = tp.post_forward_ranks(group)
    mesh = tp.post_forward_mesh(group)
    out["one mesh"] = (mesh is tp.post_forward_mesh(tp.param_group(model)), tuple(mesh.mesh.shape), len(made))
    tp.set_post_forward_ranks(tp.param_group(model), 4, made)   # back to the world, as FSDP2 had it
    out["prefetch"] = tp.has_forward_prefetch(model)
    model.set_modules_to_forward_prefetch([model[0]])
    out["prefetch"] = (out["prefetch"], tp.has_forward_prefetch(model))
    tp.set_unshard_async(model, True)
    out["reads"] = [tp.reads_of_reduction(group)]
    model[0].set_all_reduce_hook(lambda t: None)
    model[0].set_gradient_divide_factor(3.0)
    model[0].weight.register_post_accumulate_grad_hook(lambda _: None)
    out["reads"].append(tp.reads_of_reduction(group))
    out["factor"] = tp.divide_factor(group)
    out["unused"] = tp.reduces_unused(group)
    if tp.reached("FSDPParamGroup.reduce_scatter_unused_params", torch.__version__):   # 2.13 on
        model[0].set_reduce_scatter_unused_params(True)
        out["unused"] = (out["unused"], tp.reduces_unused(group))
    out["after_backward"] = tp.reshards_after_backward(group)
    model[0].set_reshard_after_backward(False, recurse=False)
    out["after_backward"] = (out["after_backward"], tp.reshards_after_backward(group))
    model(torch.ones(2, 4))
    u = tp.unsharded_param(params[0])
    out["unsharded_after"] = u is not None and tuple(u.shape) == (4, 4)
    out["root_after"] = tp.post_forward_ranks(tp.param_group(model))
    offloaded = fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(pin_memory=False))
    out["offload"] = tp.reads_of_reduction(tp.param_group(offloaded))
    return out


@pytest.mark.slow
def test_fsdp2_attributes():
    r = run_distributed(fsdp_attributes, 4)[0]
    assert r["params"] == [True, True] and r["unsharded_before"] and r["unsharded_after"], r
    # each reshards to the world until the first forward makes the root keep its weights
    assert r["ranks"] == (4, 4) and r["set"] == 2 and r["root_after"] is None, r
    assert r["one mesh"] == (True, (2, 2), 1), r
    assert r["prefetch"] == (False, True), r
    assert r["reads"] == [[], ["an all-reduce hook", "a gradient divide factor", "a post-accumulate-grad hook"]], r
    unused = (False, True) if tp.reached("FSDPParamGroup.reduce_scatter_unused_params", torch.__version__) else False
    assert r["factor"] == 3.0 and r["unused"] == unused and r["offload"] == ["CPU offload"], r
    assert r["after_backward"] == (True, False), r


def store_attributes(rank, world):
    import torch.distributed as dist
    store = tp.default_store()
    store.set(f"torch_private/{rank}", str(rank))
    dist.barrier()
    return [store.get(f"torch_private/{r}").decode() for r in range(world)]


@pytest.mark.slow
def test_the_default_store_is_every_ranks():
    assert run_distributed(store_attributes, 4) == [["0", "1", "2", "3"]] * 4


def test_every_listed_attribute_is_named_in_the_module():
    text = Path(tp.__file__).read_text()
    body = text.split('"""', 2)[2]
    for attribute in tp.ATTRIBUTES:
        assert attribute.rsplit(".", 1)[-1] in body, attribute


def _refused_without(rank, world, owner: str, name: str):
    import inspect

    from torch.distributed.fsdp import fully_shard

    from zeropp.fsdp import PluginError, apply_zeropp
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    # the root's unit holds model[1]: the one the check looks at; what another torch lacks on every unit
    group, version, annotations = tp.param_group(model), torch.__version__, {}
    try:   # a pooled rank runs the next test too: the class and the version are put back
        if owner == "version":
            torch.__version__ = name   # a release the range leaves out
        elif owner == "declared":   # set only at the first gather: its name is FSDPParam's annotation
            cls = next(c for c in type(group.fsdp_params[0]).__mro__ if name in inspect.get_annotations(c))
            annotations = {cls: cls.__annotations__[name]}
            del cls.__annotations__[name]
        else:
            delattr({"state": tp.fsdp_state(model), "group": group}[owner], name)
        apply_zeropp(model, 1)
    except PluginError as e:
        return str(e)
    finally:
        torch.__version__ = version
        for cls, annotation in annotations.items():
            cls.__annotations__[name] = annotation
    return None


@pytest.mark.slow
def test_another_torch_without_a_listed_attribute_is_refused_in_one_line():
    """A renamed attribute, even one FSDP2 sets only later (the gathered parameter, whose absence
    before the first gather is no sign), and a release outside the range: one line, before
    anything is changed."""
    last = tp.SUPPORTED[1]
    for owner, name, label in (("state", "_states_to_forward_prefetch", "lacks FSDPState._states_to_forward_prefetch"),
                               ("group", "_all_reduce_hook", "lacks FSDPParamGroup._all_reduce_hook"),
                               ("declared", "_unsharded_param", "lacks FSDPParam._unsharded_param"),
                               ("version", f"{last[0]}.{last[1] + 1}.0", f"{last[0]}.{last[1] + 1}.0 is outside")):
        message = run_distributed(_refused_without, 1, args=(owner, name))[0]
        assert message is not None and label in message and "\n" not in message, message
        assert message.startswith("apply_zeropp: torch ") and tp.CHECKED in message, message


# -- HSDP -------------------------------------------------------------------------------------------
def hsdp_attributes(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = fully_shard(nn.Linear(4, 4), mesh=mesh)
    group = tp.param_group(model)
    out = {"missing": tp.hsdp_internals_problem(group),
           "replicate": dist.get_process_group_ranks(tp.replicate_group(group)), "on": tp.replica_all_reduce_on(group)}
    model.set_requires_all_reduce(False)
    out["on"] = (out["on"], tp.replica_all_reduce_on(group))
    seen, inner = [], tp.replicate_group(group)

    class Seen(dist.ProcessGroup):   # what FSDP2 all-reduces over once set
        def allreduce(self, tensors, opts=None):
            seen.append(tuple(tensors[0].shape))
            return inner.allreduce(tensors, opts)
    tp.set_replicate_group(group, Seen(inner.rank(), inner.size()))
    model.set_requires_all_reduce(True)
    model(torch.ones(2, 4)).sum().backward()
    out["seen"] = seen
    out["plain"] = tp.hsdp_internals_problem(tp.param_group(fully_shard(nn.Linear(4, 4))))
    # a pooled rank's next body: an equal mesh over new groups (tests/unit/fsdp/test_fsdp_hsdp.py needs this)
    tp.forget_dtensor_plans()
    return out


def test_hsdp_attributes():
    r = run_distributed(hsdp_attributes, 4)[0]
    assert r["missing"] is None and r["replicate"] == [0, 2] and r["on"] == (True, False), r
    assert r["seen"] == [(10,)], r   # the weight's 2 rows of 4 and the bias's 2, one all-reduce per unit
    assert "lacks HSDPMeshInfo.replicate_process_group" in r["plain"] and tp.CHECKED in r["plain"], r


def an_hsdp_weight_gathered(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return fully_shard(nn.Linear(4, 4), mesh=mesh).weight.full_tensor().shape == (4, 4)


def test_pooled_ranks_forget_dtensors_plans_with_their_groups():
    """DeviceMesh equality ignores process groups: without forget_dtensor_plans (scenarios/harness/spawn.py calls
    it between bodies) the second body's FSDP2 parameters come out on the first body's destroyed groups."""
    for _ in range(2):
        assert run_distributed(an_hsdp_weight_gathered, 4) == [True] * 4
