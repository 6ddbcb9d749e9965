"""The error taxonomy and allow-list, from the parsed YAML rules file (`rules/default.yaml`).

The strings that recognise rejections are data, not code, so a user can extend them without a
release. A broken file is a `RulesError` that names the file, the field and the problem. Reading the
file is the shell's (`rules_file.load_rules`): the core takes the parsed document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .units import parse_size

KNOWN_ITEM_TYPES = frozenset({"message", "reasoning", "function_call", "custom_tool_call"})
KNOWN_PART_TYPES = frozenset({"output_text", "summary_text", "text", "reasoning_text", "refusal"})


class RulesError(ValueError):
    pass


@dataclass(frozen=True)
class RejectionRule:
    klass: str
    codes: frozenset[str] = frozenset()
    types: frozenset[str] = frozenset()
    messages: tuple[str, ...] = ()
    require_message: tuple[str, ...] = ()
    statuses: frozenset[int] = frozenset()
    plain_text: bool = False  # `statuses` only for a body that is not a JSON error (a gateway's page)
    headers: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (response header name, values it may contain)
    params: frozenset[str] = frozenset()  # the error's `param`
    require_status: frozenset[int] = frozenset()  # when given, only an error with one of these statuses
    require_param: frozenset[str] = frozenset()  # when given, only an error naming no `param` or one of these

    @property
    def reads_the_body(self) -> bool:
        return bool(self.codes or self.types or self.messages or self.headers or self.params)

    def matches(self, code: str, kind: str, message: str, param: str = "", status: object = None,
                headers: Mapping[str, str] | None = None) -> bool:
        """`code`, `kind`, `message` and `param` must already be lower-cased; `headers` by lower-case name."""
        hit = code in self.codes or kind in self.types or any(m in message for m in self.messages) \
            or param in self.params or self._header_hit(headers or {})
        if not hit:
            return False
        if self.require_status and status not in self.require_status:
            return False
        if self.require_param and param and param not in self.require_param:
            return False
        return not self.require_message or any(m in message for m in self.require_message)

    def _header_hit(self, headers: Mapping[str, str]) -> bool:
        return any(v in headers.get(name, "").lower() for name, values in self.headers for v in values)


@dataclass(frozen=True)
class Rules:
    source: str
    max_frames: int = 48
    max_bytes: int = 1024 * 1024
    bufferable_events: frozenset[str] = frozenset()
    empty_items: frozenset[str] = frozenset()
    empty_parts: frozenset[str] = frozenset()
    rejections: tuple[RejectionRule, ...] = field(default_factory=tuple)

    def rejection_class(self, code: object, kind: object, message: object, status: object = None,
                        plain_text: bool = False, param: object = None,
                        headers: Mapping[str, str] | None = None) -> str | None:
        """The rejection class of an error, by its body (and the answer's headers, by lower-case name)
        first, then by its HTTP status. `plain_text`: the body was no JSON error at all (then `message`
        is its text, if any)."""
        code_s, kind_s, msg_s, param_s = (_lower(code), _lower(kind), _lower(message), _lower(param))
        for rule in self.rejections:
            if rule.reads_the_body and rule.matches(code_s, kind_s, msg_s, param_s, status, headers):
                return rule.klass
        if isinstance(status, int) and not isinstance(status, bool):
            for rule in sorted(self.rejections, key=lambda r: not r.plain_text):
                if status in rule.statuses and (plain_text or not rule.plain_text):
                    return rule.klass
        return None


def _lower(value: object) -> str:
    return value.lower() if isinstance(value, str) else ""


def parse_rules(doc: object, source: str = "<rules>") -> Rules:
    where = f"rules file {source}"
    top = _mapping(doc, where, {"version", "bootstrap", "bufferable", "rejections"})
    if top.get("version", 1) != 1:
        raise RulesError(f"{where}: version: unsupported value {top.get('version')!r} (expected 1)")
    boot = _mapping(top.get("bootstrap", {}), f"{where}: bootstrap", {"max_frames", "max_bytes"})
    buf = _mapping(top.get("bufferable"), f"{where}: bufferable", {"events", "empty_items", "empty_parts"})
    return Rules(
        source=source,
        max_frames=_positive_int(boot.get("max_frames", 48), f"{where}: bootstrap.max_frames"),
        max_bytes=_size(boot.get("max_bytes", "1MiB"), f"{where}: bootstrap.max_bytes"),
        bufferable_events=_strings(buf.get("events", []), f"{where}: bufferable.events"),
        empty_items=_known(buf.get("empty_items", []), KNOWN_ITEM_TYPES, f"{where}: bufferable.empty_items"),
        empty_parts=_known(buf.get("empty_parts", []), KNOWN_PART_TYPES, f"{where}: bufferable.empty_parts"),
        rejections=_rejections(top.get("rejections"), f"{where}: rejections"),
    )


def _mapping(value: object, where: str, allowed: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise RulesError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise RulesError(f"{where}: unknown field(s) {', '.join(map(str, unknown))} (allowed: {', '.join(sorted(allowed))})")
    return value


def _strings(value: object, where: str) -> frozenset[str]:
    return frozenset(_string_list(value, where))


def _string_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RulesError(f"{where}: expected a list of non-empty strings")
    return tuple(v.lower() for v in value)


def _known(value: object, known: frozenset[str], where: str) -> frozenset[str]:
    values = _strings(value, where)
    unknown = sorted(values - known)
    if unknown:
        raise RulesError(f"{where}: unknown type(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return values


def _positive_int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RulesError(f"{where}: expected a whole number >= 1, got {value!r}")
    return value


def _size(value: object, where: str) -> int:
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise RulesError(f"{where}: {exc}") from None
    if size < 1:
        raise RulesError(f"{where}: must be at least 1 byte")
    return size


def _rejections(value: object, where: str) -> tuple[RejectionRule, ...]:
    if not isinstance(value, list) or not value:
        raise RulesError(f"{where}: expected a non-empty list of rules")
    allowed = {"class", "codes", "types", "messages", "require_message", "statuses", "plain_text", "headers", "params",
               "require_status", "require_param"}
    rules = []
    for i, item in enumerate(value):
        here = f"{where}[{i}]"
        entry = _mapping(item, here, allowed)
        klass = entry.get("class")
        if not isinstance(klass, str) or not klass:
            raise RulesError(f"{here}.class: expected a non-empty string")
        rule = RejectionRule(
            klass=klass,
            codes=_strings(entry.get("codes", []), f"{here}.codes"),
            types=_strings(entry.get("types", []), f"{here}.types"),
            messages=_string_list(entry.get("messages", []), f"{here}.messages"),
            require_message=_string_list(entry.get("require_message", []), f"{here}.require_message"),
            statuses=_statuses(entry.get("statuses", []), f"{here}.statuses"),
            plain_text=_bool(entry.get("plain_text", False), f"{here}.plain_text"),
            headers=_headers(entry.get("headers", {}), f"{here}.headers"),
            params=_strings(entry.get("params", []), f"{here}.params"),
            require_status=_statuses(entry.get("require_status", []), f"{here}.require_status"),
            require_param=_strings(entry.get("require_param", []), f"{here}.require_param"),
        )
        if rule.plain_text and not rule.statuses:
            raise RulesError(f"{here}.plain_text: applies to statuses, and the rule lists none")
        if not (rule.reads_the_body or rule.statuses):
            raise RulesError(f"{here}: needs at least one of codes, types, messages, headers, params, statuses")
        rules.append(rule)
    return tuple(rules)


def _statuses(value: object, where: str) -> frozenset[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 100 <= v <= 599 for v in value
    ):
        raise RulesError(f"{where}: expected a list of HTTP status codes (100-599)")
    return frozenset(value)


def _headers(value: object, where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`{header-name: [values it may contain]}`, names and values lower-cased."""
    if not isinstance(value, dict):
        raise RulesError(f"{where}: expected a mapping of header names to lists of values")
    out = []
    for name, values in value.items():
        if not isinstance(name, str) or not name:
            raise RulesError(f"{where}: header names must be non-empty strings")
        out.append((name.lower(), _string_list(values, f"{where}.{name}")))
    return tuple(out)


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise RulesError(f"{where}: expected true or false, got {value!r}")
    return value
