"""End to end: a session that failed over keeps its account-bound state where it was made.

The fake upstream binds the encrypted content it makes (compaction items, encrypted reasoning) to
the credential that got it, and refuses another credential's with HTTP 400
`invalid_encrypted_content`, as the real service does. The client's own key is at its usage limit
(or overloaded); the pooled `work` serves. Each test fails without provenance: the request after
the compaction went to the client's own (cooling) credential and got its usage-limit error.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from harness import ProxyProcess, pool_yaml, post_responses

pytestmark = pytest.mark.e2e

OWN_LIMITED = "sk-test-own-usage-limit"
OWN_OVERLOADED = "sk-test-own-overload-503"
WORK = "sk-test-work-good"
LIVE_171 = Path(__file__).resolve().parent / "fixtures" / "live-0.171"


def proxy_for(tmp_path, fake, **policy) -> ProxyProcess:
    text, env = pool_yaml(fake.base, [("work", WORK)], **policy)
    return ProxyProcess(tmp_path / "proxy", text, {**env, "XDG_STATE_HOME": str(tmp_path / "state")})


def events(body: bytes) -> list[dict]:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))
    return out


def items_done(body: bytes) -> list[dict]:
    return [e["item"] for e in events(body) if e.get("type") == "response.output_item.done"]


def turn(input_items: list, session: str = "thread-1") -> dict:
    return {"model": "gpt-fake", "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
            "input": input_items, "prompt_cache_key": session}


USER = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go on"}]}


def test_after_a_failover_the_compaction_and_the_requests_after_it_stay_on_the_credential_that_made_them(
        fake, tmp_path):
    url = f"{fake.base}/v1/responses"
    proxy = proxy_for(tmp_path, fake)
    try:
        first = post_responses(proxy.port, url, OWN_LIMITED, turn([USER]))  # own: 429 usage limit -> work
        assert first.status == 200, first.body[:300]
        reasoning = [i for i in items_done(first.body) if i["type"] == "reasoning"]
        assert reasoning and reasoning[0]["encrypted_content"].startswith("enc.")

        # Codex compacts: the history (with work's encrypted reasoning) and a compaction_trigger.
        compact = post_responses(proxy.port, url, OWN_LIMITED, turn([USER, *reasoning, {"type": "compaction_trigger"}]))
        assert compact.status == 200, compact.body[:300]
        item = next(i for i in items_done(compact.body) if i["type"] == "compaction")

        # The next request carries work's compaction item: it goes to work, and work can read it.
        after = post_responses(proxy.port, url, OWN_LIMITED, turn([item, USER]))
        assert after.status == 200, after.body[:400]
        assert b"Hello from " + WORK.encode() in after.body
        log = proxy.log()
    finally:
        proxy.stop()
    served = [(r["credential"], r.get("compaction"), r.get("foreign_encrypted")) for r in fake.model_requests()]
    assert served == [(OWN_LIMITED, 0, 0), (WORK, 0, 0), (WORK, 0, 0), (WORK, 1, 0)], served
    assert "goes only to credential work: carries a compaction item made by credential work" in log
    assert "not tried: client cooling (usage_limit, 59m left)" in log  # the compaction's own credential, skipped


def test_when_the_credential_holding_the_state_cannot_serve_the_client_gets_its_condition(fake, tmp_path):
    url = f"{fake.base}/v1/responses"
    proxy = proxy_for(tmp_path, fake, cooldown_wait="0s")
    try:
        assert post_responses(proxy.port, url, OWN_LIMITED, turn([USER])).status == 200  # moved to work
        compact = post_responses(proxy.port, url, OWN_LIMITED, turn([USER, {"type": "compaction_trigger"}]))
        item = next(i for i in items_done(compact.body) if i["type"] == "compaction")
        fake.overload_next(WORK, scenario="usage-limit")
        limited = post_responses(proxy.port, url, OWN_LIMITED, turn([item, USER]))  # work: 429, nowhere else
        again = post_responses(proxy.port, url, OWN_LIMITED, turn([item, USER]))  # work cooling: not dialled
        log = proxy.log()
    finally:
        proxy.stop()
    assert limited.status == 429 and again.status == 429, (limited.body[:300], again.body[:300])
    error = json.loads(again.body)["error"]
    assert error["type"] == "usage_limit_reached", error
    assert 3500 < error["resets_in_seconds"] <= 3600 and error["resets_at"] > time.time(), error  # Codex prints the time
    assert [c["credential"] for c in error["credentials"]] == ["work"]
    assert "made by credential work" in error["not_moved_because"]
    served = [r["credential"] for r in fake.model_requests()]
    assert served == [OWN_LIMITED, WORK, WORK, WORK], served  # the own account never saw work's state
    assert "credential work, which holds this request's state, is cooling" in log


def test_a_request_pinned_to_a_credential_resting_for_an_overload_is_probed_and_served(fake, tmp_path):
    """The credential holding the session's state is resting for an overload (a guess, not a fact):
    the pinned request is held 0.5 s and tried there, and served, instead of `503 (not dialled)` for
    the whole rest (a usage limit is a fact: that one is still not dialled, test above)."""
    url = f"{fake.base}/v1/responses"
    proxy = proxy_for(tmp_path, fake)
    try:
        assert post_responses(proxy.port, url, OWN_LIMITED, turn([USER])).status == 200  # moved to work
        compact = post_responses(proxy.port, url, OWN_LIMITED, turn([USER, {"type": "compaction_trigger"}]))
        item = next(i for i in items_done(compact.body) if i["type"] == "compaction")
        fake.overload_next(WORK, scenario="overload")
        busy = post_responses(proxy.port, url, OWN_LIMITED, turn([USER], session="thread-2"))  # work overloaded: rests
        started = time.monotonic()
        pinned = post_responses(proxy.port, url, OWN_LIMITED, turn([item, USER]))
        took = time.monotonic() - started
        log = proxy.log()
    finally:
        proxy.stop()
    assert busy.status == 503, busy.body[:300]
    assert pinned.status == 200, pinned.body[:400]
    assert b"Hello from " + WORK.encode() in pinned.body
    assert 0.4 < took < 5.0, took
    assert "rests for an overload; probing it in 0.5s" in log, log[-3000:]
    served = [(r["credential"], r.get("compaction")) for r in fake.model_requests()]
    assert served[-1] == (WORK, 1), served


def test_the_compact_endpoint_fails_over_and_its_result_is_bound_to_the_credential_that_made_it(fake, tmp_path):
    base = f"{fake.base}/v1"
    proxy = proxy_for(tmp_path, fake)
    try:
        body = {"model": "gpt-fake", "input": [USER], "instructions": "compact"}
        compacted = post_responses(proxy.port, base + "/responses/compact", OWN_OVERLOADED, body)
        assert compacted.status == 200, compacted.body[:300]
        output = json.loads(compacted.body)["output"]
        after = post_responses(proxy.port, base + "/responses", OWN_OVERLOADED, turn([*output, USER]))
        assert after.status == 200, after.body[:300]
    finally:
        proxy.stop()
    served = [(r["path"].rsplit("/", 1)[-1], r["credential"]) for r in fake.model_requests()]
    assert served == [("compact", OWN_OVERLOADED), ("compact", WORK), ("responses", WORK)], served


def test_a_moved_lite_request_reaches_the_spare_byte_identical_but_for_what_the_move_must_cut(fake, tmp_path):
    doc = json.loads((LIVE_171 / "chatgpt_http_post_responses_first.body.json").read_text())
    doc["input"].append({"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": "made-elsewhere"})
    doc["client_metadata"]["x-codex-turn-state"] = "ts-own"
    raw = json.dumps(doc, indent=1, ensure_ascii=False).encode()  # whatever formatting the client chose
    expected = json.loads(raw)
    del expected["input"][-1]["encrypted_content"]
    del expected["client_metadata"]["x-codex-turn-state"]
    expected_bytes = json.dumps(expected, indent=1, ensure_ascii=False).encode()
    headers = {"x-openai-internal-codex-responses-lite": "true", "x-codex-turn-state": "ts-own"}
    proxy = proxy_for(tmp_path, fake)
    try:
        reply = post_responses(proxy.port, f"{fake.base}/v1/responses", OWN_OVERLOADED, raw, headers=headers)
        assert reply.status == 200, reply.body[:300]
    finally:
        proxy.stop()
    own, moved = fake.model_requests()
    assert own["credential"] == OWN_OVERLOADED and own["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert moved["credential"] == WORK
    assert moved["lite"] and moved["turn_state"] is None and moved["turn_state_in_body"] is None
    assert moved["body_sha256"] == hashlib.sha256(expected_bytes).hexdigest()


def test_which_credential_made_the_compaction_survives_a_restart(fake, tmp_path):
    """In the state store (ids and digests only): after a restart the request carrying work's
    compaction still goes to work, not back to the client's own account."""
    url = f"{fake.base}/v1/responses"
    proxy = proxy_for(tmp_path, fake)
    try:
        assert post_responses(proxy.port, url, OWN_LIMITED, turn([USER])).status == 200
        compact = post_responses(proxy.port, url, OWN_LIMITED, turn([USER, {"type": "compaction_trigger"}]))
        item = next(i for i in items_done(compact.body) if i["type"] == "compaction")
    finally:
        proxy.stop()
    text, env = pool_yaml(fake.base, [("work", WORK)])
    again = ProxyProcess(tmp_path / "proxy2", text, {**env, "XDG_STATE_HOME": str(tmp_path / "state")})
    try:
        after = post_responses(again.port, url, OWN_OVERLOADED, turn([item, USER]))  # another client key, even
        assert after.status == 200, after.body[:300]
        log = again.log()
    finally:
        again.stop()
    assert fake.model_requests()[-1]["credential"] == WORK
    assert "made by credential work" in log
    data = (tmp_path / "state" / "codex-failover" / "state.sqlite").read_bytes()
    assert item["encrypted_content"].encode() not in data and b"sk-test" not in data  # no content, no secret
