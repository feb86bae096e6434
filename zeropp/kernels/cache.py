"""The cache of the native libraries zeropp compiles (the CPU quantization kernels), built so
that no file in it can make a rank crash, fall back or run the wrong code.

    lib = kernel_cache.load("quant_cpu", source, flags, compiler, libs=["-lm"])   # a ctypes.CDLL

One library per source, flags, compiler version and CPU, in ``$ZEROPP_CACHE_DIR`` (default
``~/.cache/zeropp``), named by a hash of those inputs. Beside it a manifest records the inputs
and the library's sha256. What can go wrong, and what happens:

- Another user could write the directory, the library, its manifest or the lock (group- or
  world-writable, sticky /tmp included, or owned by someone else): a ConfigError naming it and
  the fix, before anything is built or loaded -- as ssh refuses a key file others can write.
  The directory is created 0700 and every file 0600 whatever the umask.
- The library is truncated, empty, another library, or does not match its manifest (a crash
  before the data reached the disk, a copy from elsewhere): its sha256 is checked before
  dlopen maps it (a truncated file mapped is a SIGBUS), and a file that fails the check or
  fails to load is removed and rebuilt, with one warning.
- Several ranks start at once: one builds under a lock file (opened without following links,
  a regular file of ours), the others wait for it and then check the hash.

A build writes a temporary file, fsyncs it, renames it into place and fsyncs the directory,
then writes the manifest the same way, so a manifest only ever names a library whole on disk.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import platform
import stat
import subprocess
import warnings
from pathlib import Path
from typing import Optional, Sequence

from common import ConfigError

ENV = "ZEROPP_CACHE_DIR"
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK   # no links; a FIFO must not block the open


class _Mismatch(Exception):
    """A cached file that is not what its manifest promises (removed and rebuilt)."""


def cache_dir() -> Path:
    """Absolute: dlopen searches the library path for a name without a slash (ZEROPP_CACHE_DIR=.)."""
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "zeropp").absolute()


def cpu_features() -> str:
    """This processor's feature flags: a library built with -march=native runs only where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def key_inputs(source: Path, flags: Sequence[str], compiler: str) -> dict:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    return {"source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(), "flags": list(flags),
            "compiler_version": version, "cpu": cpu_features()}


def key_of(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def refuse_if_shared(st: os.stat_result, path, what: str):
    """ConfigError unless only this user (or root) can write `path` (`st`: its stat)."""
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{what} {path} belongs to another user (uid {st.st_uid}), who could put code in it "
                          f"that every rank runs; remove it, or set {ENV} to a directory of your own")
    if st.st_mode & 0o022:
        raise ConfigError(f"{what} {path} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}), "
                          f"who could put code in it that every rank runs; run `chmod go-w {path}`, "
                          f"or set {ENV} to a directory of your own")


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    refuse_if_shared(os.stat(path), path, f"the kernel cache directory (${ENV})")
    return path


