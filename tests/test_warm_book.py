"""The warm connections' bookkeeping (warm_book.py): which connection an attempt uses, when a dial
is needed, what is kept idle and for how long. Pure, on an injected clock."""

from __future__ import annotations

import pytest

from codex_failover.core.warm_book import CLOSED, OPEN, Await, Dial, Use, WarmBook

K = ("https", "api.example", 443, None)
OTHER = ("https", "other.example", 443, None)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def opened(book: WarmBook, key=K, multiplexed: bool = True):
    """A connection for `key` that was dialled, is open and now idle."""
    dial = book.assign(key)
    assert isinstance(dial, Dial), f"expected a dial, got {dial}"
    book.opened(dial.slot, multiplexed)
    book.released(dial.slot)
    return dial.slot


def test_the_first_attempt_dials(clock):
    book = WarmBook(clock)
    got = book.assign(K)
    assert isinstance(got, Dial)
    assert got.slot.active == 1


@pytest.mark.parametrize("multiplexed", [True, False])
def test_an_idle_open_connection_is_reused(clock, multiplexed):
    book = WarmBook(clock)
    slot = opened(book, multiplexed=multiplexed)
    got = book.assign(K)
    assert got == Use(slot)
    assert slot.active == 1


def test_http2_carries_attempts_side_by_side_up_to_its_stream_limit(clock):
    book = WarmBook(clock, max_streams=3)
    slot = opened(book)
    uses = [book.assign(K) for _ in range(3)]
    assert uses == [Use(slot)] * 3
    assert isinstance(book.assign(K), Dial), "the fourth attempt needs a connection of its own"


def test_a_busy_http11_connection_is_not_shared(clock):
    book = WarmBook(clock)
    slot = opened(book, multiplexed=False)
    assert book.assign(K) == Use(slot)
    assert isinstance(book.assign(K), Dial)


def test_attempts_wait_for_a_connection_being_dialled_while_its_protocol_is_unknown(clock):
    book = WarmBook(clock)
    dial = book.assign(K)
    assert book.assign(K) == Await(dial.slot)


def test_a_key_known_to_speak_http11_does_not_wait_for_a_busy_dial(clock):
    book = WarmBook(clock)
    opened(book, multiplexed=False)
    book.assign(K)  # the open one is busy now
    dial = book.assign(K)
    assert isinstance(dial, Dial)
    assert isinstance(book.assign(K), Dial), "an HTTP/1.1 dial serves one attempt only"


def test_keys_do_not_share_connections(clock):
    book = WarmBook(clock)
    opened(book, K)
    assert isinstance(book.assign(OTHER), Dial)


def test_a_failed_dial_is_forgotten_and_the_next_attempt_dials_again(clock):
    book = WarmBook(clock)
    dial = book.assign(K)
    book.failed(dial.slot)
    assert dial.slot.state == CLOSED
    again = book.assign(K)
    assert isinstance(again, Dial)
    assert again.slot is not dial.slot


def test_a_closed_connection_is_not_assigned(clock):
    book = WarmBook(clock)
    slot = opened(book)
    book.closed(slot)
    assert isinstance(book.assign(K), Dial)


@pytest.mark.parametrize("table", [
    # (what is there, whether a prewarm dials)
    ("nothing", True),
    ("an idle open HTTP/2 connection", False),
    ("a busy HTTP/2 connection with free streams", False),
    ("a busy HTTP/1.1 connection", True),
    ("a dial underway", False),
])
def test_prewarm_dials_only_when_the_next_attempt_would_have_to(clock, table):
    what, dials = table
    book = WarmBook(clock)
    if what == "an idle open HTTP/2 connection":
        opened(book)
    elif what == "a busy HTTP/2 connection with free streams":
        opened(book)
        book.assign(K)
    elif what == "a busy HTTP/1.1 connection":
        opened(book, multiplexed=False)
        book.assign(K)
    elif what == "a dial underway":
        book.assign(K)
    got = book.prewarm(K)
    assert isinstance(got, Dial) if dials else got is None, f"{what}: prewarm gave {got}"


def test_at_most_one_speculative_dial_per_key(clock):
    book = WarmBook(clock)
    assert isinstance(book.prewarm(K), Dial)
    assert book.prewarm(K) is None


def test_a_speculative_dial_is_awaited_by_the_next_attempt_and_then_used(clock):
    book = WarmBook(clock)
    dial = book.prewarm(K)
    assert dial.slot.active == 0, "nothing is counted on a speculative dial"
    assert book.assign(K) == Await(dial.slot)
    assert dial.slot.active == 1, "the waiting attempt is counted on it"
    book.opened(dial.slot, multiplexed=False)
    book.released(dial.slot)
    assert book.assign(K) == Use(dial.slot)


def test_idle_connections_expire_after_the_idle_timeout(clock):
    book = WarmBook(clock, idle_timeout=60)
    slot = opened(book)
    clock.now += 59
    assert book.expired() == []
    clock.now += 1
    assert book.expired() == [slot]


def test_a_busy_connection_never_expires(clock):
    book = WarmBook(clock, idle_timeout=60)
    slot = opened(book)
    book.assign(K)
    clock.now += 3600
    assert book.expired() == []
    assert slot.state == OPEN


def test_idle_connections_beyond_the_per_key_bound_expire_longest_idle_first(clock):
    book = WarmBook(clock, max_idle_per_key=2)
    slots = []
    for _ in range(4):
        dial = book.assign(K)
        book.opened(dial.slot, multiplexed=False)
        slots.append(dial.slot)
    for slot in slots:
        clock.now += 1
        book.released(slot)
    assert book.expired() == slots[:2]


def test_idle_connections_are_bounded_in_all_whatever_the_keys(clock):
    """Keys carry the credential: a client using a key per request must not make the proxy keep a
    connection for each; the longest idle go first."""
    book = WarmBook(clock, max_idle=3)
    slots = []
    for i in range(5):
        dial = book.assign(("https", "api.test", 443, None, f"client:{i}"))
        book.opened(dial.slot, multiplexed=True)
        clock.now += 1
        book.released(dial.slot)
        slots.append(dial.slot)
    assert book.expired() == slots[:2]
