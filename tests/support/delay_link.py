#!/usr/bin/env python3
"""Two network namespaces joined by a user-space link that delays every packet: a real round-trip time
on one machine, for benchmarks and tests (the kernel here has no netem).

    with DelayLink(rtt_ms=30) as link:      # namespaces cfbench-<pid>-a and -b, 10.77.0.1 <-> 10.77.0.2
        with link.inside("a"):              # this thread's sockets (and the processes it starts) are in a
            ...
        link.run_in("b", argv)              # a process in b (via `ip netns exec`, so /etc/netns/<b>/ applies)
        link.set_rtt(0)
        link.stats()                        # packets, bytes, TCP SYNs towards b by destination port

How: a TUN device in each namespace (IFF_TUN|IFF_NO_PI, one point-to-point /30), and one Python process
(`python delay_link.py --forward A B`) that reads every IP packet from one TUN and writes it to the other
RTT/2 later, in order (one FIFO per direction, constant delay). Because whole packets are delayed, TCP's
and TLS's handshakes, slow start and windows all pay the RTT, as on a real network. With RTT 0 the
packets still cross the user-space hop (tens of µs), so RTT-0 and RTT-30 runs share one topology.

Cleanup: `stop()` stops the forwarder by its PID and deletes both namespaces and /etc/netns/<name>; it is
idempotent, runs from `__exit__` on any error or Ctrl-C, and ignores a second Ctrl-C while it works. The
forwarder also dies with its parent (PR_SET_PDEATHSIG) or when its stdin closes. Namespaces left by a
process that was SIGKILLed (its PID gone) are deleted by the next `start()`. Every wait is bounded.
Needs root, /dev/net/tun and iproute2 (`available()` says why not).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")
IFNAME = "cfl0"  # the TUN device's name in both namespaces (each has its own)
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_PDEATHSIG = 1
CMD_TIMEOUT = 10.0  # seconds any `ip` command may take


def available() -> str | None:
    """None if a DelayLink can run here, else why not (for skips)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2)"
    if not hasattr(os, "setns"):
        return "Python without os.setns"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=CMD_TIMEOUT, capture_output=True)