def _read(path: Path, what: str) -> bytes:
    """The bytes of a regular file of ours that no one else can write; FileNotFoundError if there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | _OPEN)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Mismatch("is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Mismatch("is not a regular file")
        refuse_if_shared(st, path, what)
        return f.read()


def _check(so: Path, manifest: Path, key: str) -> Optional[str]:
    """None when the library matches its manifest, "" when neither exists, else what is wrong."""
    try:
        digest = hashlib.sha256(_read(so, "the cached library")).hexdigest()
    except FileNotFoundError:
        return "is missing but its manifest is there" if os.path.lexists(manifest) else ""
    except _Mismatch as e:
        return str(e)
    try:
        recorded = _read(manifest, "the cached library's manifest")
    except FileNotFoundError:
        return f"has no manifest ({manifest.name})"
    except _Mismatch as e:
        return f"has a manifest that {e}"
    try:
        recorded = json.loads(recorded)
    except ValueError:
        return "has a manifest that is not JSON"
    if not isinstance(recorded, dict) or recorded.get("key") != key:
        return "has a manifest for other sources, flags, compiler or CPU"
    if recorded.get("sha256") != digest:
        return "does not match the sha256 in its manifest (truncated, empty or another library)"
    return None


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive flock on `path`, opened without following a link."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ConfigError(f"the kernel cache's lock file {path} is a symbolic link; remove it") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the kernel cache's lock file {path} is not a regular file; remove it")
        refuse_if_shared(st, path, "the kernel cache's lock file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)    # releases the lock


def _fsync(path, flags=os.O_RDONLY):
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path):
    """Durably replaces `final` by `tmp` (a file of ours): the data, then the name."""
    os.chmod(tmp, 0o600)
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync(final.parent, os.O_RDONLY | os.O_DIRECTORY)


def _build(compiler: str, source: Path, flags: Sequence[str], libs: Sequence[str], stem: Path, inputs: dict,
           key: str):
    """Called under the lock: any temporary file of this library is a crashed build's."""
    for old in stem.parent.glob(f"{stem.name}.*.tmp"):
        old.unlink(missing_ok=True)
    so, manifest = stem.with_name(stem.name + ".so"), stem.with_name(stem.name + ".json")
    manifest.unlink(missing_ok=True)   # first: a manifest never outlives its library
    so.unlink(missing_ok=True)
    tmp = stem.with_name(f"{stem.name}.{os.getpid()}.so.tmp")
    res = subprocess.run([compiler, *flags, str(source), "-o", str(tmp), *libs], capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed: {res.stderr.strip()[-500:]}")
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    _publish(tmp, so)
    tmp = stem.with_name(f"{stem.name}.{os.getpid()}.json.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o600), "w") as f:
        json.dump({"key": key, "sha256": digest, "inputs": inputs}, f, indent=1)
    _publish(tmp, manifest)


def _open(so: Path, manifest: Path, key: str):
    """(library or None, what is wrong: "" when there is nothing yet)."""
    problem = _check(so, manifest, key)
    if problem is not None:
        return None, problem
    try:
        return ctypes.CDLL(str(so)), ""
    except OSError as e:
        return None, f"fails to load ({e})"


def load(name: str, source: Path, flags: Sequence[str], compiler: str, libs: Sequence[str] = ()) -> ctypes.CDLL:
    """The library built from `source`, built now if the cache has no good copy. ConfigError: the
    cache is not private; RuntimeError, OSError, SubprocessError: it could not be built or loaded."""
    directory = private_dir(cache_dir())    # refused before the compiler runs
    inputs = key_inputs(source, flags, compiler)
    key = key_of(inputs)
    stem = directory / f"{name}-{key[:16]}"
    so, manifest = stem.with_name(stem.name + ".so"), stem.with_name(stem.name + ".json")
    lib, _ = _open(so, manifest, key)
    if lib is not None:
        return lib
    with _locked(stem.with_name(stem.name + ".lock")):   # one rank builds, the others wait and check
        lib, problem = _open(so, manifest, key)
        if lib is not None:
            return lib
        if problem:
            warnings.warn(f"zeropp: the cached library {so} {problem}; removed it and rebuilt it",
                          RuntimeWarning, stacklevel=2)
        _build(compiler, source, flags, libs, stem, inputs, key)
    lib, problem = _open(so, manifest, key)
    if lib is None:
        raise RuntimeError(f"{so} {problem or 'is missing'} right after it was built")
    return lib


class Kernels:
    """A C source of ours, built, cached (`load`) and loaded on first use. `available()` is False,
    and `why_not()` says why, when no compiler or a failed build leaves the caller its torch path;
    a ConfigError (a cache others can write) is the user's to fix: it propagates."""
    FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC", "-std=gnu11"]

    def __init__(self, name: str, source: Path, what: str, declare):
        self.name, self.source, self.what, self.declare = name, source, what, declare   # declare(lib): argtypes
        self.lib, self.why = None, ""   # lib: False once a build failed

    def available(self) -> bool:
        if self.lib is None:
            try:
                self.lib = load(self.name, self.source, self.FLAGS, os.environ.get("CC", "cc"), libs=["-lm"])
                self.declare(self.lib)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                self.lib, self.why = False, f"the CPU {self.what} kernels could not be built ({e})"
        return self.lib is not False

    def why_not(self) -> str:
        return self.why
