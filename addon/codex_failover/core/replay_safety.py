"""May this request move to another credential, and where must it go? Pure: decided before an
attempt leaves.

A failover that corrupts a conversation is worse than none (docs/architecture.md#replay-safety):
- `previous_response_id` or a `compaction` item binds the request to the account holding that
  state: it goes to the credential that made it (`bound_to`, known from provenance.py), and only
  there; when nobody here made it, to the request's own credential;
- input `reasoning` items with `encrypted_content` cannot be read by another account: by default
  they move with that field stripped (their summaries stay), unless they go back to the credential
  that made them; `encrypted_reasoning: pin` binds them like a compaction item;
- the user can pin a request with the `x-codex-failover-pin: true` header;
- `x-oai-attestation` (the Codex Desktop app and IDE extension, openai/codex#20619): the host app's
  device attestation, generated fresh for each backend call of the signed-in account. It binds the
  device and that account's request, not the conversation: a request carrying it may move, and an
  attempt on another account goes without it (`codex_request.ACCOUNT_SCOPED`), as the CLI's requests
  always do. It is never shown to another account, so one device is never presented as the user of
  several accounts, and the request is not held to an account that cannot serve it
  (docs/decisions.md#x-oai-attestation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .provenance import needs_of

PIN_HEADER = "x-codex-failover-pin"
ATTESTATION = "x-oai-attestation"  # the host app's attestation: kept on the account it was made for only
TURN_STATE = "x-codex-turn-state"  # also in client_metadata (WebSocket, and Lite bodies)
STRIP = "strip"
PIN = "pin"


@dataclass(frozen=True)
class MovePolicy:
    movable: bool
    why_pinned: str | None = None  # shown in logs, comments and error bodies
    strip_reasoning: bool = False  # carries encrypted reasoning (stripped where its maker is not the target)
    bound_to: str | None = None  # not movable: the credential key holding its state (None: its own credential)
    reasoning_owners: tuple[str | None, ...] = ()  # per encrypted reasoning item, in input order: who made it

    def strips(self, key: str, is_client: bool) -> list[int]:
        """Which encrypted reasoning items (by their place among them) an attempt on credential `key`
        must go without: those another credential made, and those of unknown origin unless the
        attempt is the client's own (where they came from, as far as anyone here knows)."""
        return [i for i, owner in enumerate(self.reasoning_owners)
                if owner != key and not (owner is None and is_client)]

    @property
    def prefers(self) -> str | None:
        """A movable request's best first choice: who made its latest encrypted reasoning."""
        return next((o for o in reversed(self.reasoning_owners) if o is not None), None)


def nobody(keys: tuple[str, ...]) -> str | None:
    """The default `owner`: no artifact's maker is known (nothing tracks provenance)."""
    return None


def assess(body: object, headers: Mapping[str, str], encrypted_reasoning: str = STRIP,
           owner: Callable[[tuple[str, ...]], str | None] = nobody) -> MovePolicy:
    """`owner(keys)` names the credential key that made an artifact (provenance.Provenance.owner)."""
    if headers.get(PIN_HEADER, "").strip().lower() in ("1", "true", "yes"):
        return MovePolicy(False, f"pinned by the {PIN_HEADER} header")
    if not isinstance(body, dict):
        return MovePolicy(True)
    needs = needs_of(body)
    owners = tuple(owner(keys) for keys in needs.reasoning)
    bound = [owner(keys) for keys in needs.bound]
    if encrypted_reasoning == PIN:
        bound = list(owners) + bound
    if bound:
        maker = next((o for o in reversed(bound) if o is not None), None)
        return MovePolicy(False, _why(body, encrypted_reasoning, maker), bool(owners), maker, owners)
    return MovePolicy(True, strip_reasoning=bool(owners), reasoning_owners=owners)


def _why(body: dict[str, Any], encrypted_reasoning: str, maker: str | None) -> str:
    items = raw if isinstance(raw := body.get("input"), list) else []
    if body.get("previous_response_id"):
        what = "previous_response_id"
    elif any(_is_item(i, "compaction") for i in items):
        what = "a compaction item"
    else:
        what = "encrypted reasoning and encrypted_reasoning is pin"
    if maker is None:
        return f"carries {what} (its state lives on this account)"
    return f"carries {what} made by credential {shown(maker)} (its state lives on that account)"


def shown(key: str) -> str:
    """A credential key as logs name it: a pooled credential's name, or the client's own."""
    return "client" if key.startswith("client") else key


def _is_item(item: object, kind: str) -> bool:
    return isinstance(item, dict) and item.get("type") == kind


def strip_encrypted_reasoning(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of `body` whose input reasoning items have no `encrypted_content`; all else equal."""
    items = body.get("input")
    if not isinstance(items, list):
        return body
    stripped = [
        {k: v for k, v in item.items() if k != "encrypted_content"} if _is_item(item, "reasoning") else item
        for item in items
    ]
    return {**body, "input": stripped}


def removals(body: dict[str, Any], strip: list[int], foreign: bool) -> list[tuple[dict[str, Any], str]]:
    """The members a copy of `body` goes without (body_edit.remove_members): the `encrypted_content`
    of the reasoning items `strip` names (their place among the encrypted ones), and, on another
    account than the client's (`foreign`), the turn state Codex echoes in `client_metadata`."""
    items = raw if isinstance(raw := body.get("input"), list) else []
    encrypted = [i for i in items if _is_item(i, "reasoning") and i.get("encrypted_content")]
    cuts: list[tuple[dict[str, Any], str]] = [(encrypted[n], "encrypted_content") for n in strip if n < len(encrypted)]
    metadata = body.get("client_metadata")
    if foreign and isinstance(metadata, dict) and TURN_STATE in metadata:
        cuts.append((metadata, TURN_STATE))
    return cuts
