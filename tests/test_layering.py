"""The pure/shell line, enforced: only the mitmproxy shell imports mitmproxy (issue 17).
Every other module of the package must import with mitmproxy unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "addon" / "codex_failover"
# The shell: the addon's hooks and what drives mitmproxy's replay and flows.
SHELL = {"addon", "attempt", "client_answers", "held_client", "request_run", "sse_hold", "tls_scope", "warm_conn", "ws_gate"}


def test_only_the_shell_imports_mitmproxy():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in SHELL | {"__init__"})
    code = ("import sys\n"
            "sys.modules['mitmproxy'] = None  # any `import mitmproxy...` now fails\n"
            f"sys.path.insert(0, {str(PACKAGE.parent)!r})\n"
            "import importlib\n"
            "failed = []\n"
            f"for name in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module('codex_failover.' + name)\n"
            "    except ImportError as exc:\n"
            "        failed.append(f'{name}: {exc}')\n"
            "print('\\n'.join(failed))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", "modules outside the shell that need mitmproxy:\n" + done.stdout
    assert len(modules) >= 30
