"""Re-reading the pool file when it changes on disk, as auth files are (auth_watch.py; both are run
for the addon by mitm/file_watch.py).

A proxy that runs all day as a service should not need a restart for an edited pool. The addon asks
`changed()` at most once a second, on the requests that use the pool; when the file's stamp moved it
loads the file again. A file that no longer loads (a typo mid-edit) keeps the pool in force and is
reported once per change, not on every request: `changed()` is true once per new stamp.

I/O is injected (`stat`), so the rule is tested without touching files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

Stamp = tuple[int, int, int]  # (mtime_ns, size, inode): an editor that writes a new file changes the inode


def _stamp(path: str, stat: Callable) -> Stamp | None:
    try:
        st = stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class PoolWatch:
    def __init__(self, stat: Callable = os.stat) -> None:
        self._stat = stat
        self._path: str | None = None
        self._seen: Stamp | None = None

    def remember(self, path: str | None) -> None:
        """The pool file (None: no file) as it is now, just loaded: not a change."""
        self._path = str(Path(path).expanduser()) if path else None
        self._seen = _stamp(self._path, self._stat) if self._path else None

    def changed(self) -> bool:
        """True once for each new state of the file since `remember` (a deleted file is a change
        too: loading it then says what is wrong)."""
        if self._path is None:
            return False
        stamp = _stamp(self._path, self._stat)
        if stamp == self._seen:
            return False
        self._seen = stamp
        return True

