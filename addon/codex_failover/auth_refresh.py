"""An auth.json read and written back as Codex keeps it, safely beside a Codex (or another proxy) on
the same CODEX_HOME: a lock on a sidecar file (`auth.json.lock`, flock) around read-refresh-write,
and an atomic write (a temporary file in the same folder, renamed over the old one) that keeps
Codex's format (pretty JSON, every field it had) and the file's mode and owner.

Blocking: called through `asyncio.to_thread` (mitm/token_refresher.py). No token is ever logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from .core.auth import AuthError, AuthGone

LOCK_WAIT = 10.0  # seconds to wait for another holder of the lock


def lock_path(path: str) -> str:
    return f"{path}.lock"


def acquire(path: str, wait: float = LOCK_WAIT) -> int:
    """The sidecar lock of `path`, held (an open descriptor: `release` it). TimeoutError after `wait`."""
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise TimeoutError(f"{lock_path(path)} is held by another program") from None
            time.sleep(0.05)


def release(fd: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def locked(path: str, wait: float = LOCK_WAIT) -> Iterator[None]:
    fd = acquire(path, wait)
    try:
        yield
    finally:
        release(fd)


def read_doc(path: str) -> dict[str, Any]:
    """The auth.json as a JSON object. AuthError (AuthGone for a missing or empty one) otherwise;
    the message never quotes the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AuthGone(f"cannot read {path}: No such file or directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthError(f"cannot read {path}: {type(exc).__name__}") from None
    if not text.strip():
        raise AuthGone(f"{path} is empty")
    try:
        doc = json.loads(text)
    except ValueError:
        raise AuthError(f"{path} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise AuthError(f"{path}: expected a JSON object (a Codex auth.json)")
    return doc


def write_doc(path: str, doc: dict[str, Any]) -> None:
    """Replace `path` with `doc` atomically, as Codex writes it (two-space pretty JSON), keeping
    the file's mode (0600 when it had none) and, where allowed, its owner."""
    try:
        st = os.stat(path)
        mode, owner = st.st_mode & 0o777, (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = 0o600, None
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), mode)
            if owner is not None and owner != (os.geteuid(), os.getegid()):
                with contextlib.suppress(OSError):
                    os.fchown(out.fileno(), *owner)
            out.write(json.dumps(doc, indent=2))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
