"""Reading the rules file: the YAML half of core/rules.py, which only parses the document.

Why apart: core/ does no file I/O and imports no YAML library; this module reads the file (errors
that name it) and hands the document to `core.rules.parse_rules`.
"""

from __future__ import annotations

from pathlib import Path

from .core.rules import Rules, RulesError, parse_rules
from .yaml_file import read_yaml

# Installed (pip install <clone> or git+…), the rules are package data (copied there by setup.py); in a
# clone, and in an editable install, they are the repository's rules/.
_PACKAGED = Path(__file__).resolve().parent / "rules" / "default.yaml"
DEFAULT_RULES_PATH = _PACKAGED if _PACKAGED.is_file() else Path(__file__).resolve().parents[2] / "rules" / "default.yaml"


def load_rules(path: str | Path | None = None) -> Rules:
    """The rules of the file at `path` (the bundled `rules/default.yaml` without one)."""
    source = Path(path).expanduser() if path else DEFAULT_RULES_PATH
    return parse_rules(read_yaml(source, "rules file", RulesError), str(source))
