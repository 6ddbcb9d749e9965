"""Reading a user's YAML file with errors that name the file."""

from __future__ import annotations

from pathlib import Path

import yaml


def read_yaml(source: Path, label: str, error: type[Exception]) -> object:
    """The parsed document of `source`; `error("<label> <path>: …")` when unreadable or not YAML."""
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{label} {source}: cannot read it ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{label} {source}: not valid YAML: {exc}") from None
