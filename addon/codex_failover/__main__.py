"""`codex-failover` (the installed command) and `python -m codex_failover`: mitmdump with the addon,
listening on 127.0.0.1:8080 (CODEX_FAILOVER_HOST / CODEX_FAILOVER_PORT change the defaults), as
scripts/run starts it from a clone. Every argument goes on to mitmdump, after those defaults, so
`codex-failover -p 9090 --set failover_config=~/.config/codex-failover/pool.yaml` does what it says."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The script mitmdump loads: the clone's entry (its dependency check first) when this package is the
# clone's own, else the package's (pip installed the dependencies).
_CLONE_ENTRY = Path(__file__).resolve().parents[1] / "failover.py"
_PACKAGE_ENTRY = Path(__file__).resolve().parent / "mitm" / "mitmdump_script.py"


def entry() -> Path:
    return _CLONE_ENTRY if _CLONE_ENTRY.is_file() else _PACKAGE_ENTRY


def arguments(argv: list[str]) -> list[str]:
    host, port = os.environ.get("CODEX_FAILOVER_HOST", "127.0.0.1"), os.environ.get("CODEX_FAILOVER_PORT", "8080")
    return ["--listen-host", host, "-p", port, "-s", str(entry()), *argv]


def main(argv: list[str] | None = None) -> int | None:
    from mitmproxy.tools.main import mitmdump

    for stream in (sys.stdout, sys.stderr):  # each log line as it happens, into a pipe or a file too
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    return mitmdump(arguments(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
