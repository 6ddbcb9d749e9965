"""The addon as a mitmproxy script, for an installed package (`codex-failover`, `python -m
codex_failover`, or `mitmdump -s $(python -c 'import codex_failover.mitm.mitmdump_script as m; print(m.__file__)')`).
A clone's entry is addon/failover.py, which checks the dependencies first."""

from codex_failover.mitm.addon import FailoverAddon

addons = [FailoverAddon()]
