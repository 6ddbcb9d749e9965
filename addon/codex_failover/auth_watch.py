"""Re-reading auth files that changed on disk (the user ran `codex login` again for an account).

I/O is injected (`stat`, `read`), so the rule itself is tested without touching files.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Callable

from .config import Credential
from .core.auth import AuthError, AuthMaterial, read_auth_file

Stamp = tuple[int, int]  # (mtime_ns, size)


def _stamp(path: str, stat: Callable) -> Stamp | None:
    try:
        st = stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


log = logging.getLogger("codex_failover")


class AuthWatch:
    def __init__(self, stat: Callable = os.stat, read: Callable[[str], AuthMaterial] = read_auth_file):
        self._stat, self._read = stat, read
        self._seen: dict[str, Stamp | None] = {}

    def remember(self, creds: tuple[Credential, ...]) -> None:
        """What the files look like now (after a pool load): not a change."""
        self._seen = {c.auth_file: _stamp(c.auth_file, self._stat) for c in creds if c.auth_file}

    def refresh(self, creds: tuple[Credential, ...]) -> tuple[tuple[Credential, ...], list[str], list[str]]:
        """New credentials, the names reloaded, and problems (one line each, no secret)."""
        out, reloaded, problems = [], [], []
        for cred in creds:
            path = cred.auth_file
            stamp = _stamp(path, self._stat) if path else None
            if not path or stamp == self._seen.get(path):
                out.append(cred)
                continue
            self._seen[path] = stamp
            try:
                auth = self._read(path)
            except AuthError as exc:
                problems.append(f"credential {cred.name}: auth file changed but cannot be used: {exc}")
                out.append(cred)
                continue
            if auth.kind != cred.kind:
                problems.append(f"credential {cred.name}: auth file now holds a {auth.kind} credential, "
                                f"not {cred.kind}; keeping the old one until the pool file is reloaded")
                out.append(cred)
                continue
            out.append(replace(cred, auth=auth))
            reloaded.append(cred.name)
        return tuple(out), reloaded, problems

    def refresh_pool(self, pool, health):
        """`pool` with its changed auth files reloaded (the same object when none changed); a reloaded
        credential is back in rotation (a 401 that took it out was fixed by a new `codex login`)."""
        creds, reloaded, problems = self.refresh(pool.credentials)
        for line in problems:
            log.warning(line)
        if not reloaded:
            return pool
        for name in reloaded:
            health.restore(name)
            log.info("credential %s: auth file changed on disk; reloaded, in rotation", name)
        return replace(pool, credentials=creds)
