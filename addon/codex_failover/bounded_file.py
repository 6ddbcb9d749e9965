"""Reading a user's file (the pool file, the rules file, a Codex auth.json, the proxy token file)
without a way for the file to hang or swell the proxy: regular files only, a size cap, a non-blocking
open. A FIFO, a device (`/dev/zero`), a directory or a file over the cap is not read: one clear
error instead (an OSError whose `strerror` says what it is), which each caller turns into its one line.

The open is non-blocking, so a FIFO with no writer does not wait for one; its kind is then read from
the open descriptor (fstat), so nothing can be swapped in between; a regular file is read at most
`cap` + 1 bytes, so a file that grows while it is read is refused too.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .core.auth import AuthError, AuthGone, AuthMaterial, auth_from_text

MAX_CONFIG = 4 * 1024 * 1024  # a pool or rules file is a few KiB
MAX_AUTH = 1024 * 1024  # a Codex auth.json is a few KiB
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def _mib(size: int) -> str:
    return f"{size / (1024 * 1024):.3g} MiB"


def read_bytes(path: str | Path, cap: int = MAX_CONFIG, private: bool = False) -> bytes:
    """The bytes of the regular file at `path` (at most `cap`); OSError otherwise. `private`: refuse a
    file that its group or others may read or write (a secret's file, mode 0600)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise OSError(errno.EINVAL, f"it is {kind}, not a regular file: not read")
        if private and st.st_mode & 0o077:
            raise OSError(errno.EPERM, f"its mode is {stat.S_IMODE(st.st_mode):04o}: others may read it; "
                                       f"make it private (chmod 600 {path})")
        if st.st_size > cap:
            raise OSError(errno.EFBIG, f"it is {_mib(st.st_size)}, over the {_mib(cap)} this file may be: not read")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1024 * 1024, cap + 1 - total) or 1):
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise OSError(errno.EFBIG, f"it grew over the {_mib(cap)} this file may be while read: not read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | Path, cap: int = MAX_CONFIG, private: bool = False) -> str:
    """`read_bytes` decoded as UTF-8 (UnicodeDecodeError for other text)."""
    return read_bytes(path, cap, private).decode("utf-8")


def read_auth_file(path: str | Path) -> AuthMaterial:
    """A Codex auth.json, read bounded (core/auth.py parses it); AuthError with one clear line otherwise."""
    path = Path(path).expanduser()
    try:
        text = read_text(path, MAX_AUTH)
    except FileNotFoundError:  # what a missing file means is core/auth.py's (AuthGone), as read_auth_file says
        raise AuthGone(f"cannot read {path}: No such file or directory") from None
    except OSError as exc:
        raise AuthError(f"cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    except UnicodeDecodeError as exc:
        raise AuthError(f"{path} is not UTF-8 text (byte {exc.start + 1}; expected a Codex auth.json)") from None
    return auth_from_text(text, path)
