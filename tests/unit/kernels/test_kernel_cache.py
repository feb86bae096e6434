"""zeropp.kernels.cache, through the CPU quantization kernels: a bad file in the cache (truncated,
empty, another library, a manifest that does not match) is found before it is mapped and rebuilt
with one warning, and the rebuilt kernels give the torch path's bits; a cache other users can
write is refused with one line; the lock is never opened through a link; one of several ranks
starting at once builds; a build reaches the disk before its name does."""
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from common import ConfigError
from tests.integration.train.test_train import corpus, flags  # noqa: F401  (corpus is a fixture)
from zeropp.kernels import cache as kernel_cache, cpu_quant as quant_cpu
from tests import REPO

ROOT = str(REPO)
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
pytestmark = needs_cc

# One rank: load the kernels, say what was warned, compare them with the torch path.
CHECK = """
    import warnings, torch
    from common import ConfigError
    from zeropp.kernels import quant, cpu_quant as quant_cpu
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            ok = quant_cpu.available()
        except ConfigError as e:
            print("refused:", e)
            raise SystemExit(2)
    for m in w:
        print("warning:", m.message)
    assert ok, quant_cpu.why_not()
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 3
    for bits in (8, 4):
        ref, got = quant.quantize(x, bits, 64, backend="torch"), quant.quantize(x, bits, 64, backend="cpu")
        assert torch.equal(ref.data, got.data) and torch.equal(ref.scales.view(torch.int32), got.scales.view(torch.int32))
        assert torch.equal(quant.dequantize(ref, torch.float32, backend="torch"),
                           quant.dequantize(got, torch.float32, backend="cpu"))
    print("same bits")
    """

# Another library with the kernels' symbols, whose scales no real quantization gives.
OTHER_C = r"""
#include <stdint.h>
int zq_max_block(void) { return 4096; }
void zq_quantize(const void *x, int dtype, int64_t numel, int bits, int64_t bs, void *data, float *scales) {
    for (int64_t i = 0; i < (numel + bs - 1) / bs; i++) scales[i] = -1.0f;
}
void zq_dequantize(void) {}
"""


def _popen(cache, env=(), code=CHECK, cwd=ROOT):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, text=True,
                            env={**os.environ, "ZEROPP_CACHE_DIR": str(cache), "PYTHONPATH": ROOT, **dict(env)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(cache, env=(), code=CHECK, cwd=ROOT):
    p = _popen(cache, env, code, cwd)
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def _one(cache, pattern):
    found = list(cache.glob(pattern))
    assert len(found) == 1, (pattern, sorted(p.name for p in cache.iterdir()))
    return found[0]


def _other_library(tmp_path):
    src = tmp_path / "other.c"
    src.write_text(OTHER_C)
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", str(src), "-o", str(tmp_path / "other.so")],
                   check=True)
    return tmp_path / "other.so"