def _enter(name: str) -> None:
    """Move the calling thread into namespace `name` (only this thread: Linux setns is per thread)."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        os.setns(fd, os.CLONE_NEWNET)
    finally:
        os.close(fd)


class DelayLink:
    def __init__(self, rtt_ms: float = 0.0, prefix: str = "cfbench", subnet: str = "10.77.0"):
        self.rtt_ms = rtt_ms
        self.prefix = prefix
        self.names = {"a": f"{prefix}-{os.getpid()}-a", "b": f"{prefix}-{os.getpid()}-b"}
        self.addr = {"a": f"{subnet}.1", "b": f"{subnet}.2"}
        self._forwarder: subprocess.Popen | None = None
        self._created: list[str] = []
        self._started: list[subprocess.Popen] = []  # processes started in the namespaces (stopped by PID)

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "DelayLink":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        why = available()
        if why:
            raise RuntimeError(f"DelayLink: {why}")
        self.remove_stale(self.prefix)
        for side in ("a", "b"):
            _ip("netns", "add", self.names[side])
            self._created.append(self.names[side])
            _ip("-n", self.names[side], "link", "set", "lo", "up")
        # A new session: a Ctrl-C at the terminal reaches only us, and we stop it in order.
        self._forwarder = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--forward", self.names["a"], self.names["b"],
             "--rtt-ms", str(self.rtt_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        ready = self._reply(timeout=10.0)
        if not ready.get("ready"):
            raise RuntimeError(f"DelayLink forwarder did not start: {ready}")
        for side in ("a", "b"):
            ns = self.names[side]
            _ip("-n", ns, "addr", "add", f"{self.addr[side]}/30", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
        self.connect_ms(samples=1)  # the link carries packets (raises if not, bounded)

    def stop(self) -> None:
        """Stop what was started here (by PID), delete the namespaces and their /etc/netns folders."""
        with _no_sigint():
            for proc in reversed(self._started):
                _stop(proc)
            self._started.clear()
            if self._forwarder is not None:
                with contextlib.suppress(OSError):
                    self._forwarder.stdin.close()  # the forwarder exits on EOF
                _stop(self._forwarder, grace=2.0)
                self._forwarder.stdout.close()
                self._forwarder = None
            for name in self._created:
                _delete_ns(name)
            self._created.clear()

    @staticmethod
    def remove_stale(prefix: str = "cfbench") -> list[str]:
        """Delete namespaces `<prefix>-<pid>-a|b` whose process is gone (it was killed before its cleanup)."""
        gone = []
        for folder in (NETNS_DIR, ETC_NETNS):
            for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
                m = re.fullmatch(rf"{re.escape(prefix)}-(\d+)-[ab]", entry.name)
                if m and not Path(f"/proc/{m.group(1)}").exists() and entry.name not in gone:
                    _delete_ns(entry.name)
                    gone.append(entry.name)
        return gone

    # -- using it ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def inside(self, side: str):
        """This thread in namespace `side` ("a" or "b") meanwhile: sockets it creates stay there for
        good, and processes it starts run there. Back in the original namespace afterwards."""
        orig = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _enter(self.names[side])
            try:
                yield
            finally:
                os.setns(orig, os.CLONE_NEWNET)
        finally:
            os.close(orig)

    def hosts(self, side: str, entries: dict[str, str]) -> Path:
        """/etc/netns/<ns>/hosts with `entries` {name: address} (and localhost): processes started
        with `run_in(side, ...)` resolve those names; removed by stop()."""
        folder = ETC_NETNS / self.names[side]
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{addr} {name}" for name, addr in entries.items()]
        (folder / "hosts").write_text("\n".join(lines) + "\n")
        return folder / "hosts"

    def run_in(self, side: str, argv: list[str], **popen) -> subprocess.Popen:
        """Start `argv` in namespace `side` with `ip netns exec` (which execs it in place: the PID is the
        program's), so /etc/netns/<ns>/hosts applies. Stopped by PID in stop() unless stopped before;
        SIGTERMed by the kernel if this process dies first (PR_SET_PDEATHSIG survives the exec)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[side], *argv], preexec_fn=_die_with_parent,
                                **popen)
        self._started.append(proc)
        return proc

    def stop_process(self, proc: subprocess.Popen) -> None:
        _stop(proc)
        with contextlib.suppress(ValueError):
            self._started.remove(proc)

    def set_rtt(self, rtt_ms: float) -> None:
        self._command(f"rtt {rtt_ms}")
        self.rtt_ms = rtt_ms

    def stats(self) -> dict:
        """{"syn_to_b": {port: SYNs a->b}, "packets": {"ab": n, "ba": n}, "bytes": {...}, "rtt_ms": x}."""
        out = self._command("stats")
        out["syn_to_b"] = {int(k): v for k, v in out["syn_to_b"].items()}
        return out

    def connect_ms(self, samples: int = 5, timeout: float = 5.0) -> list[float]:
        """How long a TCP connect from a to b takes (SYN out, SYN-ACK back: one RTT), `samples` times,
        against a listener this thread opens in b."""
        with self.inside("b"):
            listener = socket.create_server((self.addr["b"], 0), backlog=samples + 1)
        port = listener.getsockname()[1]
        times = []
        try:
            with self.inside("a"):
                for _ in range(samples):
                    t0 = time.perf_counter()
                    with socket.create_connection((self.addr["b"], port), timeout=timeout):
                        times.append((time.perf_counter() - t0) * 1000)
                    with contextlib.suppress(OSError):
                        listener.settimeout(timeout)
                        listener.accept()[0].close()
        finally:
            listener.close()
        return times

    def check_rtt(self, samples: int = 5, tolerance_ms: float = 5.0) -> float:
        """The median connect time; raises if it is not within `tolerance_ms` (+10%) of the RTT."""
        med = statistics.median(self.connect_ms(samples))
        if abs(med - self.rtt_ms) > tolerance_ms + 0.1 * self.rtt_ms:
            raise RuntimeError(f"DelayLink: a TCP connect a->b took {med:.1f} ms, the link's RTT is {self.rtt_ms:g} ms")
        return med

    # -- talking to the forwarder --------------------------------------------------------------

    def _command(self, line: str) -> dict:
        if self._forwarder is None:
            raise RuntimeError("DelayLink is not running")
        self._forwarder.stdin.write(line.encode() + b"\n")
        self._forwarder.stdin.flush()
        return self._reply()

    def _reply(self, timeout: float = 5.0) -> dict:
        """One JSON line from the forwarder, waiting at most `timeout` seconds."""
        out = self._forwarder.stdout
        fd = out.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"DelayLink forwarder silent for {timeout:g} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"DelayLink forwarder exited ({self._forwarder.poll()})")
            buf += chunk
        return json.loads(buf)


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM by PID, then SIGKILL after `grace` seconds; bounded."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child before exec: the kernel sends it `sig` when its parent dies (even by SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def _delete_ns(name: str) -> None:
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run(["ip", "netns", "delete", name], timeout=CMD_TIMEOUT, capture_output=True)
    shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


