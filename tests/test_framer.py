"""The framer: chunking invariance, byte-exactness, line ends, glued frames, bounds."""

import pytest
from conftest import LIVE, WIRE
from hypothesis import given, settings, strategies as st

from codex_failover.core.framer import Event, FramerError, SSEFramer


def frame(data: bytes, chunk: int | None = None, **kw) -> list[Event]:
    framer = SSEFramer(**kw)
    out: list[Event] = []
    step = chunk or max(len(data), 1)
    for i in range(0, len(data), step):
        out += framer.feed(data[i : i + step])
    return out + framer.close()


def shape(events):
    return [(e.raw, e.frames, e.data) for e in events]


CASES = [
    # (name, input, [(raw, frames, data)])
    ("lf event", b"event: a\ndata: {}\n\n", [(b"event: a\ndata: {}\n\n", 3, "{}")]),
    ("crlf event", b"data: x\r\n\r\n", [(b"data: x\r\n\r\n", 2, "x")]),
    ("cr event", b"data: x\r\r", [(b"data: x\r\r", 2, "x")]),
    ("mixed ends", b"data: a\r\ndata: b\rdata: c\n\n", [(b"data: a\r\ndata: b\rdata: c\n\n", 4, "a\nb\nc")]),
    ("multi-line data", b"data: a\ndata:b\ndata:  c\n\n", [(b"data: a\ndata:b\ndata:  c\n\n", 4, "a\nb\n c")]),
    ("comment alone", b": keepalive\n", [(b": keepalive\n", 1, None)]),
    ("comment then blank", b": k\n\n", [(b": k\n", 1, None), (b"\n", 1, None)]),
    ("comment inside block", b"event: a\n: note\ndata: 1\n\n", [(b"event: a\n: note\ndata: 1\n\n", 4, "1")]),
    ("stray blank lines", b"\n\r\n\r", [(b"\n", 1, None), (b"\r\n", 1, None), (b"\r", 1, None)]),
    ("id and retry fields", b"id: 7\nretry: 10\ndata: z\n\n", [(b"id: 7\nretry: 10\ndata: z\n\n", 4, "z")]),
    ("final frame without blank line", b"data: {}\n\ndata: last", [(b"data: {}\n\n", 2, "{}"), (b"data: last", 1, "last")]),
    ("final line with newline only", b"data: last\n", [(b"data: last\n", 1, "last")]),
    ("empty data", b"data:\n\n", [(b"data:\n\n", 2, "")]),
    ("no data field", b"event: ping\n\n", [(b"event: ping\n\n", 2, None)]),
    ("glued data", b'data: {"n":1}data: {"n":2}\n\n', [(b'data: {"n":1}', 1, '{"n":1}'), (b'data: {"n":2}\n\n', 2, '{"n":2}')]),
    ("glued event", b'event: a\ndata: {"n":1}event: b\ndata: {"n":2}\n\n',
     [(b'event: a\ndata: {"n":1}', 2, '{"n":1}'), (b'event: b\ndata: {"n":2}\n\n', 3, '{"n":2}')]),
    ("glued three", b'data: {}data: {"a":{}}data: {}\n\n', [(b"data: {}", 1, "{}"), (b'data: {"a":{}}', 1, '{"a":{}}'), (b"data: {}\n\n", 2, "{}")]),
    ("marker inside string", b'data: {"s":"}data: {x}"}\n\n', [(b'data: {"s":"}data: {x}"}\n\n', 2, '{"s":"}data: {x}"}')]),
    ("escaped quote then marker in string", b'data: {"s":"\\"}data: "}\n\n', [(b'data: {"s":"\\"}data: "}\n\n', 2, '{"s":"\\"}data: "}')]),
    ("utf-8 payload", 'data: {"t":"héllo ✓"}\n\n'.encode(), [('data: {"t":"héllo ✓"}\n\n'.encode(), 2, '{"t":"héllo ✓"}')]),
]


@pytest.mark.parametrize("name,data,expected", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 7])
def test_table(name, data, expected, chunk):
    assert shape(frame(data, chunk)) == expected


def test_crlf_split_across_chunks_is_one_line_end():
    framer = SSEFramer()
    assert framer.feed(b"data: a\r") == []
    assert framer.feed(b"\n") == []
    assert framer.feed(b"\r") == []
    events = framer.feed(b"\n")
    assert shape(events) == [(b"data: a\r\n\r\n", 2, "a")]


