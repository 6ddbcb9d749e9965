"""Provenance and placement: which credential made a request's account-bound state, and where the
request may go because of it. Pure: tables on an injected clock, real-shaped bodies (Codex 0.171)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Clock

from codex_failover.config import Credential, Policy, PoolConfig
from codex_failover.core.auth import AuthMaterial
from codex_failover.core.body_edit import remove_members
from codex_failover.core.framer import _NOT_PARSED
from codex_failover.core.health import Health
from codex_failover.core.planner import client_key, make_plan
from codex_failover.core.provenance import (
    Provenance,
    SseArtifacts,
    artifacts_of_compact,
    artifacts_of_event,
    artifacts_of_message,
    digest,
    needs_of,
)
from codex_failover.core.replay_safety import assess, removals
from codex_failover.core.ws_turns import TurnGate

LIVE_171 = Path(__file__).resolve().parent / "fixtures" / "live-0.171"
COMPACTION_BODY = json.loads((LIVE_171 / "chatgpt_http_post_responses_compaction.body.json").read_text())
AFTER_COMPACTION = json.loads((LIVE_171 / "chatgpt_http_post_responses_after_compaction.body.json").read_text())
FIRST_RAW = (LIVE_171 / "chatgpt_http_post_responses_first.body.json").read_bytes()

OWN = AuthMaterial("chatgpt", "own-token", "acct-own")
WORK = AuthMaterial("chatgpt", "work-token", "acct-work")
HOME = AuthMaterial("chatgpt", "home-token", "acct-home")


def sse(obj: dict) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


def compaction(cid: str = "cmp_1", enc: str = "sealed-for-work") -> dict:
    return {"type": "compaction", "id": cid, "encrypted_content": enc}


def reasoning(rid: str, enc: str) -> dict:
    return {"type": "reasoning", "id": rid, "summary": [], "encrypted_content": enc}


# -- what a credential returned ------------------------------------------------------------


def test_artifacts_of_events_cover_response_ids_compaction_and_encrypted_reasoning():
    assert artifacts_of_event({"type": "response.created", "response": {"id": "resp_9"}}) == ["resp:resp_9"]
    assert artifacts_of_event({"type": "response.output_item.done", "item": compaction()}) == [
        "item:cmp_1", digest("sealed-for-work")]
    assert artifacts_of_event({"type": "response.output_item.done", "item": {"type": "reasoning", "id": "rs_1"}}) == []
    assert artifacts_of_event({"type": "response.output_item.done", "item": {"type": "message", "id": "m"}}) == []
    done = {"type": "response.completed", "response": {"id": "resp_2", "output": [reasoning("rs_2", "e2")]}}
    assert artifacts_of_event(done) == ["resp:resp_2", "item:rs_2", digest("e2")]
    assert artifacts_of_event({"type": "response.output_text.delta", "delta": "hi"}) == []
    assert artifacts_of_message(json.dumps(done)) == artifacts_of_event(done)
    assert artifacts_of_message(b'{"type":"response.output_text.delta","delta":"x"}') == []


def test_a_relayed_stream_is_read_for_artifacts_however_it_is_chunked():
    stream = b"".join([
        sse({"type": "response.created", "response": {"id": "resp_7"}}),
        sse({"type": "response.output_text.delta", "delta": "a" * 100}),
        sse({"type": "response.output_item.done", "item": compaction("cmp_7", "enc7")}),
    ])
    whole = SseArtifacts().feed(stream)
    scanner, chunked = SseArtifacts(), []
    for i in range(0, len(stream), 7):
        chunked += scanner.feed(stream[i:i + 7])
    chunked += scanner.close()
    assert whole == chunked == ["resp:resp_7", "item:cmp_7", digest("enc7")]


def test_every_chunking_finds_what_the_whole_stream_has_and_only_artifact_events_are_parsed():
    """Markers cut between chunks, a marker's event still to come, CRLF line ends, a message item done
    (no artifact: not parsed), and a stream of deltas alone (nothing looked at)."""
    events = [
        {"type": "response.created", "response": {"id": "resp_8"}},
        {"type": "response.output_text.delta", "delta": "x" * 40},
        {"type": "response.output_item.done", "item": {"type": "message", "id": "msg_8", "content": []}},
        {"type": "response.output_item.done", "item": reasoning("rs_8", "enc8")},
        {"type": "response.completed", "response": {"id": "resp_8", "output": [compaction("cmp_8", "c8")]}},
    ]
    want = ["resp:resp_8", "item:rs_8", digest("enc8"), "resp:resp_8", "item:cmp_8", digest("c8")]
    for eol in ("\n", "\r\n"):
        stream = b"".join(f"event: {e['type']}{eol}data: {json.dumps(e)}{eol}{eol}".encode() for e in events)
        for size in (1, 2, 5, 13, 27, 64, len(stream)):
            scanner, found = SseArtifacts(), []
            for i in range(0, len(stream), size):
                found += scanner.feed(stream[i:i + size])
            assert found + scanner.close() == want, (eol, size)
    deltas = b"".join(sse({"type": "response.output_text.delta", "delta": f"d{i}"}) for i in range(20))
    scanner = SseArtifacts()
    framed = scanner.frame(deltas) + scanner.frame(sse(events[2]))
    assert len(framed) == 21 and scanner.take() == []
    assert all(e._payload is _NOT_PARSED for e in framed)  # framed, never parsed


def test_a_compact_endpoint_answer():
    body = json.dumps({"id": "resp_c", "object": "response.compaction", "output": [compaction("cmp_c", "x")]}).encode()
    assert artifacts_of_compact(body) == ["resp:resp_c", "item:cmp_c", digest("x")]
    assert artifacts_of_compact(b"not json") == []


def test_what_a_real_codex_request_carries():
    needs = needs_of(AFTER_COMPACTION)
    item = next(i for i in AFTER_COMPACTION["input"] if i["type"] == "compaction")
    assert needs.bound == (("item:" + item["id"], digest(item["encrypted_content"])),)
    assert needs_of(COMPACTION_BODY).bound == ()  # the compaction request itself: history and a trigger
    assert needs_of({"previous_response_id": "resp_1", "input": []}).bound == (("resp:resp_1",),)


# -- the bounded memory --------------------------------------------------------------------


def test_provenance_expires_when_idle_and_is_bounded():
    clock = Clock(0.0)
    book = Provenance(idle=100, max_entries=3, clock=clock)
    book.record(["a", "b"], "work")
    clock.now = 60
    assert book.owner(["a"]) == "work"  # asked for: used again
    clock.now = 150
    assert book.owner(["a"]) == "work"
    assert book.owner(["b"]) is None  # idle 150 s > 100 s
    book.record(["c", "d", "e"], "home")
    assert len(book) == 3 and book.owner(["a"]) is None  # least recently used out first
    assert book.owner(["zzz", "d"]) == "home"  # found by any of its keys


# -- placement: the table -------------------------------------------------------------------


def cred(name: str, auth: AuthMaterial) -> Credential:
    return Credential(name, auth, "https://chatgpt.com/backend-api/codex", f"{name}.json")


def pool(**policy) -> PoolConfig:
    return PoolConfig(credentials=(cred("work", WORK), cred("home", HOME)), policy=Policy(**policy))


def place(maker: str | None, state: str, body: dict | None = None):
    """The plan for a request carrying a compaction item made by `maker` (None: unknown here),
    with that credential in `state`."""
    health = Health(clock=Clock(1000.0))
    book = Provenance(clock=Clock(0.0))
    key = {"own": client_key(OWN), "work": "work"}.get(maker or "", maker)
    if maker is not None:
        book.record(["item:cmp_1"], key)
    target = key or client_key(OWN)
    if state == "cooling":
        health.cool(target, 60, "overloaded")
    elif state == "limited":
        health.cool(target, 3600, "usage_limit")
    elif state == "out":
        health.take_out(target, "HTTP 401")
    cfg = pool()
    if state == "gone":
        cfg = PoolConfig(credentials=(cred("home", HOME),))
    move = assess(body or {"input": [compaction()]}, {}, owner=book.owner)
    return move, make_plan(OWN, cfg, health, move.movable, None, 0, move.bound_to)


@pytest.mark.parametrize("maker,state,ready,skipped", [
    ("work", "ready", ["work"], []),
    ("work", "cooling", [], [("work", "cooling")]),
    ("work", "limited", [], [("work", "cooling")]),
    ("work", "out", [], [("work", "out")]),
    ("work", "gone", ["client"], []),  # nobody can read it now: the request's own credential, as before
    ("own", "ready", ["client"], []),
    ("own", "limited", [], [("client", "cooling")]),
    (None, "ready", ["client"], []),  # unknown here: today's rule
    (None, "cooling", [], [("client", "cooling")]),
])
def test_a_request_goes_only_to_the_credential_that_made_its_state(maker, state, ready, skipped):
    move, plan = place(maker, state)
    assert not move.movable
    assert [c.name for c in plan.candidates] == ready
    assert [(c.name, why) for c, why in plan.skipped] == skipped
    if maker == "work":
        assert "made by credential work" in move.why_pinned


def test_previous_response_id_names_the_latest_state():
    book = Provenance(clock=Clock(0.0))
    book.record(["item:cmp_1"], "home")
    book.record(["resp:resp_9"], "work")
    move = assess({"previous_response_id": "resp_9", "input": [compaction()]}, {}, owner=book.owner)
    assert move.bound_to == "work"


def test_encrypted_reasoning_is_kept_only_for_its_maker():
    book = Provenance(clock=Clock(0.0))
    book.record([digest("by-work")], "work")
    body = {"input": [reasoning("rs_a", "by-work"), reasoning("rs_b", "unknown")]}
    move = assess(body, {}, owner=book.owner)
    assert move.movable and move.prefers == "work"
    assert move.strips("work", is_client=False) == [1]  # its own kept, the unknown one stripped
    assert move.strips("home", is_client=False) == [0, 1]
    assert move.strips(client_key(OWN), is_client=True) == [0]  # unknown: the client's, as far as we know
    plan = make_plan(OWN, pool(), Health(clock=Clock(0.0)), move.movable, move.prefers)
    assert [c.name for c in plan.candidates][0] == "work"


def test_pin_policy_binds_reasoning_to_its_maker():
    book = Provenance(clock=Clock(0.0))
    book.record([digest("by-work")], "work")
    move = assess({"input": [reasoning("rs_a", "by-work")]}, {}, "pin", owner=book.owner)
    assert not move.movable and move.bound_to == "work"


# -- a moved body: exactly as sent, but for what the move must change ----------------------


def lite_body() -> tuple[bytes, dict]:
    """The real 0.171 Lite body, as pretty-printed bytes (any formatting a client may send), with
    encrypted reasoning and a turn state in client_metadata."""
    doc = json.loads(FIRST_RAW)
    doc["input"].append(reasoning("rs_x", "enc-x"))
    doc["client_metadata"]["x-codex-turn-state"] = "ts-own"
    raw = json.dumps(doc, indent=1, ensure_ascii=False).encode()
    return raw, doc


def test_a_moved_lite_body_is_byte_identical_but_for_the_cut_members():
    raw, doc = lite_body()
    moved = remove_members(raw, doc, removals(doc, [0], foreign=True))
    expected = json.loads(raw)
    del expected["input"][-1]["encrypted_content"]
    del expected["client_metadata"]["x-codex-turn-state"]
    assert moved == json.dumps(expected, indent=1, ensure_ascii=False).encode()
    assert b'"reasoning": {\n  "effort"' in moved or b'"context": "all_turns"' in moved  # Lite's shape untouched


def test_nothing_to_cut_sends_the_clients_bytes():
    raw, doc = lite_body()
    assert remove_members(raw, doc, removals(doc, [], foreign=False)) is raw


@pytest.mark.parametrize("raw", [
    b'{"a":1,"x":"v"}', b'{"x":"v","a":1}', b'{ "x" : "v" }', b'{"a":{"x":"v"},"b":[{"x":"v"}]}',
])
def test_member_cuts_keep_valid_json(raw):
    doc = json.loads(raw)
    targets = [(o, "x") for o in _objects(doc) if "x" in o]
    out = json.loads(remove_members(raw, doc, targets))
    assert "x" not in json.dumps(out)


def _objects(value):
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _objects(v)
    elif isinstance(value, list):
        for v in value:
            yield from _objects(v)


def test_an_unusual_escape_falls_back_to_a_compact_serialisation():
    raw = b'{"x":"\\u0076","a":1}'  # "v" written as an escape: not found verbatim
    doc = json.loads(raw)
    assert remove_members(raw, doc, [(doc, "x")]) == b'{"a":1}'


# -- the WebSocket: a moved turn carries no turn state of the old account --------------------


def test_a_moved_websocket_turn_drops_the_turn_state_in_client_metadata(rules):
    frames = [json.loads(line) for line in (LIVE_171 / "chatgpt_ws_client_frames.jsonl").read_text().splitlines()]
    create = dict(frames[3])  # the turn after the compaction: no previous_response_id
    create["client_metadata"] = {**create["client_metadata"], "x-codex-turn-state": "ts-old-account"}
    raw = json.dumps(create, separators=(",", ":"), ensure_ascii=False).encode()
    gate = TurnGate(rules)
    turn = gate.client_message(raw, True, {})
    moved, is_text = turn.message_for(new_socket=True, foreign=True)
    assert is_text and b"x-codex-turn-state" not in moved
    expected = dict(create, client_metadata={k: v for k, v in create["client_metadata"].items()
                                             if k != "x-codex-turn-state"})
    assert moved == json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode()
    assert b"ws_request_header_x_openai_internal_codex_responses_lite" in moved
    assert turn.message_for(new_socket=False, foreign=False)[0] is raw  # at home: as sent


def test_a_websocket_turn_bound_to_the_socket_s_account_stays(rules):
    book = Provenance(clock=Clock(0.0))
    book.record(["item:cmp_1"], "work")
    gate = TurnGate(rules, owner=book.owner)
    create = {"type": "response.create", "input": [compaction()]}
    turn = gate.client_message(json.dumps(create).encode(), True, {})
    assert turn.stays_home and turn.bound_to == "work"
