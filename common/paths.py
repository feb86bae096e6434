"""A directory a flag names, checked before any work: this job can create it and write there."""
from __future__ import annotations

import os

from common.errors import ConfigError


def check_writable_dir(path: str, flag: str):
    """`path` is (or can be made) a directory this job can write, or a ConfigError naming `flag`."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a file, not a directory; pass a directory")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test.{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path} is not writable ({e.strerror or e}); "
                          f"pass a directory this job can create and write") from None