def test_trailing_cr_waits_for_next_byte_then_resolves_at_close():
    framer = SSEFramer()
    assert framer.feed(b": c\r") == []
    assert shape(framer.close()) == [(b": c\r", 1, None)]


def test_utf8_sequence_split_across_chunks():
    data = 'data: {"t":"✓✓"}\n\n'.encode()
    cut = data.index("✓".encode()) + 1
    framer = SSEFramer()
    events = framer.feed(data[:cut]) + framer.feed(data[cut:])
    assert events[0].payload == {"t": "✓✓"}


def test_ws_message_is_the_same_event_type():
    msg = Event.from_ws_message('{"type":"response.created"}')
    sse = frame(b'data: {"type":"response.created"}\n\n')[0]
    assert type(msg) is type(sse)
    assert msg.type == sse.type == "response.created"
    assert msg.frames == 1
    assert Event.from_ws_message(b"").is_heartbeat


def test_lazy_json_and_type():
    ev = frame(b"data: not json\n\n")[0]
    assert ev.payload is None
    assert ev.type is None
    assert not ev.is_heartbeat
    assert frame(b"data:   \n\n")[0].is_heartbeat
    assert frame(b'data: {"type":"x"}\n\n')[0].type == "x"
    assert frame(b'data: ["a"]\n\n')[0].type is None


def test_line_too_long_is_a_clear_error():
    framer = SSEFramer(max_line_bytes=100)
    framer.feed(b"data: " + b"x" * 90)
    with pytest.raises(FramerError, match="max_line_bytes"):
        framer.feed(b"x" * 20)


def test_long_block_of_short_lines_is_bounded():
    framer = SSEFramer(max_line_bytes=100, max_block_bytes=1000)
    with pytest.raises(FramerError, match="max_block_bytes"):
        for _ in range(200):
            framer.feed(b"data: xxxx\n")


def test_big_event_within_limits():
    body = b"data: " + b"x" * (2 * 1024 * 1024) + b"\n\n"
    events = frame(body, 1024)
    assert len(events) == 1
    assert events[0].raw == body


def test_take_pending_returns_unframed_bytes():
    framer = SSEFramer()
    framer.feed(b"data: {}\n\ndata: par")
    assert framer.take_pending() == b"data: par"


@pytest.mark.parametrize("path", sorted(WIRE.glob("sse/*.sse")) + sorted(LIVE.glob("*.sse")), ids=lambda p: p.name)
def test_fixtures_roundtrip_under_any_chunking(path):
    data = path.read_bytes()
    ref = frame(data)
    assert b"".join(e.raw for e in ref) == data
    for chunk in (1, 5, 64):
        assert frame(data, chunk) == ref


# -- property tests -------------------------------------------------------------------------

_line_end = st.sampled_from([b"\n", b"\r\n", b"\r"])
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def sse_streams(draw):
    import json

    parts = []
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["event", "comment", "blank", "glued"]))
        eol = draw(_line_end)
        if kind == "comment":
            parts.append(b": " + draw(st.binary(max_size=8)).replace(b"\r", b"").replace(b"\n", b"") + eol)
        elif kind == "blank":
            parts.append(eol)
        else:
            payload = json.dumps({"type": "x", "v": draw(_json_value)}).encode()
            lines = []
            if draw(st.booleans()):
                lines.append(b"event: e" + eol)
            lines.append(b"data: " + payload + (b"data: " + payload if kind == "glued" else b"") + eol)
            parts.append(b"".join(lines) + eol)
    if draw(st.booleans()):
        parts.append(b"data: tail")
    return b"".join(parts)


@st.composite
def chunkings(draw, data: bytes):
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=12))) if data else []
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_chunking_gives_the_same_events(data):
    stream = data.draw(sse_streams())
    chunks = data.draw(chunkings(stream))
    framer = SSEFramer()
    events = [e for c in chunks for e in framer.feed(c)] + framer.close()
    assert events == frame(stream)
    assert b"".join(e.raw for e in events) == stream
    assert all(e.frames >= 1 for e in events)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 50))
def test_random_bytes_never_crash(blob, step):
    framer = SSEFramer(max_line_bytes=64, max_block_bytes=256)
    out = []
    try:
        for i in range(0, len(blob), step):
            out += framer.feed(blob[i : i + step])
        out += framer.close()
    except FramerError:
        return
    assert b"".join(e.raw for e in out) == blob
    for e in out:
        assert (e.data, e.payload, e.type) is not None  # lazy parsing never raises
