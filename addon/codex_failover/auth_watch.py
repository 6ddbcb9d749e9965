"""Re-reading auth files that changed on disk (the user ran `codex login` or `codex logout` for an
account, or a Codex on that CODEX_HOME refreshed its tokens).

A file that holds no credential any more (removed, emptied, logged out) takes its credential out of
rotation with one line naming the file and the fix; once the file can be used again the pool file is
loaded anew, which brings it back where the pool file puts it. A file that changed into something
unreadable (broken JSON, another kind of credential) keeps the credential read before, with one
line. I/O is injected (`stat`, `read`), so the rule itself is tested without touching files.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Callable

from .bounded_file import read_auth_file
from .config import Credential
from .core.auth import AuthError, AuthGone, AuthMaterial
from .core.policy import Skipped
from .core.token_expiry import login_command

Stamp = tuple[int, int, int]  # (mtime_ns, size, inode): an atomic rewrite changes the inode


def _stamp(path: str, stat: Callable) -> Stamp | None:
    try:
        st = stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


log = logging.getLogger("codex_failover")


@dataclass
class Seen:
    """What one look at the auth files found."""

    credentials: tuple[Credential, ...]
    skipped: tuple[Skipped, ...]
    reloaded: list[str] = field(default_factory=list)  # re-read, in rotation
    problems: list[str] = field(default_factory=list)  # one line each, no secret
    reload: bool = False  # a skipped credential's file can be used again: load the pool file anew


class AuthWatch:
    def __init__(self, stat: Callable = os.stat, read: Callable[[str], AuthMaterial] = read_auth_file):
        self._stat, self._read = stat, read
        self._seen: dict[str, Stamp | None] = {}

    def remember(self, creds: tuple[Credential, ...], skipped: tuple[Skipped, ...] = ()) -> None:
        """What the files look like now (after a pool load): not a change."""
        self._seen = {c.auth_file: _stamp(c.auth_file, self._stat) for c in creds if c.auth_file}
        self._seen.update({s.auth_file: _stamp(s.auth_file, self._stat) for s in skipped})

    def wrote(self, path: str) -> None:
        """The addon itself just wrote `path` (a token refresh): not a change to react to."""
        self._seen[path] = _stamp(path, self._stat)

    def refresh(self, creds: tuple[Credential, ...], skipped: tuple[Skipped, ...] = ()) -> Seen:
        seen = Seen((), skipped)
        out, gone = [], list(skipped)
        for cred in creds:
            path = cred.auth_file
            stamp = _stamp(path, self._stat) if path else None
            if not path or stamp == self._seen.get(path):
                out.append(cred)
                continue
            self._seen[path] = stamp
            try:
                auth = self._read(path)
            except AuthGone as exc:
                gone.append(Skipped(cred.name, path, str(exc)))
                seen.problems.append(f"credential {cred.name}: {exc}; out of rotation until it can be used "
                                     f"({login_command(path)})")
                continue
            except AuthError as exc:
                seen.problems.append(f"credential {cred.name}: auth file changed but cannot be used: {exc}")
                out.append(cred)
                continue
            if auth.kind != cred.kind:
                seen.problems.append(f"credential {cred.name}: auth file now holds a {auth.kind} credential, "
                                     f"not {cred.kind}; keeping the old one until the pool file is reloaded")
                out.append(cred)
                continue
            out.append(replace(cred, auth=auth))
            seen.reloaded.append(cred.name)
        for skip in skipped:
            stamp = _stamp(skip.auth_file, self._stat)
            if stamp == self._seen.get(skip.auth_file):
                continue
            self._seen[skip.auth_file] = stamp
            try:
                self._read(skip.auth_file)
            except AuthError:
                continue  # still unusable: said once already
            seen.reload = True
        seen.credentials, seen.skipped = tuple(out), tuple(gone)
        return seen

    def refresh_pool(self, pool, health):
        """`pool` with its changed auth files reloaded (the same object when none changed); a reloaded
        credential is back in rotation (a 401 that took it out was fixed by a new `codex login`).
        Returns (pool, whether the pool file must be loaded anew)."""
        seen = self.refresh(pool.credentials, pool.skipped)
        for line in seen.problems:
            log.warning("codex-failover: %s", line)
        for name in seen.reloaded:
            health.restore(name)
            log.info("codex-failover: credential %s: auth file changed on disk; reloaded, in rotation", name)
        if not seen.reloaded and len(seen.skipped) == len(pool.skipped):
            return pool, seen.reload
        return replace(pool, credentials=seen.credentials, skipped=seen.skipped), seen.reload
