"""Auth files re-read when they change on disk."""

import json
import os

from conftest import WIRE

from codex_failover.auth_watch import AuthWatch
from codex_failover.config import Credential
from codex_failover.core.auth import read_auth_file


def test_changed_file_is_reloaded_and_bad_content_keeps_the_old(tmp_path):
    path = tmp_path / "auth.json"
    doc = json.loads((WIRE / "auth" / "auth.chatgpt.example.json").read_text())
    path.write_text(json.dumps(doc))
    cred = Credential("work", read_auth_file(path), "https://x", str(path), 0, str(path))
    watch = AuthWatch()
    watch.remember((cred,))
    assert watch.refresh((cred,)) == ((cred,), [], [])  # unchanged: nothing read

    doc["tokens"]["access_token"] = doc["tokens"]["access_token"] + "x"
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(1, 2))
    (new,), reloaded, problems = watch.refresh((cred,))
    assert reloaded == ["work"]
    assert problems == []
    assert new.auth.token.endswith("x")

    path.write_text("{broken")
    os.utime(path, ns=(3, 4))
    (same,), reloaded, problems = watch.refresh((new,))
    assert same is new
    assert reloaded == []
    assert "cannot be used" in problems[0]
    assert doc["tokens"]["access_token"] not in problems[0]

    path.write_text(json.dumps({"OPENAI_API_KEY": "sk-x"}))
    os.utime(path, ns=(5, 6))
    (same,), reloaded, problems = watch.refresh((new,))
    assert same is new
    assert "apikey" in problems[0]
