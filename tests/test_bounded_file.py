"""bounded_file.py: regular files only, size-capped, never blocking."""

from __future__ import annotations

import os

import pytest

from codex_failover.bounded_file import read_auth_file, read_bytes, read_text
from codex_failover.core.auth import AuthError


def test_a_regular_file_is_read(tmp_path):
    path = tmp_path / "pool.yaml"
    path.write_text("credentials: []\n")
    assert read_text(path) == "credentials: []\n"


@pytest.mark.parametrize("make, says", [
    (lambda p: os.mkfifo(p), "a FIFO"),  # no writer: the open does not wait for one
    (lambda p: os.symlink("/dev/zero", p), "a character device"),
    (lambda p: p.mkdir(), "a directory"),
])
def test_what_is_not_a_regular_file_is_not_read(tmp_path, make, says):
    path = tmp_path / "f"
    make(path)
    with pytest.raises(OSError) as caught:
        read_bytes(path)
    assert says in caught.value.strerror


def test_a_file_over_the_cap_is_not_read(tmp_path):
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(5 * 1024 * 1024)
    with pytest.raises(OSError, match="over the 4 MiB"):
        read_bytes(path)
    assert len(read_bytes(path, cap=6 * 1024 * 1024)) == 5 * 1024 * 1024


def test_a_private_file_must_be_private(tmp_path):
    path = tmp_path / "token"
    path.write_text("me:secret")
    path.chmod(0o644)
    with pytest.raises(OSError, match="chmod 600"):
        read_bytes(path, private=True)
    path.chmod(0o600)
    assert read_bytes(path, private=True) == b"me:secret"


def test_an_auth_fifo_is_one_clear_error(tmp_path):
    path = tmp_path / "auth.json"
    os.mkfifo(path)
    with pytest.raises(AuthError, match="a FIFO, not a regular file"):
        read_auth_file(path)
