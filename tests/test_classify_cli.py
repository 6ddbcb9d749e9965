"""`scripts/classify`: one JSON object on stdout, exit 0 whatever the verdict, 2 on bad input."""

import json
import subprocess
from pathlib import Path

import pytest
from conftest import LIVE, WIRE

from codex_failover.classify_cli import main

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["verdict", "reason", "trigger", "held_frames", "held_bytes", "events"]


def classify(capsys, *argv):
    code = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_overload_fixture(capsys):
    code, out, _ = classify(capsys, WIRE / "sse" / "overload_error_then_response_failed.sse")
    assert code == 0
    assert list(out) == KEYS
    assert out == {"verdict": "failover", "reason": "overloaded", "trigger": "error",
                   "held_frames": 6, "held_bytes": 646, "events": 4}


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunking_does_not_change_the_answer(capsys, chunk):
    path = LIVE / "server_sse_success_full.sse"
    _, whole, _ = classify(capsys, path)
    _, chunked, _ = classify(capsys, "--chunk", chunk, path)
    assert whole == chunked
    assert whole["verdict"] == "commit"


def test_input_ending_inside_the_window(capsys, tmp_path):
    path = tmp_path / "handshake.sse"
    path.write_bytes(b'data: {"type":"response.created"}\n\n')
    assert classify(capsys, path)[1]["verdict"] == "hold"
    assert classify(capsys, "--timeout", "30s", path)[1] | {} == {
        "verdict": "commit", "reason": "timeout", "trigger": None, "held_frames": 2, "held_bytes": 35, "events": 1}
    assert classify(capsys, "--eof", path)[1]["reason"] == "closed_before_output"


def test_custom_rules(capsys, tmp_path):
    rules = (ROOT / "rules" / "default.yaml").read_text().replace("max_frames: 48", "max_frames: 2")
    (tmp_path / "r.yaml").write_text(rules)
    _, out, _ = classify(capsys, "--rules", tmp_path / "r.yaml", WIRE / "sse" / "overload_error_then_response_failed.sse")
    assert (out["verdict"], out["reason"]) == ("commit", "frame_budget")


def test_bad_inputs_exit_2_with_a_message(capsys, tmp_path):
    code, out, err = classify(capsys, tmp_path / "nope.sse")
    assert code == 2, err
    assert out is None
    assert "cannot read" in err
    (tmp_path / "r.yaml").write_text("version: 1\n")
    code, _, err = classify(capsys, "--rules", tmp_path / "r.yaml", WIRE / "sse" / "codex_cli_responses_fixture.sse")
    assert code == 2, err
    assert "r.yaml" in err
    with pytest.raises(SystemExit) as info:
        main(["--timeout", "soon", "x"])
    assert info.value.code == 2


def test_framing_error_fails_open(capsys, tmp_path):
    path = tmp_path / "huge.sse"
    path.write_bytes(b'data: {"type":"response.created"}\n\n' + b"data: " + b"x" * (9 * 1024 * 1024))
    _, out, _ = classify(capsys, "--chunk", 65536, path)
    assert (out["verdict"], out["reason"]) == ("commit", "framing_error")


def test_script_reads_stdin():
    body = (WIRE / "sse" / "response_failed_slow_down.sse").read_bytes()
    proc = subprocess.run([str(ROOT / "scripts" / "classify"), "-"], input=body, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["reason"] == "slow_down"
