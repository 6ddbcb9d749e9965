import pytest

from codex_failover.core.units import parse_duration, parse_size

DURATIONS = [
    ("20s", 20.0), ("500ms", 0.5), ("1h30m", 5400.0), ("1h", 3600.0), ("2m", 120.0), ("1m30s", 90.0),
    ("30", 30.0), ("2.5", 2.5), ("1.5s", 1.5), (" 10s ", 10.0), ("10S", 10.0), (30, 30.0), (0.25, 0.25),
    ("0", 0.0), ("0s", 0.0), ("none", 0.0), ("off", 0.0), ("unlimited", 0.0), ("OFF", 0.0),
]
BAD_DURATIONS = ["", "abc", "10x", "s", "-5", "1h-30m", "10 s", "1e400", "nan", True, None, [], "30s junk"]


@pytest.mark.parametrize("text,seconds", DURATIONS)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", BAD_DURATIONS)
def test_parse_duration_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    "text,size",
    [("1MiB", 1048576), ("512KiB", 524288), ("8MB", 8_000_000), ("4096", 4096), (4096, 4096), ("1 mib", 1048576), ("2k", 2048)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "1XB", "-1", True, 1.5])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_size(text)
