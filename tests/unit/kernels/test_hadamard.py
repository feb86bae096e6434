"""Hadamard smoothing of qgZ's INT4 gradient blocks (`zero_hadamard_gradients`,
zeropp/kernels/hadamard.py): the transform against an explicit Hadamard matrix, its inverse, the
Triton kernel bit for bit against the torch path, the configuration, the collective's
error (within the INT4 bound, smaller than without on blocks with outliers), error
feedback in the rotated domain and its checkpoint layout, and training.

The Triton kernel runs on CPU tensors under Triton's interpreter on machines without CUDA
(tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import zeropp
from common import ConfigError
from parallel.comm import Communicator
from parallel.topology import Topology
from tests.distributed import run_distributed
from tests.unit.zeropp.test_zeropp import ARGS, QGZ, int4_bound
from tests.unit.zeropp.test_zeropp_loco import LOCO, ZERO3_TRAINING_TOLERANCE, train
from zeropp.kernels import hadamard as hd
from zeropp.techniques.error_feedback import ErrorFeedback
from zeropp.techniques.loco import CompensatedReduce
from zeropp.collectives.partition import Partition
from zeropp.techniques.qgz import HierarchicalQuantizedReduce

_CUDA = torch.cuda.is_available()

HADAMARD = {**QGZ, "zero_hadamard_gradients": True}
U = 2.0 ** -24   # fp32 unit roundoff


def sylvester(b: int) -> torch.Tensor:
    """H_b in fp64: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]] (Kronecker with H_2)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.kron(h2, h)
    return h


def gamma(b: int) -> float:
    """Each output of one pass is a sum of b terms added in a tree of depth log2(b): its fp32
    error is at most gamma_k * sum|x| over the block, gamma_k = k u / (1 - k u), k = log2(b)."""
    k = int(math.log2(b))
    return k * U / (1 - k * U)


def block_abs_sums(x: torch.Tensor, b: int) -> torch.Tensor:
    """sum|x| of each element's block, per element."""
    return x.double().abs().view(-1, b).sum(1).repeat_interleave(b)


# --------------------------------------------------------------------------------------
# the transform (torch path)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("b", [2, 4, 8, 128, 256])
def test_torch_path_is_the_block_diagonal_hadamard_matrix(b):
    x = torch.randn(5 * b, generator=torch.Generator().manual_seed(b)) * torch.logspace(-3, 3, 5 * b)
    got = hd.hadamard(x.clone(), b, backend="torch")
    exact = (x.double().view(-1, b) @ sylvester(b).T).reshape(-1)
    assert (got.double() - exact).abs().le(gamma(b) * block_abs_sums(x, b)).all()


@pytest.mark.parametrize("b", [2, 8, 128])
def test_inverse_undoes_forward_within_two_passes_of_rounding(b):
    """inverse(forward(x)) - x: the forward's error (gamma S per element) goes through H / b
    (at most its mean over the block), the second pass adds gamma sum|y| / b <= gamma S (1 + gamma):
    at most 2 gamma S (1 + gamma) per element, S = sum|x| over the block."""
    x = torch.randn(7 * b, generator=torch.Generator().manual_seed(1))
    back = hd.hadamard(hd.hadamard(x.clone(), b, backend="torch"), b, inverse=True, backend="torch")
    g = gamma(b)
    assert (back.double() - x.double()).abs().le(2 * g * (1 + g) * block_abs_sums(x, b)).all()
    # on integers the sums are exact: the round trip is exact
    ints = torch.randint(-1000, 1000, (7 * b,), generator=torch.Generator().manual_seed(2)).float()
    assert torch.equal(hd.hadamard(hd.hadamard(ints.clone(), b), b, inverse=True), ints)


@pytest.mark.parametrize("b", [4, 8])   # an even and an odd number of stages
def test_chunks_out_and_in_place_give_the_same_bits(monkeypatch, b):
    x = torch.randn(96 * b, generator=torch.Generator().manual_seed(3))
    whole = hd.hadamard(x.clone(), b, backend="torch")
    into = torch.empty_like(x)
    assert hd.hadamard(x, b, out=into, backend="torch") is into and torch.equal(into, whole)
    monkeypatch.setattr(hd, "_CHUNK", 5 * b)   # chunks of 5 blocks, the last one short
    assert torch.equal(hd.hadamard(x.clone(), b, backend="torch"), whole)
    assert torch.equal(hd.hadamard(x, b, out=torch.empty_like(x), backend="torch"), whole)


