"""codex-failover: the mitmproxy entry point.

    mitmdump -s addon/failover.py [--set failover_config=pool.yaml]

Everything lives in the `codex_failover` package next to this file.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:  # works without installing the package, too
    sys.path.insert(0, _here)

from codex_failover.addon import FailoverAddon  # noqa: E402

addons = [FailoverAddon()]
