"""The proxy's run id (core/run_ids.py), in front of every request and WebSocket id."""

from codex_failover.core.run_ids import run_id
from codex_failover.ws.gate import WebsocketGate


def test_four_base36_digits_that_differ_for_starts_a_second_apart():
    ids = {run_id(1_760_000_000 + s) for s in range(36 ** 2)}
    assert len(ids) == 36 ** 2
    assert all(len(i) == 4 and i.isalnum() and i == i.lower() for i in ids)
    assert run_id(0) == "0000"
    assert run_id(36 ** 4 + 35) == "000z"  # a 19-day cycle


def test_the_gate_puts_the_run_in_front_of_its_socket_ids():
    gate = WebsocketGate("k3x9")
    assert gate._prefix + "w1" == "k3x9-w1"
    assert WebsocketGate()._prefix == ""