@contextlib.contextmanager
def _no_sigint():
    """Cleanup must finish: a second Ctrl-C during it is ignored (main thread only; elsewhere a no-op)."""
    try:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


# -- the forwarder process ------------------------------------------------------------------

def _open_tun(ns: str) -> int:
    """A TUN device named IFNAME in namespace `ns` (the device lives where the fd was opened)."""
    _enter(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", IFNAME.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def _syn_port(pkt: bytes) -> int | None:
    """The destination port of an IPv4 TCP SYN (not SYN-ACK), else None."""
    if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[9] != 6:
        return None
    ihl = (pkt[0] & 0x0F) * 4
    if len(pkt) < ihl + 14 or pkt[ihl + 13] & 0x12 != 0x02:
        return None
    return int.from_bytes(pkt[ihl + 2:ihl + 4], "big")


class Forwarder:
    """Moves packets between two TUN fds, each RTT/2 after it was read; FIFO per direction, so order
    holds (a lower RTT set mid-flight makes new packets wait for older ones, never overtake them)."""

    def __init__(self, fd_a: int, fd_b: int, rtt_ms: float):
        self.fds = {"ab": (fd_a, fd_b), "ba": (fd_b, fd_a)}
        self.queues: dict[str, deque[tuple[float, bytes]]] = {"ab": deque(), "ba": deque()}
        self.delay = rtt_ms / 2000
        self.rtt_ms = rtt_ms
        self.packets = {"ab": 0, "ba": 0}
        self.bytes = {"ab": 0, "ba": 0}
        self.dropped = 0
        self.syn_to_b: dict[int, int] = {}

    def read(self, direction: str, now: float) -> None:
        src = self.fds[direction][0]
        queue = self.queues[direction]
        while True:
            try:
                pkt = os.read(src, 65536)
            except BlockingIOError:
                return
            queue.append((now + self.delay, pkt))
            self.packets[direction] += 1
            self.bytes[direction] += len(pkt)
            if direction == "ab" and (port := _syn_port(pkt)) is not None:
                self.syn_to_b[port] = self.syn_to_b.get(port, 0) + 1

    def flush(self, now: float) -> float | None:
        """Write every packet that is due; seconds until the next one is (None: nothing queued)."""
        nxt = None
        for direction, queue in self.queues.items():
            dst = self.fds[direction][1]
            while queue and queue[0][0] <= now:
                try:
                    os.write(dst, queue.popleft()[1])
                except OSError:  # the device went down (shutting down): drop, as a wire would
                    self.dropped += 1
            if queue:
                wait = queue[0][0] - now
                nxt = wait if nxt is None else min(nxt, wait)
        return nxt

    def command(self, line: str) -> dict:
        word, _, arg = line.strip().partition(" ")
        if word == "rtt":
            self.rtt_ms = float(arg)
            self.delay = self.rtt_ms / 2000
            return {"rtt_ms": self.rtt_ms}
        if word == "stats":
            return {"rtt_ms": self.rtt_ms, "packets": self.packets, "bytes": self.bytes, "dropped": self.dropped,
                    "syn_to_b": self.syn_to_b}
        return {"error": f"unknown command {word!r}"}

    def run(self, control: int) -> None:
        fd_a, fd_b = self.fds["ab"]
        pending = b""
        timeout = None
        while True:
            ready = select.select([fd_a, fd_b, control], [], [], timeout)[0]
            now = time.monotonic()
            if fd_a in ready:
                self.read("ab", now)
            if fd_b in ready:
                self.read("ba", now)
            if control in ready:
                data = os.read(control, 4096)
                if not data:
                    return  # the parent closed our stdin (or died): done
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    _say(self.command(line.decode()))
            timeout = self.flush(time.monotonic())


def _say(obj: dict) -> None:
    os.write(1, json.dumps(obj).encode() + b"\n")


def forward_main(ns_a: str, ns_b: str, rtt_ms: float) -> None:
    _die_with_parent(signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl: nobody will stop us
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(OSError):
        os.nice(-10)  # wake up on time while mitmdump and the clients keep both CPUs busy
    fd_a, fd_b = _open_tun(ns_a), _open_tun(ns_b)
    _say({"ready": True, "pid": os.getpid()})
    Forwarder(fd_a, fd_b, rtt_ms).run(0)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="the DelayLink forwarder (started by DelayLink, not by hand)")
    ap.add_argument("--forward", nargs=2, metavar=("NS_A", "NS_B"), required=True)
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    args = ap.parse_args()
    forward_main(*args.forward, args.rtt_ms)
