import sys
from pathlib import Path

import pytest

# The process harness (fake upstream, mitmdump, client) lives in scripts/ and is shared with the
# demo and the measurement scripts.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from codex_failover.rules import load_rules

# Copies of ../shared/fixtures (wire/ and live-codex-0.169/), vendored so a clean clone tests alone.
FIXTURES = Path(__file__).resolve().parent / "fixtures"
WIRE = FIXTURES / "wire"
LIVE = FIXTURES / "live"


@pytest.fixture(scope="session")
def rules():
    return load_rules()
