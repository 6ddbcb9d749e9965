"""What the addon looks at, at most once a second, on the requests that use the pool: the pool file
(pool_watch.py: reloaded when it changed, kept when the change does not load), the auth files
(auth_watch.py) and the ChatGPT tokens' ends (core/token_expiry.py). Kept out of the addon so its
hooks stay thin."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from mitmproxy import exceptions

from ..auth_watch import AuthWatch
from ..core.token_expiry import ExpiryWatch, login_command
from ..pool_watch import PoolWatch

if TYPE_CHECKING:
    from ..config import PoolConfig

log = logging.getLogger("codex_failover")


class FileWatch:
    """The pool file's, the auth files' and the tokens' watches, for one addon."""

    def __init__(self) -> None:
        self.pool = PoolWatch()
        self.auth = AuthWatch()
        self.expiry = ExpiryWatch()
        self._checked = 0.0

    def before_load(self, path: str | None) -> None:
        self.pool.remember(path)  # before reading: an edit made meanwhile is seen as a change

    def loaded(self, creds, notices: set, skipped=()) -> None:
        """A pool was just loaded: its auth files as they are now, one line per credential skipped
        (its file cannot be used: the file and the fix), and one line per ChatGPT token (a warning
        when it is under a day from its end). An expired one goes into `notices` (the run's own
        "expired" line), which need not say it again."""
        self.auth.remember(creds, skipped)
        for skip in skipped:
            log.warning("codex-failover: %s", skip.line(login_command(skip.auth_file)))
        now = time.time()
        for warn, text in self.expiry.at_start(creds, now):
            (log.warning if warn else log.info)("codex-failover: %s", text)
        notices.update((c.name, c.auth.expires_at) for c in creds
                       if c.auth.expires_at is not None and c.auth.expires_at <= now)

    def refresh(self, current: Callable[[], "PoolConfig"], reload_pool: Callable[[], None], health) -> "PoolConfig":
        """The pool to use from now on: `current()`, after `reload_pool()` if the pool file changed,
        with its changed auth files reloaded."""
        now = time.monotonic()
        if now - self._checked < 1.0:
            return current()
        self._checked = now
        if self.pool.changed():
            self._reload(reload_pool, "pool file changed on disk; reloaded")
        pool, reload = self.auth.refresh_pool(current(), health)
        if reload:  # a skipped credential's auth file can be used again: the pool file says where it goes
            was = {s.name for s in pool.skipped}
            if self._reload(reload_pool, "an auth file can be used again; pool file reloaded"):
                pool = current()
                for cred in pool.credentials:
                    if cred.name in was:
                        health.restore(cred.name)
                        log.warning("codex-failover: credential %s: its auth file can be used again; in rotation",
                                    cred.name)
        for text in self.expiry.check(pool.credentials, time.time()):
            log.warning("codex-failover: %s", text)
        return pool

    @staticmethod
    def _reload(reload_pool: Callable[[], None], done: str) -> bool:
        try:
            reload_pool()  # logs the pool's line, as at start
        except exceptions.OptionsError as exc:  # the one line a broken edit gets
            log.warning("codex-failover: the changed pool file cannot be used, the pool loaded before stays "
                        "in force: %s", exc)
            return False
        log.info("codex-failover: %s", done)
        return True
