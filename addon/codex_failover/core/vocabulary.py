"""The words for what happened to an attempt, one definition each: the verdict type and every reason
class the code names. Used by the rules file's classes, the classifier, taxonomy, transport, the
failover loop, recovery, the pool, the log lines, the flows' marks and the metrics' labels. What each
one means for a user: docs/decisions.md#decisions-and-reason-classes."""

from __future__ import annotations

import enum


class Verdict(enum.StrEnum):
    """What became of an attempt (a log line's `verdict=`, a metric's label, a flow's mark).
    The classifier decides the first four; an attempt that never reached it ends in one of the
    last three."""

    HOLD = "hold"  # (the classifier's only: not decided yet)
    COMMIT = "commit"  # output: streamed to the client
    FAILOVER = "failover"  # a rejection: the request moves on
    DELIVER = "deliver"  # an answer that is the client's own (a terminal error, a 4xx): delivered as is
    FAILED = "failed"  # the connection failed, or no complete answer came
    RECOVER = "recover"  # recovery: a transient failure, retried on the same credential
    CANCELLED = "cancelled"  # the client left


# A reason class (a log line's `reason=`): one of the names below, or a rejection class of the rules file.
Reason = str

# The rules file's rejection classes the code itself names (their strings live in rules/default.yaml).
OVERLOADED = "overloaded"
SLOW_DOWN = "slow_down"
CAPACITY = "capacity"
SERVER_ERROR_RETRYABLE = "server_error_retryable"
RATE_LIMITED = "rate_limited"
USAGE_LIMIT = "usage_limit"
# What a rejection says about the account, the route or the model (docs/decisions.md#every-shape-and-what-it-means).
ACCOUNT_DISABLED = "account_disabled"  # the account cannot use Codex at all (a deactivated workspace, no Codex in its plan)
WORKSPACE_LIMIT = "workspace_limit"  # the workspace's spend cap: a long rest
EDGE_BLOCKED = "edge_blocked"  # the edge in front of the service refused the route (a challenge, a block, a region)
FORBIDDEN_PAGE = "forbidden_page"  # a 403 that is no JSON error and names no edge: says nothing about account or route
MODEL_NOT_ENTITLED = "model_not_entitled"  # this account's plan lacks the requested model

# The WebSocket gate's: a turn named a response its socket does not hold (previous_response_not_found).
STATE_LOST = "state_lost"

# The classifier's (an event stream held in its bootstrap window).
HOLDING = "holding"
OUTPUT = "output"
NOT_JSON = "not_json"
FRAME_BUDGET = "frame_budget"
BYTE_BUDGET = "byte_budget"
TIMEOUT = "timeout"
TERMINAL_ERROR = "terminal_error"
INCOMPLETE = "incomplete"
CLOSED_BEFORE_OUTPUT = "closed_before_output"
STALLED_BEFORE_OUTPUT = "stalled_before_output"  # silent past first_event_timeout in an extended hold
FRAMING_ERROR = "framing_error"
UPSTREAM_BROKEN = "upstream_broken"  # the stream broke while held: what came is delivered, then the break

# A synchronous answer's (taxonomy).
AUTH_REJECTED = "auth_rejected"  # 401/403
UPSTREAM_5XX = "upstream_5xx"  # a 5xx that names no rejection
CLIENT_ERROR = "client_error"
OK = "ok"

# A connection's (transport: what a failed upstream connection means for replay safety).
PRE_DISPATCH = "pre_dispatch"  # connection refused / timed out while connecting
HOST_NETWORK = "host_network"  # name resolution failed, network unreachable
TLS_FAILED = "tls_failed"  # certificate verification or handshake failure
AMBIGUOUS = "ambiguous"  # the request may have been sent
ROUTE_DOWN = "route_down"  # every endpoint of a credential's route failed before dispatch
RESPONSE_TIMEOUT = "response_timeout"  # the request left; no response head came
INCOMPLETE_RESPONSE = "incomplete_response"  # the request left; its response never completed
NOT_PROCESSED = "not_processed"  # HTTP/2: above a GOAWAY's last_stream_id, the server never saw it: may move
UPGRADE_REFUSED = "upgrade_refused"  # a WebSocket upgrade answered with a non-101 that is no known rejection
HANDSHAKE_FAILED = "handshake_failed"  # a WebSocket upgrade failed during the handshake

# Recovery's (a committed stream kept whole).
NO_TERMINAL = "no_terminal_event"  # the stream ended without response.completed/failed/incomplete
TRANSPORT = "transport_error"

# The pool's.
USAGE_WINDOW_FULL = "usage_window_full"  # a rate-limit window at its credential's max_usage_percent
NO_USABLE_CREDENTIAL = "no_usable_credential"  # nothing may serve the request now
CLIENT_GONE = "client_gone"

# Families.
OVERLOAD_CLASSES = frozenset({OVERLOADED, SLOW_DOWN, CAPACITY, SERVER_ERROR_RETRYABLE})
USAGE_LIMIT_REASONS = frozenset({USAGE_LIMIT, USAGE_WINDOW_FULL})
OUT_OF_ROTATION = frozenset({AUTH_REJECTED, ACCOUNT_DISABLED})  # a pooled credential leaves rotation for these
ROUTE_CLASSES = frozenset({EDGE_BLOCKED})  # the route's, not the account's: counted against the route
# When nothing served and one of these decided, the client gets the upstream's own answer as it came
# (its 403 page, its "model is not supported" 400), not one of ours (failover_loop.FailoverLoop._end).
AS_IT_CAME = frozenset({EDGE_BLOCKED, FORBIDDEN_PAGE, MODEL_NOT_ENTITLED})
