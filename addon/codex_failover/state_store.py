"""Where pool state outlives the process: rows of (kind, id) -> JSON value with an expiry, in SQLite
(the default) or nowhere (`memory`). docs/state.md.

The store knows nothing of credentials: `state_rows.py` turns the in-memory health, usage,
route backoff and affinity into rows with non-secret ids, and back. SQLite runs in WAL mode, so
several proxies on one machine may share a file; each writes its own changes and reads the file at
start. Calls are blocking and short: the keeper runs them off the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

MEMORY = "memory"
SQLITE = "sqlite"
REDIS_TIMEOUT = 0.5  # seconds for a Redis connect or command: a slow Redis must not slow the proxy down


@dataclass(frozen=True)
class Row:
    kind: str  # cooling, out, usage, route, session
    id: str  # a non-secret id (a hash, a session id)
    value: dict
    expires: float | None  # epoch seconds; None: until deleted


class Store(Protocol):
    def load(self, now: float) -> list[Row]: ...

    def write(self, upserts: Iterable[Row], deletes: Iterable[tuple[str, str]]) -> str | None:
        """None, or why the store started afresh (everything must be written again)."""

    def close(self) -> None: ...


class MemoryStore:
    """Keep nothing: every restart starts from a clean pool."""

    def load(self, now: float) -> list[Row]:
        return []

    def write(self, upserts, deletes) -> None:
        pass

    def close(self) -> None:
        pass


def default_sqlite_path(environ=os.environ) -> Path:
    """$XDG_STATE_HOME/codex-failover/state.sqlite (~/.local/state/... when unset)."""
    base = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME", "~")).expanduser() / ".local" / "state")
    return Path(base) / "codex-failover" / "state.sqlite"


MAGIC = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite file
PRUNE_EVERY = 600.0  # seconds: expired rows are deleted from the file at most this often (while writing)


class SqliteStore:
    """One table, namespaced: (namespace, kind, id) -> value, expires.

    Faults the file can have while the proxy runs, and what is done (docs/state.md):
    - deleted, or replaced by another file: noticed at the next write (the file at the path is not
      the one opened), started afresh; `write` returns why, and the keeper writes everything again;
    - corrupted (its header is not SQLite's, or SQLite says so): moved aside to `<name>.corrupt`,
      started afresh, likewise;
    - read-only at open (a file the user made so, or of another user): opened read-only, its rows
      restored, nothing written (`read_only`; the keeper says so once);
    - a full disk: SQLite's `database or disk is full`, named as such by `describe_fault`.
    """

    shared = False

    def __init__(self, path: Path, namespace: str):
        self.path, self.namespace = Path(path), namespace
        self.read_only = False
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        self._db: sqlite3.Connection  # `_open` opens it (or the store is not made)
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file opened
        # The file opened, held open as long as SQLite's connection (`_check` reads its header here):
        # closing any descriptor of a file drops every POSIX lock the process holds on it, SQLite's
        # too, and another process's reader would then take the WAL from under the connection.
        self._fd: int | None = None
        self._pruned = time.time()  # `load` drops what expired before
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        created = not self.path.exists()
        if not created and not os.access(self.path, os.W_OK):  # SQLite would open it read-only without a word
            self._open_read_only()
            return
        db = sqlite3.connect(self.path, timeout=5, check_same_thread=False, isolation_level=None)
        try:
            if created:
                os.chmod(self.path, 0o600)  # holds no secret, but it is nobody else's business either
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS state (namespace TEXT NOT NULL, kind TEXT NOT NULL, "
                       "id TEXT NOT NULL, value TEXT NOT NULL, expires REAL, PRIMARY KEY (namespace, kind, id))")
        except sqlite3.OperationalError as exc:
            db.close()
            if created or not getattr(exc, "sqlite_errorname", "").startswith("SQLITE_READONLY"):
                raise
            self._open_read_only()
            return
        except BaseException:
            db.close()
            raise
        self._opened(db)

    def _open_read_only(self) -> None:
        """A file that cannot be written: its rows are read, nothing is written (`read_only`)."""
        self.read_only = True
        self._opened(sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=5,
                                     check_same_thread=False, isolation_level=None))

    def _opened(self, db: sqlite3.Connection) -> None:
        self._db = db
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:  # (the file went between SQLite's open and this one)
            db.close()
            raise
        st = os.fstat(self._fd)
        self._identity = (st.st_dev, st.st_ino)

    def _close(self) -> None:
        """SQLite's connection first, then the descriptor (whose close drops the process's locks)."""
        self._db.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def load(self, now: float) -> list[Row]:
        with self._lock:
            if not self.read_only:
                self._db.execute("DELETE FROM state WHERE namespace = ? AND expires IS NOT NULL AND expires <= ?",
                                 (self.namespace, now))
            rows = self._db.execute("SELECT kind, id, value, expires FROM state WHERE namespace = ? "
                                    "AND (expires IS NULL OR expires > ?)", (self.namespace, now)).fetchall()
        out = []
        for kind, id_, value, expires in rows:
            try:
                doc = json.loads(value)
            except ValueError:
                continue  # a row another version wrote: ignored
            if isinstance(doc, dict):
                out.append(Row(kind, id_, doc, expires))
        return out

    def write(self, upserts, deletes) -> str | None:
        """Write one transaction. Returns None, or why the file had to be started afresh first
        ("deleted", "replaced", "corrupted"): then only these rows are in it, and the caller writes
        everything again. A read-only file: nothing is written."""
        with self._lock:
            if self.read_only:
                return None
            fresh = self._check()
            try:
                self._write(upserts, deletes)
            except sqlite3.DatabaseError as exc:
                if getattr(exc, "sqlite_errorname", "") not in ("SQLITE_CORRUPT", "SQLITE_NOTADB"):
                    raise
                fresh = self._afresh("corrupted")
                self._write(upserts, deletes)
            if time.time() - self._pruned >= PRUNE_EVERY:  # rows that expired while running (never read back)
                self._pruned = time.time()
                self._db.execute("DELETE FROM state WHERE namespace = ? AND expires IS NOT NULL AND expires <= ?",
                                 (self.namespace, self._pruned))
            return fresh

    def _write(self, upserts, deletes) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.executemany(
                "INSERT INTO state (namespace, kind, id, value, expires) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (namespace, kind, id) DO UPDATE SET value = excluded.value, expires = excluded.expires",
                [(self.namespace, r.kind, r.id, json.dumps(r.value, separators=(",", ":")), r.expires)
                 for r in upserts])
            self._db.executemany("DELETE FROM state WHERE namespace = ? AND kind = ? AND id = ?",
                                 [(self.namespace, kind, id_) for kind, id_ in deletes])
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # SQLite may have rolled back itself (a full disk does)
                self._db.execute("ROLLBACK")
            raise

    def _check(self) -> str | None:
        """Is the file at the path still the one opened, and still a database? (A stat, and a
        16-byte read through the descriptor held since the open, never a new one: SQLite itself
        would go on writing to a deleted file, or past a header overwritten under it, without a word.)"""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self._afresh("deleted")
        if (st.st_dev, st.st_ino) != self._identity:
            return self._afresh("replaced")
        assert self._fd is not None  # (open while the store is)
        if os.pread(self._fd, len(MAGIC), 0) != MAGIC:
            return self._afresh("corrupted")
        return None

    def _afresh(self, why: str) -> str:
        """Close the lost file, set a corrupted one aside, and open a new one at the path."""
        self._close()
        if why == "corrupted":
            with contextlib.suppress(FileNotFoundError):
                os.replace(self.path, self.path.with_name(self.path.name + ".corrupt"))
        if why != "replaced":  # a WAL left from the lost file must not be replayed into the new one
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.path.with_name(self.path.name + suffix))
        self._open()
        return why

    def close(self) -> None:
        with self._lock:
            self._close()


def describe_fault(exc: BaseException) -> str:
    """What went wrong with a store, in words (no secret: SQLite's and OSError's texts hold none;
    a Redis error may name the host)."""
    name = getattr(exc, "sqlite_errorname", "")
    if name == "SQLITE_FULL" or getattr(exc, "errno", None) == errno.ENOSPC:
        return f"the disk is full ({exc})"
    if name.startswith("SQLITE_READONLY") or isinstance(exc, PermissionError):
        return f"not writable ({exc})"
    if name in ("SQLITE_CORRUPT", "SQLITE_NOTADB"):
        return f"the file is corrupted ({exc})"
    return f"{type(exc).__name__}: {exc}"


def location(spec: str, environ=os.environ) -> str:
    """Where a store spec points, for the log (a Redis URL without its password)."""
    if spec == SQLITE:
        return str(default_sqlite_path(environ))
    if spec.startswith("sqlite:///"):
        return spec[len("sqlite://"):]
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .core.routes import redact_url

        return redact_url(spec)
    return spec


class RedisStore:
    """Shared by every proxy that names it: one key per row, `codex-failover:<namespace>:<kind>:<id>`,
    its JSON value, expiring with the row (PEXPIREAT). `shared` tells the keeper to read the
    others' rows while running, not only at start."""

    shared = True

    def __init__(self, url: str, namespace: str):
        import redis  # only for a Redis store

        self.url = url
        self.prefix = f"codex-failover:{namespace}:"
        self.claims = f"codex-failover-claim:{namespace}:"  # not rows: `load` never sees them
        self._redis = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT,
                                           retry_on_timeout=False)

    @property
    def path(self) -> str:
        """Where, for the log: the URL without its password."""
        from .core.routes import redact_url

        return redact_url(self.url)

    def load(self, now: float) -> list[Row]:
        names = list(self._redis.scan_iter(match=self.prefix + "*", count=1000))
        values = self._redis.mget(names) if names else []
        out = []
        for name, value in zip(names, values, strict=False):
            kind, _, id_ = name.decode()[len(self.prefix):].partition(":")
            try:
                doc = json.loads(value) if value is not None else None
            except ValueError:
                continue
            expires = doc.get("expires") if isinstance(doc, dict) else None
            if (isinstance(doc, dict) and isinstance(doc.get("value"), dict)
                    and (expires is None or (isinstance(expires, (int, float)) and expires > now))):
                out.append(Row(kind, id_, doc["value"], expires))
        return out

    def write(self, upserts, deletes) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for r in upserts:
            name = f"{self.prefix}{r.kind}:{r.id}"
            pipe.set(name, json.dumps({"value": r.value, "expires": r.expires}, separators=(",", ":")))
            if r.expires is not None:
                pipe.pexpireat(name, int(r.expires * 1000))
        for kind, id_ in deletes:
            pipe.delete(f"{self.prefix}{kind}:{id_}")
        pipe.execute()

    def close(self) -> None:
        self._redis.close()

    # A claim on a piece of work only one proxy may do at a time (an account's token refresh): a
    # key of its own (outside the rows' prefix), set only if absent, expiring by itself.
    _RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"

    def claim(self, what: str, owner: str, ttl: float) -> bool:
        return bool(self._redis.set(self.claims + what, owner, nx=True,
                                    px=max(1, int(ttl * 1000))))

    def release(self, what: str, owner: str) -> None:
        self._redis.eval(self._RELEASE, 1, self.claims + what, owner)


def open_store(spec: str, namespace: str, environ=os.environ) -> Store:
    """`memory`, `sqlite` (the default file), `sqlite:///absolute/path.sqlite` or `redis[s]://...`."""
    if spec == MEMORY:
        return MemoryStore()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, namespace)
    if spec == SQLITE:
        return SqliteStore(default_sqlite_path(environ), namespace)
    if spec.startswith("sqlite:///"):
        return SqliteStore(Path(spec[len("sqlite://"):]), namespace)
    raise ValueError(f"unknown store {spec!r}")

