"""Instructions per request under callgrind: plain mitmdump and the addon (and other checkouts'), one
after the other against one fake upstream. Run as
`scripts/bench --instructions [--requests N] [--baseline /other/checkout/addon/failover.py ...]`.

Why: `scripts/bench --cost` measures what a user pays (CPU time from /proc), but on a shared host its
single figures move 10-30% between runs, more than a change of 50 us a request. An instruction count
does not move with the neighbours: it says whether a change took Python work out, and how much. It is
not CPU time: the two part ways where memory behaviour differs (docs/measurements.md, "Instructions
against CPU time"), so a claim about cost still needs `--cost`.

Each proxy runs under `valgrind --tool=callgrind --instr-atstart=no` (valgrind from Debian's package);
the count is switched on (`callgrind_control -i on`) after 20 warm-up requests and off after the
measured ones: short streamed requests (13 events), each a new session, on one kept-alive connection,
the client's own credential answered healthy. PYTHONHASHSEED=0, so two runs of one checkout give
nearly the same count (0.2% apart). Under valgrind a proxy runs some 50 times slower, so a path that
depends on time (a short timer firing first) may be taken where it would not be.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # harness, fake upstream
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from bench_cost import checkout_label, pool_text, requests  # noqa: E402
from harness import FakeUpstreamProcess, free_port, stop, wait_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WARM = 20
START_TIMEOUT = 300.0  # seconds for a proxy under valgrind to listen


def count(label: str, script: Path | None, tmp: Path, fake: FakeUpstreamProcess, pool: Path, env: dict,
          n: int) -> int:
    """The instructions a proxy ran over `n` requests (all threads)."""
    port = free_port()
    out = tmp / f"callgrind-{label}"
    args = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
            sys.executable, str(Path(harness.MITMDUMP)), "--listen-host", "127.0.0.1", "-p", str(port),
            "--set", f"confdir={tmp / f'conf-{label}'}"]
    if script is None:
        args += ["--set", "stream_large_bodies=1"]  # as `--cost` runs plain mitmdump
    else:
        args += ["-s", str(script), "--set", f"failover_config={pool}"]
    env = {**os.environ, **env, "HOME": str(tmp / f"home-{label}"), "XDG_STATE_HOME": str(tmp / f"state-{label}"),
           "PYTHONHASHSEED": "0"}  # (never the user's ~/.mitmproxy, ~/.codex or state file)
    log_path = tmp / f"{label}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_port(port, proc, timeout=START_TIMEOUT)
            asyncio.run(requests(port, fake.port, f"warm-{label}", WARM))
            control = ["callgrind_control", "-i"]
            subprocess.run([*control, "on", str(proc.pid)], check=True, capture_output=True, timeout=60)
            asyncio.run(requests(port, fake.port, f"m-{label}", n))
            subprocess.run([*control, "off", str(proc.pid)], check=True, capture_output=True, timeout=60)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True, timeout=120)
        except Exception as exc:  # the log goes with the temporary folder: its end, now
            raise RuntimeError(f"{label}: {exc}; its log ends:\n{_tail(log_path)}") from exc
        finally:
            stop(proc)
    total = 0
    for path in tmp.glob(f"callgrind-{label}.*"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                total = max(total, int(line.split()[1]))
    if not total:
        raise RuntimeError(f"{label}: callgrind counted nothing; its log ends:\n{_tail(log_path)}")
    return total


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench --instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="measured requests per configuration")
    ap.add_argument("--baseline", type=Path, action="append", default=[],
                    help="another checkout's addon/failover.py, counted alongside (may be given more than once)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("scripts/bench --instructions needs valgrind (Debian: apt-get install valgrind)", file=sys.stderr)
        return 1
    configs: dict[str, Path | None] = {"plain": None, "addon": ROOT / "addon" / "failover.py"}
    for path in args.baseline:
        configs[f"base-{checkout_label(path)}"] = path.resolve()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="codex-failover-bench-instructions-") as tmp:
        tmp = Path(tmp)
        fake = FakeUpstreamProcess(tmp / "fake", "--pace", "0", "--deltas", "2")
        try:
            text, env = pool_text({"short": fake})
            pool = tmp / "pool.yaml"
            pool.write_text(text)
            counts = {}
            for label, script in configs.items():
                counts[label] = count(label, script, tmp, fake, pool, env, args.requests) / args.requests
                print(f"  {label}: counted ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
        finally:
            fake.stop()
    print(f"codex-failover instruction count: {args.requests} short requests per configuration, callgrind\n")
    print(f"{'':24} {'M instructions/request':>24} {'ratio':>8}")
    for label, value in counts.items():
        print(f"{label:24} {value / 1e6:24.3f} {value / counts['plain']:7.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
