"""grpcio's own cost per streamed message: the floor under any gRPC serving overhead.

A bare `grpc.aio` server (no engine, no protobuf: 60-byte payloads through a
generic handler) streams --messages messages on each of --streams concurrent
server-streaming calls, paced like engine steps: every stream sends one
message per --step-ms, all streams at once. The server runs in its own
process; the script prints the server's CPU time (from /proc) per message.

It also measures the cost of a call: --calls short calls (the request id
sent back as initial metadata, as the engine service does, then one
message), --streams at a time; server and client CPU per call. A request of
T tokens in M messages costs at least one call plus M - 1 messages.

`bench/grpc_load.py` compares the real server's CPU per generated token with
the engine's in process; with one message per token per stream, this floor
is part of that difference whatever the service does.

    .venv/bin/python bench/grpc_floor.py [--streams 64] [--messages 200] [--step-ms 20]
        [--calls 2000]
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
SHORT = "/floor.Stream/Short"


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

    async def short(request: bytes, context: grpc.aio.ServicerContext) -> object:
        await context.send_initial_metadata((("x-request-id", "floor-0123456789"),))
        yield PAYLOAD

    handler = grpc.method_handlers_generic_handler(
        "floor.Stream", {"Paced": grpc.unary_stream_rpc_method_handler(paced),
                         "Short": grpc.unary_stream_rpc_method_handler(short)})
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


async def calls(port: int, streams: int, count: int) -> None:
    """`count` short calls, `streams` at a time, one connection per stream (as grpc_load)."""
    left = [count]

    async def worker() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(SHORT)
            while left[0] > 0:
                left[0] -= 1
                async for _ in call(b""):
                    pass

    await asyncio.gather(*(worker() for _ in range(streams)))


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
    parser.add_argument("--calls", type=int, default=2000, help="short calls per repeat")
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
        server_costs, client_costs = [], []
        for _ in range(args.repeats):
            before, own = process_cpu_s(server.pid), time.process_time()
            asyncio.run(calls(args.port, args.streams, args.calls))
            server_costs.append(1e6 * (process_cpu_s(server.pid) - before) / args.calls)
            client_costs.append(1e6 * (time.process_time() - own) / args.calls)
        print(f"{args.streams} at a time, a call with initial metadata and one message: "
              f"server CPU {statistics.median(server_costs):.0f} us/call, client CPU "
              f"{statistics.median(client_costs):.0f} us/call (medians of {args.repeats})")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
