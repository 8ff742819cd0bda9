"""Replicas behind the smg gateway, all on 127.0.0.1: `make gateway`.

Starts N eSurge servers (each its own process, engine and metrics port), waits
until every one reports SERVING, then runs smg in front of them speaking vLLM's
engine protocol, with the given routing policy. smg serves the OpenAI API
(`/v1/completions`, `/v1/chat/completions`); it takes the tokenizer and the chat
template from the replicas (GetTokenizer), so it needs no model path. Ctrl-C or
SIGTERM stops smg, then drains every replica.

    python tools/gateway.py --replicas 2 --port 30000 --policy cache_aware -- <esurge-serve flags>
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parents[1]


class Replica:
    """One `python -m service` process; its ports are read from its log."""

    def __init__(self, index: int, flags: list[str]) -> None:
        self.index = index
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", "0", "--metrics-port", "0", *flags],
            cwd=REPO, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            sys.stderr.write(f"[replica {self.index}] {line}")

    def find(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first log line matching pattern (SystemExit if the replica stops first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.log):
                found = re.search(pattern, line)
                if found is not None:
                    return found
            if self.proc.poll() is not None:
                raise SystemExit(f"replica {self.index} exited with {self.proc.returncode}")
            time.sleep(0.1)
        raise SystemExit(f"replica {self.index}: no {pattern!r} within {timeout:.0f}s")


def main(argv: list[str] | None = None) -> int:
    """Run the gateway until interrupted; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, default=30000, help="smg's OpenAI API port")
    parser.add_argument("--policy", default="cache_aware",
                        help="smg routing policy: cache_aware, round_robin, power_of_two, ...")
    parser.add_argument("--smg", default=str(Path(sys.executable).with_name("smg")))
    parser.add_argument("flags", nargs="*", help="esurge-serve flags for every replica")
    args = parser.parse_args(argv)
    replicas = [Replica(i, args.flags) for i in range(args.replicas)]
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        ports = [int(r.find(r"listening on [\d.]+:(\d+)", 120).group(1)) for r in replicas]
        metrics = [int(r.find(r"metrics on http://[\d.]+:(\d+)", 120).group(1))
                   for r in replicas]
        for replica in replicas:
            replica.find(r"\(SERVING\)", 1800)
        workers = [f"grpc://127.0.0.1:{p}" for p in ports]
        gateway = subprocess.Popen(
            [args.smg, "launch", "--worker-urls", *workers, "--policy", args.policy,
             "--host", "127.0.0.1", "--port", str(args.port), "--prometheus-host", "127.0.0.1"])
        print(f"smg on http://127.0.0.1:{args.port} ({args.policy}) -> {', '.join(workers)}; "
              f"replica metrics on ports {metrics}", file=sys.stderr)
        while not stop.wait(0.5):
            if gateway.poll() is not None:
                break
        gateway.terminate()
        gateway.wait(30)
    finally:
        for replica in replicas:
            if replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        for replica in replicas:
            replica.proc.wait(90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