def test_refuses_what_it_cannot_transform():
    with pytest.raises(ValueError, match="power of two"):
        hd.hadamard(torch.zeros(12), 12)
    with pytest.raises(ValueError, match="not whole blocks"):
        hd.hadamard(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="fp32"):
        hd.hadamard(torch.zeros(8, dtype=torch.bfloat16), 4)
    with pytest.raises(ValueError, match="out must be"):
        hd.hadamard(torch.zeros(8), 4, out=torch.zeros(4))


# --------------------------------------------------------------------------------------
# Triton == torch, bit for bit (tests/unit/kernels/test_quant.py's standard)
# --------------------------------------------------------------------------------------
_TRITON_SKIP = None
try:
    from triton.runtime.interpreter import InterpretedFunction

    from zeropp.kernels import triton_hadamard as ht
    if not _CUDA and not isinstance(ht._hadamard_kernel, InterpretedFunction):
        _TRITON_SKIP = "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)"
except ImportError as e:
    _TRITON_SKIP = f"triton not importable: {e}"
needs_triton = pytest.mark.skipif(_TRITON_SKIP is not None, reason=str(_TRITON_SKIP))
_DEV = "cuda" if _CUDA else "cpu"


def _same_bits(a: torch.Tensor, b: torch.Tensor):
    """Equal bits, NaN for NaN (a NaN's payload and sign may differ between hardware)."""
    a, b = a.cpu(), b.cpu()
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@needs_triton
@pytest.mark.parametrize("b", [2, 4, 64, 128, 256])
@pytest.mark.parametrize("blocks", [1, 3, 17])
@pytest.mark.parametrize("inverse", [False, True])
def test_triton_gives_the_torch_paths_bits(b, blocks, inverse):
    g = torch.Generator().manual_seed(b * blocks)
    x = torch.randn(blocks * b, generator=g) * torch.exp(torch.randn(blocks * b, generator=g) * 4)
    ref = hd.hadamard(x.clone(), b, inverse=inverse, backend="torch")
    _same_bits(hd.hadamard(x.clone().to(_DEV), b, inverse=inverse, backend="triton"), ref)
    out = torch.empty(blocks * b, device=_DEV)
    _same_bits(hd.hadamard(x.clone().to(_DEV), b, inverse=inverse, out=out, backend="triton"), ref)


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter's numpy on inf - inf, overflow
def test_triton_special_values_as_torch():
    b = 64
    x = torch.randn(6 * b, generator=torch.Generator().manual_seed(9))
    x[:b] = 0.0                       # an all-zero block
    x[b + 3] = float("inf")           # inf: the block turns to inf and NaN (inf - inf)
    x[2 * b + 5] = float("-inf")
    x[3 * b + 7] = float("nan")       # NaN spreads over its block
    x[4 * b:4 * b + 4] = 3e38         # finite input whose sums overflow to inf
    x[5 * b:6 * b] = 1e-44            # subnormals
    for inverse in (False, True):
        ref = hd.hadamard(x.clone(), b, inverse=inverse, backend="torch")
        _same_bits(hd.hadamard(x.clone().to(_DEV), b, inverse=inverse, backend="triton"), ref)
    fwd = hd.hadamard(x.clone(), b)
    assert torch.all(fwd[:b] == 0) and torch.isnan(fwd[3 * b:4 * b]).all() and torch.isinf(fwd[4 * b]).item()


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------
def _zero(**zero):
    return zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, **zero}}).zero_optimization


def test_switch_parsed_default_off():
    assert _zero().zero_hadamard_gradients is False
    assert _zero(**HADAMARD).zero_hadamard_gradients is True


@pytest.mark.parametrize("zero, message", [
    ({"zero_hadamard_gradients": True}, "zero_hadamard_gradients .*set zero_quantized_gradients true"),
    ({"zero_quantized_gradients": "auto", "zero_hadamard_gradients": True}, "set zero_quantized_gradients true"),
    ({**HADAMARD, "stage": 2}, "zero_hadamard_gradients \\(ZeRO\\+\\+\\) need stage 3"),
    ({**HADAMARD, "zero_quantized_gradients_block_size": 96},
     "zero_quantized_gradients_block_size must be a power of two >= 8 .*got 96; the default is 128"),
    ({**HADAMARD, "zero_hadamard_gradients": 1}, "zero_hadamard_gradients"),
    ({**QGZ, "zero_hadamard_gradient": True}, "did you mean 'zero_hadamard_gradients'"),
])
def test_switch_refused_with_a_reason(zero, message):
    with pytest.raises(ConfigError, match=message):
        _zero(**zero)


