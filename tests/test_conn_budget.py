"""core/conn_budget.py: connections per peer, capped."""

from codex_failover.core.conn_budget import ConnectionBudget, peer_key


def test_a_peer_holds_at_most_cap_connections_at_once():
    budget = ConnectionBudget(cap=2)
    assert budget.admit("uid:65534") and budget.admit("uid:65534")
    assert not budget.admit("uid:65534")  # a third at once: refused
    assert budget.admit("uid:1001")  # another peer's own count
    budget.release("uid:65534")
    assert budget.open("uid:65534") == 1 and budget.admit("uid:65534")
    budget.release("uid:65534")
    budget.release("uid:65534")
    assert budget.open("uid:65534") == 0
    budget.release("uid:65534")  # (a release too many is harmless)
    assert budget.open("uid:65534") == 0


def test_no_cap():
    budget = ConnectionBudget(cap=0)
    assert all(budget.admit("ip:192.0.2.7") for _ in range(5000))


def test_peer_keys():
    assert peer_key(1000, "127.0.0.1") == "uid:1000"
    assert peer_key(None, "192.0.2.7") == "ip:192.0.2.7"
    assert peer_key(None, None) is None
