"""codex_failover.mitm: see docs/architecture.md#layout."""