def test_zero_hadamard_gradients_flag(monkeypatch):
    from training.args import parse_args
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    zero = parse_args(ARGS + ["--zero-stage", "3", "--zero-quantized-gradients", "--zero-hadamard-gradients"]
                      ).ds_config.zero_optimization
    assert zero.zero_hadamard_gradients is True
    assert parse_args(ARGS + ["--zero-stage", "3"]).ds_config.zero_optimization.zero_hadamard_gradients is False
    with pytest.raises(ConfigError, match="zero_quantized_gradients"):
        parse_args(ARGS + ["--zero-stage", "3", "--zero-hadamard-gradients"])


# --------------------------------------------------------------------------------------
# the collective
# --------------------------------------------------------------------------------------
def rotated(rows: torch.Tensor, b: int) -> torch.Tensor:
    """fp64 H of each row [k, total], padded with zeros to whole blocks: what qgZ quantizes."""
    padded = -(-rows.shape[1] // b) * b
    x = F.pad(rows.double(), (0, padded - rows.shape[1]))
    return (x.view(rows.shape[0], -1, b) @ sylvester(b).T).view(rows.shape[0], padded)


def outlier_rows(shape, b, seed, outlier):
    """N(0, 1) gradients with, in each block of `b`, one element of size `outlier`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    flat = x.view(-1, shape[-1])
    for j in range(0, shape[-1], b):
        pos = torch.randint(j, min(j + b, shape[-1]), (flat.shape[0],), generator=g)
        flat[torch.arange(flat.shape[0]), pos] = outlier * torch.sign(torch.randn(flat.shape[0], generator=g))
    return x


def hadamard_collective(rank, world_size, locals_):
    out = {}
    for local in locals_:
        topo = Topology(world_size, rank, local).build_groups()
        out[local] = one_layout(Communicator(topo), rank, world_size, local)
    return out


def one_layout(comm, rank, world_size, local):
    part, b = Partition(None, world_size, rank), 128
    out = {}
    for total in (1, 200, 1000):
        every = outlier_rows((world_size, world_size, total), b, total, 30.0) * 0.01
        sent = every[:, rank]
        exact = sent.double().sum(0)
        errs = {}
        for name, on in (("plain", False), ("hadamard", True)):
            mine = torch.empty(total)
            HierarchicalQuantizedReduce(comm, b, hadamard=on).start(every[rank].clone(), mine, part,
                                                                     "grad_reduce").wait()
            errs[name] = (mine.double() - exact).abs()
        # the INT4 bound of what is quantized (the rotated rows), a constant per block; H / b
        # maps a block's errors to at most their mean, so it bounds the result too; plus the
        # fp32 rounding of the forward (each row) and the inverse: 3 gamma sum_r sum|x_r| per block
        bound = int4_bound(rotated(sent, b).float(), world_size // local, local, b).double()[:total]
        padded = F.pad(sent.double().abs(), (0, -(-total // b) * b - total))
        slack = 3 * gamma(b) * block_abs_sums(padded.sum(0), b)[:total] + 1e-7
        out[total] = dict(worst=float((errs["hadamard"] / (bound + slack)).max()),
                          plain=float(errs["plain"].mean()), hadamard=float(errs["hadamard"].mean()))
    # Gaussian gradients, no outliers: a rotation of Gaussian blocks is Gaussian, about the same error
    every = torch.randn(world_size, world_size, 1000, generator=torch.Generator().manual_seed(5))
    for name, on in (("plain", False), ("hadamard", True)):
        mine = torch.empty(1000)
        HierarchicalQuantizedReduce(comm, b, hadamard=on).start(every[rank].clone(), mine, part, "grad_reduce").wait()
        out[f"gaussian_{name}"] = float((mine - every[:, rank].sum(0)).abs().mean())
    return out


def test_qgz_with_hadamard_sums_within_the_int4_bound_and_beats_plain_on_outliers():
    """2 nodes x 2, 4 nodes x 1 (inter hop only), 1 node x 4 (intra hop only). One element of
    30 sigma per block of 128: plain qgZ's scale is 30/7 sigma, so most of the block rounds to
    0 (an error of about sigma each); rotated, the outlier is +-30 sigma in every element on
    top of N(0, 128 sigma^2) (11.3 sigma), a scale of about (30 + 3 x 11.3)/7 = 9 sigma in the
    rotated domain, whose error comes back divided by sqrt(128): about 0.26 sigma."""
    for per_rank in run_distributed(hadamard_collective, 4, args=([2, 1, 4],)):
        for local, r in per_rank.items():
            for total in (1, 200, 1000):
                assert r[total]["worst"] <= 1.0, (local, total, r)
            for total in (200, 1000):
                assert r[total]["hadamard"] < 0.5 * r[total]["plain"], (local, total, r)
            assert r["gaussian_hadamard"] < 1.5 * r["gaussian_plain"], (local, r)


def loco_hadamard_reductions(rank, world_size, steps):
    """tests/unit/zeropp/test_zeropp_loco.py's repeated reductions, rotated: what the error feedback does
    in the rotated domain still adds up over steps."""
    topo = Topology(world_size, rank, 2).build_groups()
    comm = Communicator(topo)
    every = outlier_rows((world_size, world_size, 1000), 128, 3, 8.0)
    exact = every[:, rank].sum(0)
    out = {}
    for name, feedback in (("plain", None), ("loco", ErrorFeedback(0.0, 1024, hadamard=128))):
        reduce = (CompensatedReduce(comm, 128, feedback, hadamard=True) if feedback
                  else HierarchicalQuantizedReduce(comm, 128, hadamard=True))
        total, first = torch.zeros(1000), None
        for _ in range(steps):
            mine = torch.empty(1000)
            reduce.start(every[rank].clone(), mine, Partition(None, world_size, rank), "grad_reduce", key=7).wait()
            total += mine
            first = float((mine - exact).abs().mean()) if first is None else first
        out[name] = dict(first=first, drift=float((total - steps * exact).abs().mean()))
        if feedback is not None:
            out["buffers"] = {k: tuple(v.shape) for k, v in feedback.errors().items()}
    return out


def test_error_feedback_works_in_the_rotated_domain():
    steps = 20
    for r in run_distributed(loco_hadamard_reductions, 4, args=(steps,)):
        plain, loco = r["plain"], r["loco"]
        assert plain["drift"] > 0.5 * steps * plain["first"], r
        assert loco["drift"] < 1.5 * plain["first"], r
        assert r["buffers"] == {7: (2, 1024)}   # rotated rows: 1000 padded to whole blocks of 128


def test_error_feedback_layout_records_the_rotation():
    def feedback(block):
        ef = ErrorFeedback(0.8, 10)
        ef.hadamard = block
        ef.expect({0: (2, 100)}, world=4, nodes=2, device="cpu")
        return ef
    plain, rot = feedback(0), feedback(128)
    assert plain.layout == {"world": 4, "nodes": 2, "shapes": {"0": [2, 100]}}   # as before the switch
    assert rot.layout["hadamard"] == 128 and rot.shapes == {0: (2, 128)}
    assert rot.carried(feedback(128).scalar_state())
    for saved, now in ((plain, rot), (rot, plain)):
        now.buffers[0] = torch.ones(now.shapes[0])
        note = now.load_scalar_state(saved.scalar_state())
        assert not now.carried(saved.scalar_state()) and now.buffers[0].abs().sum() == 0
        assert "starts from zero" in note and "zero_hadamard_gradients" in note
    assert "saved not rotated (zero_hadamard_gradients), now rotated by Hadamard blocks of 128" in \
        rot.load_scalar_state(plain.scalar_state())


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------
def train_all(rank, world_size):
    return {name: train(rank, world_size, zero) for name, zero in
            (("zero3", {}), ("qgz", QGZ), ("hadamard", HADAMARD), ("loco", {**LOCO, "zero_hadamard_gradients": True}))}


@pytest.mark.slow
def test_hadamard_trains_like_zero3_and_sends_what_qgz_sends():
    runs = run_distributed(train_all, 4)
    base = runs[0]["zero3"]["losses"]
    assert base[-1] < base[0] - 0.3   # it learns
    per_step, last4 = ZERO3_TRAINING_TOLERANCE
    for name in ("hadamard", "loco"):
        losses = runs[0][name]["losses"]
        for a, b in zip(losses, base):
            assert abs(a - b) <= per_step * b, (name, losses, base)
        assert abs(sum(losses[-4:]) - sum(base[-4:])) <= last4 * sum(base[-4:]), (name, losses, base)
        assert losses != runs[0]["qgz"]["losses"]   # the rotation changed what was sent
    for r in runs:
        assert r["hadamard"]["inter"] == r["qgz"]["inter"] == r["loco"]["inter"]   # the same bytes
        for name in ("hadamard", "loco"):
            assert all(r[name]["pools_within_bounds"].values()), (name, r[name]["pools_within_bounds"])
