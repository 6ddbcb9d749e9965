"""codex_failover.ws: see docs/architecture.md#layout."""
