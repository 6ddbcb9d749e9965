"""Auth files re-read when they change on disk."""

import json
import os

from conftest import WIRE

from codex_failover.auth_watch import AuthWatch
from codex_failover.bounded_file import read_auth_file
from codex_failover.config import Credential
from codex_failover.core.health import Health
from codex_failover.core.policy import PoolConfig, Skipped


def test_changed_file_is_reloaded_and_bad_content_keeps_the_old(tmp_path):
    path = tmp_path / "auth.json"
    doc = json.loads((WIRE / "auth" / "auth.chatgpt.example.json").read_text())
    path.write_text(json.dumps(doc))
    cred = Credential("work", read_auth_file(path), "https://x", str(path), 0, str(path))
    watch = AuthWatch()
    watch.remember((cred,))
    seen = watch.refresh((cred,))
    assert (seen.credentials, seen.reloaded, seen.problems, seen.reload) == ((cred,), [], [], False)

    doc["tokens"]["access_token"] = doc["tokens"]["access_token"] + "x"
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(1, 2))
    seen = watch.refresh((cred,))
    (new,) = seen.credentials
    assert seen.reloaded == ["work"]
    assert seen.problems == []
    assert new.auth.token.endswith("x")

    path.write_text("{broken")
    os.utime(path, ns=(3, 4))
    seen = watch.refresh((new,))
    assert seen.credentials == (new,)
    assert seen.reloaded == []
    assert "cannot be used" in seen.problems[0]
    assert doc["tokens"]["access_token"] not in seen.problems[0]

    path.write_text(json.dumps({"OPENAI_API_KEY": "sk-x"}))
    os.utime(path, ns=(5, 6))
    seen = watch.refresh((new,))
    assert seen.credentials == (new,)
    assert "apikey" in seen.problems[0]


def _logout(path):
    path.write_text(json.dumps({"OPENAI_API_KEY": None, "tokens": None, "last_refresh": None}))


def test_a_removed_or_logged_out_file_takes_the_credential_out_and_its_return_reloads_the_pool(tmp_path, caplog):
    """While running: `codex logout` (or removing the file) is one line naming the file and the fix,
    the credential leaves rotation; a new `codex login` asks for the pool file to be loaded anew."""
    home = tmp_path / "spare"
    home.mkdir()
    path = home / "auth.json"
    good = (WIRE / "auth" / "auth.chatgpt.example.json").read_text()
    path.write_text(good)
    cred = Credential("spare", read_auth_file(path), "https://x", str(path), 0, str(path))
    pool = PoolConfig((cred,))
    watch = AuthWatch()
    watch.remember(pool.credentials)
    for undo in (_logout, lambda p: p.unlink(), lambda p: p.write_text("")):
        undo(path)
        caplog.clear()
        out, reload = watch.refresh_pool(pool, Health())
        assert out.credentials == () and reload is False
        (skip,) = out.skipped
        assert skip.name == "spare" and skip.auth_file == str(path)
        (line,) = [r.getMessage() for r in caplog.records]
        assert str(path) in line and f"CODEX_HOME={home} codex login" in line and "out of rotation" in line
        # Nothing more while it stays unusable.
        caplog.clear()
        again, reload = watch.refresh_pool(out, Health())
        assert again is out and reload is False and caplog.records == []
        path.write_text(good)
        back, reload = watch.refresh_pool(out, Health())
        assert reload is True  # the pool file is loaded anew: the credential comes back where it stood
        watch.remember(pool.credentials)


def test_skipped_at_start_is_watched(tmp_path):
    path = tmp_path / "auth.json"
    skip = Skipped("spare", str(path), f"cannot read {path}: No such file or directory")
    watch = AuthWatch()
    watch.remember((), (skip,))
    assert watch.refresh((), (skip,)).reload is False
    path.write_text("")  # exists now, still unusable
    assert watch.refresh((), (skip,)).reload is False
    path.write_text((WIRE / "auth" / "auth.chatgpt.example.json").read_text())
    assert watch.refresh((), (skip,)).reload is True
