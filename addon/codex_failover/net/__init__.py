"""codex_failover.net: see docs/architecture.md#layout."""
