"""May this request move to another credential, and how? Pure: decided before an attempt leaves.

A failover that corrupts a conversation is worse than none (docs/architecture.md#replay-safety):
- `previous_response_id` or a `compaction` item binds the request to the account holding that
  state: it may only be retried on the same credential;
- input `reasoning` items with `encrypted_content` cannot be read by another account: by default
  they move with that field stripped (their summaries stay); `encrypted_reasoning: pin` keeps them;
- the user can pin a request with the `x-codex-failover-pin: true` header.
"""

from __future__ import annotations

from dataclasses import dataclass

PIN_HEADER = "x-codex-failover-pin"
STRIP = "strip"
PIN = "pin"


@dataclass(frozen=True)
class MovePolicy:
    movable: bool
    why_pinned: str | None = None  # shown in logs, comments and error bodies
    strip_reasoning: bool = False  # a moved copy needs its encrypted reasoning removed


def assess(body: object, headers, encrypted_reasoning: str = STRIP) -> MovePolicy:
    if headers.get(PIN_HEADER, "").strip().lower() in ("1", "true", "yes"):
        return MovePolicy(False, f"pinned by the {PIN_HEADER} header")
    if not isinstance(body, dict):
        return MovePolicy(True)
    if body.get("previous_response_id"):
        return MovePolicy(False, "carries previous_response_id (its state lives on this account)")
    items = body.get("input") if isinstance(body.get("input"), list) else []
    if any(_is_item(i, "compaction") for i in items):
        return MovePolicy(False, "carries a compaction item (encrypted for this account)")
    encrypted = any(_is_item(i, "reasoning") and i.get("encrypted_content") for i in items)
    if encrypted and encrypted_reasoning == PIN:
        return MovePolicy(False, "carries encrypted reasoning and encrypted_reasoning is pin")
    return MovePolicy(True, strip_reasoning=encrypted)


def _is_item(item: object, kind: str) -> bool:
    return isinstance(item, dict) and item.get("type") == kind


def strip_encrypted_reasoning(body: dict) -> dict:
    """A copy of `body` whose input reasoning items have no `encrypted_content`; all else equal."""
    items = body.get("input")
    if not isinstance(items, list):
        return body
    stripped = [
        {k: v for k, v in item.items() if k != "encrypted_content"} if _is_item(item, "reasoning") else item
        for item in items
    ]
    return {**body, "input": stripped}

