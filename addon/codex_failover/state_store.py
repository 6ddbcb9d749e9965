"""Where pool state outlives the process: rows of (kind, id) -> JSON value with an expiry, in SQLite
(the default) or nowhere (`memory`). docs/state.md.

The store knows nothing of credentials: `state_keeper.py` turns the in-memory health, usage,
route backoff and affinity into rows with non-secret ids, and back. SQLite runs in WAL mode, so
several proxies on one machine may share a file; each writes its own changes and reads the file at
start. Calls are blocking and short: the keeper runs them off the event loop.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
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

    def write(self, upserts: Iterable[Row], deletes: Iterable[tuple[str, str]]) -> None: ...

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


class SqliteStore:
    """One table, namespaced: (namespace, kind, id) -> value, expires."""

    def __init__(self, path: Path, namespace: str):
        self.path, self.namespace = Path(path), namespace
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One connection, used by one thread at a time (the keeper's writes are serialised).
        self._db = sqlite3.connect(self.path, timeout=5, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        os.chmod(self.path, 0o600)  # holds no secret, but it is nobody else's business either
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("CREATE TABLE IF NOT EXISTS state (namespace TEXT NOT NULL, kind TEXT NOT NULL, "
                             "id TEXT NOT NULL, value TEXT NOT NULL, expires REAL, PRIMARY KEY (namespace, kind, id))")

    def load(self, now: float) -> list[Row]:
        with self._lock:
            self._db.execute("DELETE FROM state WHERE namespace = ? AND expires IS NOT NULL AND expires <= ?",
                             (self.namespace, now))
            rows = self._db.execute("SELECT kind, id, value, expires FROM state WHERE namespace = ?",
                                    (self.namespace,)).fetchall()
        out = []
        for kind, id_, value, expires in rows:
            try:
                doc = json.loads(value)
            except ValueError:
                continue  # a row another version wrote: ignored
            if isinstance(doc, dict):
                out.append(Row(kind, id_, doc, expires))
        return out

    def write(self, upserts, deletes) -> None:
        with self._lock:
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
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._db.close()


class RedisStore:
    """Shared by every proxy that names it: one key per row, `codex-failover:<namespace>:<kind>:<id>`,
    its JSON value, expiring with the row (PEXPIREAT). `shared` tells the keeper to read the
    others' rows while running, not only at start."""

    shared = True

    def __init__(self, url: str, namespace: str):
        import redis  # only for a Redis store

        self.url = url
        self.prefix = f"codex-failover:{namespace}:"
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
        for name, value in zip(names, values):
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

