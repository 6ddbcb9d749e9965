"""An auth.json read and written back as Codex keeps it, safely beside a Codex (or another proxy) on
the same CODEX_HOME: a lock on a sidecar file (`auth.json.lock`, flock) around read-refresh-write,
and an atomic write (a temporary file in the same folder, renamed over the old one, the folder
synced) that keeps Codex's format (pretty JSON, every field it had) and the file's mode and owner.
A symlinked auth.json is written through the link (its target replaced, the link kept), as Codex
does. Codex takes no lock: just before the rename the file is checked to be still the one read
(`core.token_refresh.still_the_one`); a `codex logout` or `codex login` meanwhile wins (`Changed`).

Blocking: called through `asyncio.to_thread` (mitm/token_refresher.py). No token is ever logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from typing import Any, Iterator

from .core.auth import AuthError, AuthGone
from .core.token_refresh import Snapshot, snapshot, still_the_one

LOCK_WAIT = 10.0  # seconds to wait for another holder of the lock


class Changed(Exception):
    """The auth.json changed (or vanished) after it was read: nothing was written."""


def lock_path(path: str) -> str:
    """The lock beside the real file (a symlinked auth.json's target), so every name for one file
    shares one lock."""
    return f"{os.path.realpath(path)}.lock"


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
    return read_snapshot(path)[0]


def read_snapshot(path: str) -> tuple[dict[str, Any], Snapshot]:
    """`read_doc`, and what says later that the file is still this one (`write_doc`'s `expect`)."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise AuthGone(f"cannot read {path}: No such file or directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthError(f"cannot read {path}: {type(exc).__name__}") from None
    doc = _parse(path, text)
    return doc, snapshot((st.st_ino, st.st_mtime_ns, st.st_size), doc)


def _parse(path: str, text: str) -> dict[str, Any]:
    if not text.strip():
        raise AuthGone(f"{path} is empty")
    try:
        doc = json.loads(text)
    except ValueError:
        raise AuthError(f"{path} is not valid JSON") from None
    if not isinstance(doc, dict):
        raise AuthError(f"{path}: expected a JSON object (a Codex auth.json)")
    return doc


def _current(path: str) -> Snapshot | None:
    try:
        return read_snapshot(path)[1]
    except AuthGone:
        return None
    except AuthError:
        return (0, 0, 0, "", "")  # something else now: not the file read


def write_doc(path: str, doc: dict[str, Any], expect: Snapshot | None = None) -> None:
    """Replace `path` with `doc` atomically, as Codex writes it (two-space pretty JSON), keeping
    the file's mode (0600 when it had none) and, where allowed, its owner; through a symlink, its
    target. `expect`: the file as it was read; if it is no longer that one (removed, rewritten by
    a `codex login`), nothing is written and `Changed` is raised."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
        mode, owner = st.st_mode & 0o777, (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = 0o600, None
    folder, name = os.path.split(real)
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
        if expect is not None and not still_the_one(expect, _current(real)):
            raise Changed(path)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_folder(folder)


def _sync_folder(folder: str) -> None:
    """The rename itself on disk (a crash right after it keeps the new file, not the old one)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
