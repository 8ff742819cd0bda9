"""grpcio's own cost per streamed message: the floor under any gRPC serving overhead.

A bare `grpc.aio` server (no engine, no protobuf: 60-byte payloads through a
generic handler) streams --messages messages on each of --streams concurrent
server-streaming calls, paced like engine steps: every stream sends one
message per --step-ms, all streams at once. The server runs in its own
process; the script prints the server's CPU time (from /proc) per message.

`bench/grpc_load.py` compares the real server's CPU per generated token with
the engine's in process; with one message per token per stream, this floor
is part of that difference whatever the service does.

    .venv/bin/python bench/grpc_floor.py [--streams 64] [--messages 200] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import grpc

PAYLOAD = b"x" * 60
METHOD = "/floor.Stream/Paced"


async def serve(port: int, messages: int, step_s: float) -> None:
    """Serve the paced stream: one step event shared by all streams, as the engine loop."""
    tick = asyncio.Event()

    async def steps() -> None:
        while True:
            await asyncio.sleep(step_s)
            tick.set()
            tick.clear()

    async def paced(request: bytes, context: grpc.aio.ServicerContext) -> object:
        for _ in range(messages):
            await tick.wait()
            yield PAYLOAD

    handler = grpc.method_handlers_generic_handler(
        "floor.Stream", {"Paced": grpc.unary_stream_rpc_method_handler(paced)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stepper = asyncio.create_task(steps())
    await server.wait_for_termination()
    stepper.cancel()


async def load(port: int, streams: int) -> int:
    """Run `streams` concurrent calls to the end; the number of messages received."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(METHOD)

        async def one() -> int:
            return sum([1 async for _ in call(b"")])

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=50997)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.port, args.messages, args.step_ms / 1000))
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port),
                               "--messages", str(args.messages), "--step-ms", str(args.step_ms)])
    try:
        time.sleep(2.0)
        costs = []
        for _ in range(args.repeats):
            before = process_cpu_s(server.pid)
            received = asyncio.run(load(args.port, args.streams))
            costs.append(1e6 * (process_cpu_s(server.pid) - before) / received)
        print(f"{args.streams} streams, one message per {args.step_ms:g} ms step: server CPU "
              f"{statistics.median(costs):.0f} us/message (median of "
              f"{', '.join(f'{c:.0f}' for c in costs)})")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
