"""Reading a user's YAML file with errors that name the file."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from .bounded_file import read_text

_QUOTED = re.compile(r"'[^']{5,}'|\"[^\"]{5,}\"")


def read_yaml(source: Path, label: str, error: type[Exception]) -> object:
    """The parsed document of `source`; `error("<label> <path>: …")` when unreadable or not YAML."""
    try:
        text = read_text(source)  # regular files only, size-capped, never blocking (bounded_file.py)
    except OSError as exc:
        raise error(f"{label} {source}: cannot read it ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{label} {source}: {describe(exc)}") from None


def describe(exc: yaml.YAMLError) -> str:
    """Where and what, on one line. PyYAML's own text quotes the offending lines, which may hold a
    secret (a proxy URL's password, a pasted key): only the position and the problem are kept."""
    mark = getattr(exc, "problem_mark", None)
    # The problem itself quotes the token after `*` or `!` ("found undefined alias 'sk-…'"): a quoted
    # word longer than an escape or a character is dropped.
    problem = _QUOTED.sub("(not shown)", getattr(exc, "problem", None) or "not parsable")
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"not valid YAML{where}: {problem}"
