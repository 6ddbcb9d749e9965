"""The pool file (`--set failover_config=PATH`): spare credentials and the failover policy.

Loading is all-or-nothing: any problem is a `ConfigError` naming the file, the field and what is
wrong, so the proxy never runs half-configured. Secrets are read here (auth files, environment
variables) but never appear in an error message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

from .auth import APIKEY, CHATGPT, AuthError, AuthMaterial, auth_from_document, read_auth_file
from .recovery import RecoveryConfigError, RecoveryPolicy, parse_recovery
from .routes import DIRECT, RouteError, parse_routes
from .units import parse_duration
from .yaml_file import read_yaml

DEFAULT_BASE_URL = {
    CHATGPT: "https://chatgpt.com/backend-api/codex",
    APIKEY: "https://api.openai.com/v1",
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Policy:
    max_attempts: int = 4
    bootstrap_timeout: float = 30.0
    overload_cooldown: float = 60.0
    use_client_credential: bool = True
    max_retry_after: float = 5.0
    response_timeout: float = 120.0
    max_cooldown: float = 7 * 24 * 3600.0
    cross_kind: bool = False
    encrypted_reasoning: str = "strip"  # or "pin": see replay_safety.py
    cooldown_wait: float = 2.0  # hold a request this long at most for a cooling credential to recover
    selection: str = "fill-first"  # or "round-robin", among credentials of one priority
    session_idle: float = 3600.0  # a session's stickiness to a credential expires after this idle time
    max_sessions: int = 10000  # sessions remembered at most (least recently used forgotten first)
    connect_timeout: float = 10.0  # an attempt not connected (to its proxy or upstream) by then failed before dispatch
    route_backoff: float = 30.0  # first backoff of a dead route endpoint; doubles per failure
    route_backoff_max: float = 300.0  # the longest backoff


@dataclass(frozen=True)
class Credential:
    name: str
    auth: AuthMaterial
    base_url: str
    source: str  # where the secret came from (a path or an env var name), never the secret
    priority: int = 0  # lower is tried earlier
    auth_file: str | None = None  # re-read when it changes on disk
    route: str = "direct"  # the egress its attempts take

    @property
    def kind(self) -> str:
        return self.auth.kind


@dataclass(frozen=True)
class PoolConfig:
    credentials: tuple[Credential, ...] = ()
    policy: Policy = field(default_factory=Policy)
    source: str | None = None
    base_urls: tuple[str, ...] = ()  # more model endpoints to gate (e.g. Codex's openai_base_url)
    routes: dict = field(default_factory=dict)  # route name -> tuple of Endpoint, or None (direct)
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    notes: tuple[str, ...] = ()  # values clamped to their bounds, logged at load

    @property
    def gated_base_urls(self) -> tuple[str, ...]:
        return (*self.base_urls, *(c.base_url for c in self.credentials))


_POLICY_FIELDS = {
    "max_attempts": "int",
    "bootstrap_timeout": "duration",
    "overload_cooldown": "duration",
    "use_client_credential": "bool",
    "max_retry_after": "duration",
    "response_timeout": "duration",
    "max_cooldown": "duration",
    "cross_kind": "bool",
    "encrypted_reasoning": ("strip", "pin"),
    "cooldown_wait": "duration",
    "selection": ("fill-first", "round-robin"),
    "session_idle": "duration",
    "max_sessions": "count",
    "connect_timeout": "duration",
    "route_backoff": "duration",
    "route_backoff_max": "duration",
}


def load_pool(path: str | Path | None, environ: Mapping[str, str] | None = None) -> PoolConfig:
    if not path:
        return PoolConfig()
    source = Path(path).expanduser()
    doc = read_yaml(source, "pool file", ConfigError)
    return parse_pool(doc, str(source), os.environ if environ is None else environ, source.parent)


def parse_pool(doc: object, source: str, environ: Mapping[str, str], base_dir: Path) -> PoolConfig:
    where = f"pool file {source}"
    if doc is None:
        doc = {}
    top = _mapping(doc, where, {"credentials", "policy", "base_urls", "routes", "recovery"})
    try:
        recovery, notes = parse_recovery(top.get("recovery"), f"{where}: recovery")
    except RecoveryConfigError as exc:
        raise ConfigError(str(exc)) from None
    try:
        routes = parse_routes(top.get("routes"))
    except RouteError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    policy = _policy({} if top.get("policy") is None else top["policy"], f"{where}: policy")
    creds = top.get("credentials")
    creds = [] if creds is None else creds
    if not isinstance(creds, list):
        raise ConfigError(f"{where}: credentials: expected a list")
    seen: set[str] = set()
    parsed = []
    for i, item in enumerate(creds):
        cred = _credential(item, f"{where}: credentials[{i}]", environ, base_dir)
        if cred.route != DIRECT and cred.route not in routes:
            known = ", ".join(sorted(routes)) or "none defined"
            raise ConfigError(f"{where}: credentials[{i}].route: unknown route {cred.route!r} (routes: {known})")
        if cred.name in seen:
            raise ConfigError(f"{where}: credentials[{i}].name: duplicate name {cred.name!r}")
        seen.add(cred.name)
        parsed.append(cred)
    urls = top.get("base_urls")
    if urls is not None and not isinstance(urls, list):
        raise ConfigError(f"{where}: base_urls: expected a list of URLs")
    base_urls = tuple(_base_url(u, f"{where}: base_urls[{i}]") for i, u in enumerate(urls or []))
    return PoolConfig(tuple(parsed), policy, source, base_urls, routes, recovery, tuple(notes))


def _mapping(value: object, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(map(str, set(value) - allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    return value


def _policy(doc: object, where: str) -> Policy:
    fields = _mapping(doc, where, set(_POLICY_FIELDS))
    values: dict[str, Any] = {}
    for key, value in fields.items():
        here = f"{where}.{key}"
        kind = _POLICY_FIELDS[key]
        if kind in ("int", "count"):
            top = 32 if kind == "int" else 10_000_000
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ConfigError(f"{here}: expected a whole number from 1 to {top}, got {value!r}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{here}: expected true or false, got {value!r}")
        elif isinstance(kind, tuple):
            if value not in kind:
                raise ConfigError(f"{here}: expected one of {', '.join(kind)}, got {value!r}")
        else:
            try:
                value = parse_duration(value)
            except ValueError as exc:
                raise ConfigError(f"{here}: {exc}") from None
        values[key] = value
    if values.get("connect_timeout", 1) == 0:
        raise ConfigError(f"{where}.connect_timeout: must be > 0 (a failure never hangs a client)")
    if values.get("response_timeout", 1) == 0:
        raise ConfigError(f"{where}.response_timeout: must be > 0 (a failure never hangs a client)")
    return Policy(**values)


def _credential(doc: object, where: str, environ: Mapping[str, str], base_dir: Path) -> Credential:
    entry = _mapping(doc, where, {"name", "auth_file", "api_key_env", "base_url", "priority", "route"})
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{where}.name: expected 1-64 characters of letters, digits, '.', '_' or '-', got {name!r}")
    has_file, has_env = "auth_file" in entry, "api_key_env" in entry
    if has_file == has_env:
        raise ConfigError(f"{where} ({name}): give exactly one of auth_file or api_key_env")
    if has_file:
        auth, source = _auth_file(entry["auth_file"], f"{where}.auth_file", base_dir)
    else:
        auth, source = _api_key_env(entry["api_key_env"], f"{where}.api_key_env", environ)
    base_url = entry.get("base_url", DEFAULT_BASE_URL[auth.kind])
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"{where}.priority: expected a whole number (lower is tried first), got {priority!r}")
    route = entry.get("route", DIRECT)
    if not isinstance(route, str) or not route:
        raise ConfigError(f"{where}.route: expected a route name")
    return Credential(name, auth, _base_url(base_url, f"{where}.base_url"), source, priority,
                      source if has_file else None, route)


def _auth_file(value: object, where: str, base_dir: Path) -> tuple[AuthMaterial, str]:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a path to a Codex auth.json")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    try:
        return read_auth_file(path), str(path)
    except AuthError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _api_key_env(value: object, where: str, environ: Mapping[str, str]) -> tuple[AuthMaterial, str]:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected the name of an environment variable")
    key = environ.get(value, "").strip()
    if not key:
        raise ConfigError(f"{where}: environment variable {value} is not set or empty")
    return auth_from_document({"OPENAI_API_KEY": key}, value), f"${value}"


def _base_url(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a URL")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"{where}: expected an http(s) URL without query, got {value!r}")
    if parts.username or parts.password:
        raise ConfigError(f"{where}: credentials in the URL are not allowed")
    return value.rstrip("/")
