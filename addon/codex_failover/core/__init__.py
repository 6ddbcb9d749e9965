"""codex_failover.core: see docs/architecture.md#layout."""