@pytest.fixture(scope="module")
def good_cache(tmp_path_factory):
    """A cache with the kernels built once; each test corrupts its own copy."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    rc, out, err = _run(cache)
    assert rc == 0 and "same bits" in out and "warning:" not in out, out + err
    return cache


@pytest.fixture
def cache(good_cache, tmp_path):
    dst = tmp_path / "cache"
    shutil.copytree(good_cache, dst)
    return dst


def _corrupt(how, cache, tmp_path):
    so, manifest = _one(cache, "*.so"), cache / "none"
    if "manifest" in how or "matches" in how:
        manifest = _one(cache, "*.json")
    if how == "truncated":            # mapped, this is a SIGBUS in every rank
        so.write_bytes(so.read_bytes()[:so.stat().st_size // 2])
    elif how == "empty":              # fails to load: every run on the torch path
        so.write_bytes(b"")
    elif how == "another library":    # loads, and quantizes wrong
        shutil.copyfile(_other_library(tmp_path), so)
    elif how == "a link to another library":
        so.unlink()
        os.symlink(_other_library(tmp_path), so)
    elif how == "no manifest":        # a crash between the library's rename and the manifest's
        manifest.unlink()
    elif how in ("manifest of other inputs", "manifest of other bytes"):
        m = json.loads(manifest.read_text())
        m["key" if how == "manifest of other inputs" else "sha256"] = "0" * 64
        manifest.write_text(json.dumps(m))
    elif how == "matches but fails to load":
        so.write_bytes(b"not an ELF file\n" * 64)
        m = json.loads(manifest.read_text())
        m["sha256"] = hashlib.sha256(so.read_bytes()).hexdigest()
        manifest.write_text(json.dumps(m))
    return so


@pytest.mark.parametrize("how", ["truncated", "empty", "another library", "a link to another library", "no manifest",
                                 "manifest of other inputs", "manifest of other bytes", "matches but fails to load"])
@pytest.mark.slow
def test_a_bad_library_is_found_before_it_is_mapped_and_rebuilt(how, cache, tmp_path):
    so = _corrupt(how, cache, tmp_path)
    rc, out, err = _run(cache)
    assert rc == 0, f"rc {rc}\n{out}{err}"            # -7: SIGBUS
    assert "same bits" in out, out + err
    warned = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and str(so) in warned[0] and "removed it and rebuilt it" in warned[0], out
    manifest = json.loads(_one(cache, "*.json").read_text())
    assert not so.is_symlink() and manifest["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert not list(cache.glob("*.tmp"))


@pytest.mark.slow
def test_ranks_starting_at_once_on_a_bad_library_build_it_once(cache, tmp_path):
    """One rank takes the lock, finds the truncated library and rebuilds it (the compiler runs
    once); the others wait, then load that one. The compiler wrapper keeps the cache key: the
    key hashes `$CC --version`, which it passes through."""
    log = tmp_path / "builds"
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo build >> {log};; esac\n'
                       f'exec {shutil.which(os.environ.get("CC", "cc"))} "$@"\n')
    wrapper.chmod(0o700)
    _corrupt("truncated", cache, tmp_path)
    procs = [_popen(cache, {"CC": str(wrapper)}) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert all("same bits" in out for out, _ in outs), outs
    assert sum(out.count("warning:") for out, _ in outs) == 1, outs
    assert log.read_text().split() == ["build"]


@pytest.mark.parametrize("compiler", [os.environ.get("CC", "cc"), "no-such-compiler"])
def test_a_cache_directory_others_can_write_is_refused_with_one_line(compiler, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o770)
    rc, out, err = _run(cache, {"CC": compiler})
    assert rc == 2 and out.count("\n") == 1 and out.startswith("refused:"), out + err
    assert f"`chmod go-w {cache}`" in out and "ZEROPP_CACHE_DIR" in out
    assert not list(cache.iterdir())       # nothing built, nothing loaded


def _load(cache, monkeypatch):
    monkeypatch.setenv("ZEROPP_CACHE_DIR", str(cache))
    return kernel_cache.load("quant_cpu", quant_cpu._KERNELS.source, kernel_cache.Kernels.FLAGS, os.environ.get("CC", "cc"),
                             libs=["-lm"])


@pytest.mark.parametrize("mode", [0o702, 0o1777, 0o720])   # world-, sticky world- (as /tmp), group-writable
def test_a_directory_others_can_write_is_refused(mode, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(ConfigError, match=f"{cache} can be written by other users .*`chmod go-w {cache}`"):
        _load(cache, monkeypatch)
    assert not list(cache.iterdir())


@pytest.mark.parametrize("what", ["*.so", "*.json"])
def test_a_cached_file_others_can_write_is_refused(what, cache, monkeypatch):
    path = _one(cache, what)
    path.chmod(0o660)
    with pytest.raises(ConfigError, match=f"{path} can be written by other users"):
        _load(cache, monkeypatch)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's takes root")
@pytest.mark.parametrize("what", [".", "*.so"])
def test_a_cache_another_user_owns_is_refused(what, cache, monkeypatch):
    path = cache if what == "." else _one(cache, what)
    os.chown(path, 12345, -1)
    with pytest.raises(ConfigError, match=f"{path} belongs to another user .*ZEROPP_CACHE_DIR"):
        _load(cache, monkeypatch)


def test_the_lock_is_not_opened_through_a_link(cache, tmp_path):
    for path in list(cache.glob("*.so")) + list(cache.glob("*.json")):
        path.unlink()                      # so a rank must take the lock to build
    lock = _one(cache, "*.lock")
    victim = tmp_path / "victim"
    victim.write_text("not the cache's\n")
    lock.unlink()
    os.symlink(victim, lock)
    rc, out, err = _run(cache)
    assert victim.read_text() == "not the cache's\n"
    assert rc == 2 and out.count("\n") == 1 and f"{lock} is a symbolic link; remove it" in out, out + err
    assert not list(cache.glob("*.so"))


@pytest.mark.slow
def test_the_cache_is_private_whatever_the_umask(tmp_path):
    cache = tmp_path / "new" / "cache"
    rc, out, err = _run(cache, code="import os; os.umask(0)\n" + textwrap.dedent(CHECK))
    assert rc == 0 and "same bits" in out, out + err
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    for path in cache.iterdir():
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))


@pytest.mark.slow
def test_the_cache_may_be_the_working_directory(tmp_path):
    """ZEROPP_CACHE_DIR=. : the library is loaded by its full path (dlopen would look a bare
    file name up in the system's library path, and not find it)."""
    tmp_path.chmod(0o700)
    rc, out, err = _run(".", cwd=tmp_path)
    assert rc == 0 and "same bits" in out and "warning:" not in out, out + err
    assert len(list(tmp_path.glob("*.so"))) == 1


def test_a_build_reaches_the_disk_before_its_name(tmp_path, monkeypatch):
    """The library's data, then its new name (and the directory entry), then the manifest's:
    after a crash the manifest names a whole library or nothing."""
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("rename", str(a), str(b))) or replace(a, b))
    cache = tmp_path.resolve() / "cache"
    _load(cache, monkeypatch)
    so, manifest = _one(cache, "*.so"), _one(cache, "*.json")
    so_tmp, manifest_tmp = f"{so.with_suffix('')}.{os.getpid()}.so.tmp", f"{so.with_suffix('')}.{os.getpid()}.json.tmp"
    assert events == [("fsync", so_tmp), ("rename", so_tmp, str(so)), ("fsync", str(cache)),
                      ("fsync", manifest_tmp), ("rename", manifest_tmp, str(manifest)), ("fsync", str(cache))]


@pytest.mark.slow
def test_train_with_a_cache_others_can_write_stops_with_one_line_and_status_2(corpus, tmp_path):  # noqa: F811
    """The refusal reaches the user as any user error does: every rank finds it at its first
    quantization, rank 0 prints the one line, the ranks exit 2 (as tests/integration/inputs/test_cli_errors.py
    checks for a bad flag)."""
    cache = tmp_path / "kernels"
    cache.mkdir()
    cache.chmod(0o770)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "train.py",
                           *flags(corpus, tmp_path, 2, ["--zero-stage", "3", "--zero-quantized-weights",
                                                        "--zero-quantized-gradients"])],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "ZEROPP_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"})
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and f"`chmod go-w {cache}`" in ours[0], proc.stderr
    assert "exitcode  : 2" in proc.stderr and 'File "train.py"' not in proc.stderr
    assert "lm loss" not in proc.stdout and not list(cache.iterdir())
