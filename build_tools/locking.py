"""Inter-process build locks: fcntl.flock on a lock file, polled until a timeout.

flock locks belong to the open file description, so a killed process releases its locks with it:
a crashed `compile` never leaves a lock that blocks the next one, and no lock file needs removing."""

from __future__ import annotations

import fcntl
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class LockTimeoutError(Exception):
    """Another process held a build lock longer than MLX_AOT_LOCK_TIMEOUT; the message names the lock."""


@contextmanager
def file_lock(path: Path, timeout: float) -> Iterator[None]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeoutError(
                        f"timed out after {timeout:g}s waiting for the build lock {path}: another "
                        f"`python -m build_tools compile` (or clean) holds it; wait for it, or raise "
                        f"MLX_AOT_LOCK_TIMEOUT") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
