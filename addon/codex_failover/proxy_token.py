"""The proxy token (mitmproxy's `proxyauth`, USER:TOKEN) from somewhere other than the command line,
where every process on the machine can read it (/proc/PID/cmdline): a private file named by the option
`failover_proxyauth_file` (mode 0600, read bounded: bounded_file.py), or the variable
CODEX_FAILOVER_PROXYAUTH (what `scripts/service install -- --proxyauth USER:TOKEN` writes to the
service's environment file). A `--proxyauth` given on the command line stays in force.

docs/machine-proxy.md, "A proxy token".
"""

from __future__ import annotations

from typing import Mapping

from .bounded_file import read_text

OPTION = "failover_proxyauth_file"
VARIABLE = "CODEX_FAILOVER_PROXYAUTH"
MAX_FILE = 4096


def token(path: str, environ: Mapping[str, str]) -> str | None:
    """USER:TOKEN from the file at `path` (if given) or the variable; None when neither says one.
    ValueError with one clear line for a file that is not private, not readable or not USER:TOKEN."""
    if path:
        from pathlib import Path

        source = Path(path).expanduser()
        try:
            value = read_text(source, MAX_FILE, private=True).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{OPTION} {source}: cannot use it ({getattr(exc, 'strerror', None) or exc})") from None
        where = f"{OPTION} {source}"
    else:
        value, where = environ.get(VARIABLE, "").strip(), VARIABLE
        if not value:
            return None
    user, sep, secret = value.partition(":")
    if not sep or not user or not secret or "\n" in value:
        raise ValueError(f"{where}: expected one line USER:TOKEN (the value is not shown)")
    return value
