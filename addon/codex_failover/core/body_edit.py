"""Removing members from a JSON request body without re-serialising the rest. Pure.

A moved request must reach its new credential exactly as Codex sent it, apart from what the move
has to change (encrypted reasoning another account cannot read, the old account's turn state).
Re-serialising the parsed body would normalise it (escapes, number forms, whitespace), which
Responses Lite requests must not suffer. So each member to drop is found in the raw bytes by its
exact serialised form and cut out with its comma; everything else stays byte for byte.

Only string values are cut this way (encrypted content and turn states are strings). When a
member's bytes cannot be found exactly as many times as it is to be removed (an unusual escape),
the body is re-serialised instead, compactly, as the fallback.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

Removal = tuple[dict[str, Any], str]  # (the object in the parsed body, the member's name)


def remove_members(raw: bytes, body: dict[str, Any], removals: list[Removal]) -> bytes:
    """`raw` (whose parse is `body`) without the members named in `removals`."""
    if not removals:
        return raw
    wanted = Counter((name, obj[name]) for obj, name in removals if name in obj)
    out = raw
    for (name, value), count in wanted.items():
        cut = _cut_all(out, name, value, count) if isinstance(value, str) else None
        if cut is None:
            return _reserialised(body, removals)
        out = cut
    return out


def _cut_all(raw: bytes, name: str, value: str, count: int) -> bytes | None:
    member = re.compile(re.escape(_dumps(name)) + rb"\s*:\s*" + re.escape(_dumps(value)))
    spans = [m.span() for m in member.finditer(raw)]
    if len(spans) != count:
        return None
    for start, end in reversed(spans):
        raw = _cut(raw, start, end)
    return raw


def _cut(raw: bytes, start: int, end: int) -> bytes:
    """Cut raw[start:end] (one `"name":value`) and the comma that joins it to a neighbour."""
    before = start
    while before > 0 and raw[before - 1] in b" \t\r\n":
        before -= 1
    if before > 0 and raw[before - 1:before] == b",":
        return raw[:before - 1] + raw[end:]
    after = end
    while after < len(raw) and raw[after] in b" \t\r\n":
        after += 1
    if raw[after:after + 1] == b",":
        after += 1
        while after < len(raw) and raw[after] in b" \t\r\n":
            after += 1
    return raw[:start] + raw[after:]


def _dumps(value: str) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode()


def _reserialised(body: dict[str, Any], removals: list[Removal]) -> bytes:
    gone = {(id(obj), name) for obj, name in removals}
    return json.dumps(_without(body, gone), separators=(",", ":"), ensure_ascii=False).encode()


def _without(value: object, gone: set[tuple[int, str]]) -> object:
    if isinstance(value, dict):
        return {k: _without(v, gone) for k, v in value.items() if (id(value), k) not in gone}
    if isinstance(value, list):
        return [_without(v, gone) for v in value]
    return value
