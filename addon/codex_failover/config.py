"""The pool file (`--set failover_config=PATH`): spare credentials and the failover policy.

Loading is all-or-nothing: any problem is a `ConfigError` naming the file, the field and what is
wrong, so the proxy never runs half-configured. Secrets are read here (auth files, environment
variables) but never appear in an error message: URLs are shown without their user:password part,
and a value that looks like a key (pasted where a name, a path or a URL belongs) is never shown.
`load_pool` adds the line and column of the field when it can find them in the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from .bounded_file import read_auth_file, read_text
from .core.auth import APIKEY, CHATGPT, AuthError, AuthMaterial, auth_from_document
from .core.cooldown_policy import OverloadConfigError, parse_overload
from .core.policy import Credential, Policy, PoolConfig, Skipped, StateConfig
from .core.recovery import RecoveryConfigError, parse_recovery
from .core.routes import DIRECT, RouteError, looks_like_key, looks_like_secret, name_problem, parse_routes, redact_url
from .core.units import parse_duration
from .yaml_file import read_yaml

DEFAULT_BASE_URL = {
    CHATGPT: "https://chatgpt.com/backend-api/codex",
    APIKEY: "https://api.openai.com/v1",
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PASTED_KEY = ("looks like an API key, not the name of an environment variable; put the key in an "
               "environment variable and name that variable here")
ACCOUNT_FIELD_MAX = 128  # organization / project


__all__ = ["ConfigError", "Credential", "Policy", "PoolConfig", "StateConfig", "load_pool", "parse_pool"]
# The data types live in core/policy.py (the core takes its policy as data); re-exported here, where
# they are read from the pool file.


class ConfigError(ValueError):
    pass


class _Unusable(Exception):
    """A credential whose auth file cannot be used now: skipped, not fatal (config never stops the
    start for one credential's file)."""

    def __init__(self, skipped: Skipped) -> None:
        super().__init__(skipped.problem)
        self.skipped = skipped


_POLICY_FIELDS = {
    "max_attempts": "int",
    "bootstrap_timeout": "duration",
    "first_event_timeout": "duration",
    "max_hold": "duration",
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
    "usage_recheck": "duration",
}


def load_pool(path: str | Path | None, environ: Mapping[str, str] | None = None) -> PoolConfig:
    if not path:
        return PoolConfig()
    source = Path(path).expanduser()
    doc = read_yaml(source, "pool file", ConfigError)
    try:
        return parse_pool(doc, str(source), os.environ if environ is None else environ, source.parent)
    except ConfigError as exc:
        raise ConfigError(_with_position(str(exc), f"pool file {source}: ", source)) from None


_FIELD = re.compile(r"[^\s:.\[\]()]+(?:\.[^\s:.\[\]()]+|\[\d+\])*(?=:| \()")
_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _with_position(message: str, prefix: str, source: Path) -> str:
    """`message` ("pool file X: <field>: <problem>") followed by the field's line and column in the
    file, when the field can be found (best effort: the message is returned as it is otherwise)."""
    if not message.startswith(prefix):
        return message
    m = _FIELD.match(message, len(prefix))
    if m is None:
        return message
    try:
        node = yaml.compose(read_text(source), Loader=yaml.SafeLoader)
    except (OSError, ValueError, yaml.YAMLError):
        return message
    found = None
    for key, index in _STEP.findall(m.group(0)):
        if key and isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
        elif index and isinstance(node, yaml.SequenceNode) and int(index) < len(node.value):
            node = node.value[int(index)]
        else:
            node = None
        if node is None:
            break
        found = node
    if found is None:
        return message
    mark = found.start_mark
    return f"{message} (line {mark.line + 1}, column {mark.column + 1})"


def _show(value: object) -> str:
    """A user's value for a message: its repr, unless it could be a credential (then only its type)."""
    text = value if isinstance(value, str) else repr(value)
    if looks_like_secret(text) or "://" in text or len(text) > 64:
        return f"a {type(value).__name__} that is not shown (it may be a secret)"
    return repr(value)


def parse_pool(doc: object, source: str, environ: Mapping[str, str], base_dir: Path) -> PoolConfig:
    try:
        return _parse_pool(doc, source, environ, base_dir)
    except ConfigError as exc:
        raise ConfigError(_scrub(str(exc), doc)) from None


def _secret_pieces(doc: object) -> set[str]:
    """Strings of the document that must never reach a message: secret-looking values, and the
    user:password part (and each half) of every URL."""
    pieces: set[str] = set()
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
        elif isinstance(item, str):
            text = item.strip()
            if looks_like_secret(text):
                pieces.add(text)
            rest = text.partition("://")[2]
            if "@" in rest:
                userinfo = rest[:rest.rfind("@")]
                user, _, password = userinfo.partition(":")
                pieces.update({userinfo, password} | ({user} if looks_like_secret(user) else set()))
    return {p for p in pieces if len(p) >= 4}


def _scrub(message: str, doc: object) -> str:
    """Second line of defence: whatever the message says, none of the document's secret-looking
    strings survive in it (the first line is that no message formats such a value)."""
    for piece in sorted(_secret_pieces(doc), key=len, reverse=True):
        # Whole pieces only: a password "pass" must not turn "user:password" in the text into "***word".
        message = re.sub(rf"(?<![A-Za-z0-9]){re.escape(piece)}(?![A-Za-z0-9])", "***", message, flags=re.IGNORECASE)
    return message


def _parse_pool(doc: object, source: str, environ: Mapping[str, str], base_dir: Path) -> PoolConfig:
    where = f"pool file {source}"
    if doc is None:
        doc = {}
    top = _mapping(doc, where, {"credentials", "policy", "base_urls", "routes", "recovery", "state", "overload"})
    try:
        recovery, notes = parse_recovery(top.get("recovery"), f"{where}: recovery")
        overload = parse_overload(top.get("overload"), f"{where}: overload", top.get("policy"))
    except (RecoveryConfigError, OverloadConfigError) as exc:
        raise ConfigError(str(exc)) from None
    try:
        routes = parse_routes(top.get("routes"))
    except RouteError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    policy = replace(_policy({} if top.get("policy") is None else top["policy"], f"{where}: policy"), overload=overload)
    creds = [] if (creds := top.get("credentials")) is None else creds
    if not isinstance(creds, list):
        raise ConfigError(f"{where}: credentials: expected a list")
    seen: set[str] = set()
    parsed = []
    skipped = []
    for i, item in enumerate(creds):
        try:
            cred = _credential(item, f"{where}: credentials[{i}]", environ, base_dir)
        except _Unusable as exc:
            if exc.skipped.name in seen:
                raise ConfigError(f"{where}: credentials[{i}].name: duplicate name {exc.skipped.name!r}") from None
            seen.add(exc.skipped.name)
            skipped.append(exc.skipped)
            continue
        if cred.route != DIRECT and cred.route not in routes:
            known = ", ".join(sorted(routes)) or "none defined"
            raise ConfigError(f"{where}: credentials[{i}].route: unknown route {_show(cred.route)} (routes: {known})")
        if cred.name in seen:
            raise ConfigError(f"{where}: credentials[{i}].name: duplicate name {cred.name!r}")
        seen.add(cred.name)
        parsed.append(cred)
    urls = top.get("base_urls")
    if urls is not None and not isinstance(urls, list):
        raise ConfigError(f"{where}: base_urls: expected a list of URLs")
    base_urls = tuple(_base_url(u, f"{where}: base_urls[{i}]") for i, u in enumerate(urls or []))
    state = _state(top.get("state"), f"{where}: state")
    return PoolConfig(tuple(parsed), policy, source, base_urls, routes, recovery, tuple(notes), state, tuple(skipped))


def _state(doc: object, where: str) -> StateConfig:
    if doc is None:
        return StateConfig()
    fields = _mapping(doc, where, {"store", "namespace"})
    store = fields.get("store", "sqlite")
    if not isinstance(store, str) or not (store in ("sqlite", "memory") or store.startswith("sqlite:///")
                                          or store.startswith(("redis://", "rediss://"))):
        raise ConfigError(f"{where}.store: expected sqlite, sqlite:///ABSOLUTE/PATH, redis://HOST:PORT/DB "
                          "(rediss:// for TLS) or memory")
    namespace = fields.get("namespace", "default")
    if not isinstance(namespace, str) or not _NAME.fullmatch(namespace):
        raise ConfigError(f"{where}.namespace: expected 1-64 letters, digits, '.', '_' or '-'")
    return StateConfig(store, namespace)


def _mapping(value: object, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(map(str, set(value) - allowed))
    if unknown:
        shown = [name if not looks_like_secret(name) and len(name) <= 64 else "(a name that is not shown)"
                 for name in unknown]
        raise ConfigError(f"{where}: unknown field(s) {', '.join(shown)} (allowed: {', '.join(sorted(allowed))})")
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
                raise ConfigError(f"{here}: expected a whole number from 1 to {top}, got {_show(value)}")
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{here}: expected true or false, got {_show(value)}")
        elif isinstance(kind, tuple):
            if value not in kind:
                raise ConfigError(f"{here}: expected one of {', '.join(kind)}, got {_show(value)}")
        else:
            try:
                value = parse_duration(value)
            except ValueError as exc:
                problem = exc if _show(value) == repr(value) else "not a duration (examples: 20s, 500ms, 1h30m, 30, off)"
                raise ConfigError(f"{here}: {problem}") from None
        values[key] = value
    if values.get("connect_timeout", 1) == 0:
        raise ConfigError(f"{where}.connect_timeout: must be > 0 (a failure never hangs a client)")
    if values.get("response_timeout", 1) == 0:
        raise ConfigError(f"{where}.response_timeout: must be > 0 (a failure never hangs a client)")
    return Policy(**values)


def _credential(doc: object, where: str, environ: Mapping[str, str], base_dir: Path) -> Credential:
    entry = _mapping(doc, where, {"name", "auth_file", "api_key_env", "base_url", "priority", "route",
                                  "organization", "project", "max_usage_percent"})
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or looks_like_key(name):  # shown everywhere: never a key
        raise ConfigError(f"{where}.name: {name_problem(name, _show(name))}")
    has_file, has_env = "auth_file" in entry, "api_key_env" in entry
    if has_file == has_env:
        raise ConfigError(f"{where} ({name}): give exactly one of auth_file or api_key_env")
    if has_file:
        auth, source = _auth_file(entry["auth_file"], f"{where}.auth_file", base_dir, name)
    else:
        auth, source = _api_key_env(entry["api_key_env"], f"{where}.api_key_env", environ)
    base_url = entry.get("base_url", DEFAULT_BASE_URL[auth.kind])
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"{where}.priority: expected a whole number (lower is tried first), got {_show(priority)}")
    route = entry.get("route", DIRECT)
    if not isinstance(route, str) or not route:
        raise ConfigError(f"{where}.route: expected a route name")
    if "://" in route or "@" in route or looks_like_secret(route):
        raise ConfigError(f"{where}.route: expected a route name, not a URL or a secret (not shown); "
                          "define the proxy URLs under routes: and name the route here")
    organization = _account_field(entry, "organization", where, auth.kind)
    project = _account_field(entry, "project", where, auth.kind)
    headroom = entry.get("max_usage_percent", 100)
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 1 <= headroom <= 100:
        raise ConfigError(f"{where}.max_usage_percent: expected a number from 1 to 100 (e.g. 80: stop choosing it "
                          f"once a rate-limit window is 80% used), got {_show(headroom)}")
    return Credential(name, auth, _base_url(base_url, f"{where}.base_url"), source, priority,
                      source if has_file else None, route, organization, project, float(headroom))


def _account_field(entry: Mapping[str, Any], key: str, where: str, kind: str) -> str | None:
    """`organization` / `project`: an id sent as OpenAI-Organization / OpenAI-Project on the
    attempts moved to this (API-key) credential. Never echoed: only what is wrong with it."""
    if key not in entry:
        return None
    value, here = entry[key], f"{where}.{key}"
    header, what = ("OpenAI-Organization", "an organization id (org-...)") if key == "organization" else \
        ("OpenAI-Project", "a project id (proj_...)")
    if kind != APIKEY:
        raise ConfigError(f"{here}: only an API-key credential takes {key} ({header} is an API-key header); "
                          "remove it from this ChatGPT-login credential")
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{here}: expected {what}, sent as {header}")
    if value != value.strip() or not all(" " <= c <= "~" for c in value):
        raise ConfigError(f"{here}: expected printable ASCII without leading or trailing spaces "
                          f"(it is sent as the {header} header)")
    if len(value) > ACCOUNT_FIELD_MAX:
        raise ConfigError(f"{here}: longer than {ACCOUNT_FIELD_MAX} characters (expected {what})")
    if value.lower().startswith(("sk-", "sess-", "bearer ", "eyj")):
        raise ConfigError(f"{here}: looks like an API key, not {what}; "
                          "a key goes in an environment variable named by api_key_env")
    return value


def _auth_file(value: object, where: str, base_dir: Path, name: str) -> tuple[AuthMaterial, str]:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a path to a Codex auth.json")
    if looks_like_secret(value) and "/" not in value and "\\" not in value:
        raise ConfigError(f"{where}: looks like a key or token, not a path to a Codex auth.json "
                          "(an API key goes in an environment variable named by api_key_env)")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    try:
        return read_auth_file(path), str(path)
    except AuthError as exc:
        message = str(exc)
        if any(looks_like_secret(part) for part in re.split(r"[/\\]", value)):
            message = message.replace(str(path), "the file (its path is not shown: part of it looks like a secret)")
            raise ConfigError(f"{where}: {message}") from None  # a secret in the pool file: fix that first
        raise _Unusable(Skipped(name, str(path), message)) from None


def _api_key_env(value: object, where: str, environ: Mapping[str, str]) -> tuple[AuthMaterial, str]:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected the name of an environment variable")
    valid = bool(_ENV_NAME.fullmatch(value))
    if looks_like_secret(value) or len(value) > 64 or (not valid and len(value) >= 20):
        raise ConfigError(f"{where}: {_PASTED_KEY}")
    if not valid:
        hint = " (write it without the '$')" if value.startswith("$") else ""
        raise ConfigError(f"{where}: not a valid environment variable name{hint}: letters, digits and '_', "
                          "not starting with a digit (the value is not shown in case it is a key)")
    key = environ.get(value, "").strip()
    if not key:
        raise ConfigError(f"{where}: environment variable {value} is not set or empty")
    return auth_from_document({"OPENAI_API_KEY": key}, value), f"${value}"


def _base_url(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a URL")
    shown = redact_url(value)  # never the user:password part, query or fragment
    if "@" in value:  # user:password@ (whatever the password holds), or an '@' no API base URL has
        raise ConfigError(f"{where}: credentials in the URL are not allowed ({shown}); "
                          "a credential's secret comes from auth_file or api_key_env")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises on a port that is not a number from 0 to 65535
    except ValueError as exc:
        # urlsplit's own text quotes parts of the URL (a password too): never pass it on.
        problem = "the port is not a number from 1 to 65535" if "port" in str(exc).lower() else "the host part is malformed"
        raise ConfigError(f"{where}: cannot parse the URL: {problem} ({shown})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"{where}: expected an http(s) URL without query or fragment, got {shown}")
    return value.rstrip("/")
