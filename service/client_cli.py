"""`esurge-client`: talk to an esurge-serve from the terminal.

    esurge-client generate "def fibonacci(n):" --max-tokens 64
    esurge-client chat "What is the capital of France?" --system "Answer briefly."
    esurge-client tokenize "hello world"
    esurge-client info
    esurge-client health            # exit status 0 only when SERVING
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from esurge.engine.chat import ChatMessage, ChatPrompt
from esurge.sampling_params import SamplingParams
from generated.esurge.v1 import engine_pb2
from service.client import EngineClient, Prompt, channel_credentials
from service.errors import field_violations, status_from_rpc_error

__all__ = ["build_parser", "main"]


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be token ids separated by spaces or commas, got {text!r}") from None


def _add_sampling_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--max-tokens", type=int, default=64)
    command.add_argument("--temperature", type=float, default=0.0)
    command.add_argument("--top-p", type=float, default=1.0)
    command.add_argument("--top-k", type=int, default=None)
    command.add_argument("--seed", type=int, default=None)
    command.add_argument("--stop", action="append", default=[],
                         help="stop string (repeatable)")
    command.add_argument("--ignore-eos", action="store_true")
    command.add_argument("--show-ids", action="store_true",
                         help="print the generated token ids instead of text")


def build_parser() -> argparse.ArgumentParser:
    """The client's argument parser."""
    parser = argparse.ArgumentParser(prog="esurge-client",
                                     description="Call an esurge-serve gRPC server.")
    parser.add_argument("--target", default="127.0.0.1:50051",
                        help="server address host:port (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="deadline of each call in seconds (default: none)")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="CA bundle to verify the server with; enables TLS")
    parser.add_argument("--tls-cert", default=None, metavar="PEM",
                        help="client certificate for mutual TLS (needs --tls-key)")
    parser.add_argument("--tls-key", default=None, metavar="PEM", help="client private key")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="stream a generation to stdout")
    gen.add_argument("prompt", help="prompt text (or token ids with --token-ids)")
    gen.add_argument("--token-ids", action="store_true",
                     help="the prompt is token ids separated by spaces or commas")
    _add_sampling_flags(gen)
    chat = commands.add_parser("chat", help="one chat turn, rendered with the model's chat "
                                            "template, streamed to stdout")
    chat.add_argument("prompt", help="the user's message")
    chat.add_argument("--system", default=None, help="a system message before it")
    _add_sampling_flags(chat)
    tok = commands.add_parser("tokenize", help="print the token ids of a text")
    tok.add_argument("text")
    tok.add_argument("--no-special-tokens", action="store_true")
    commands.add_parser("info", help="print model and server information as JSON")
    health = commands.add_parser("health", help="print the health status")
    health.add_argument("--service", default="", help='service name (default: "", the server)')
    return parser


def _client(args: argparse.Namespace) -> EngineClient:
    credentials = None
    if args.tls_ca is not None or args.tls_cert is not None:
        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    return EngineClient(args.target, credentials=credentials, timeout=args.timeout)


def _prompt(args: argparse.Namespace) -> Prompt:
    if args.command == "chat":
        messages = [] if args.system is None else [ChatMessage("system", args.system)]
        return ChatPrompt((*messages, ChatMessage("user", args.prompt)))
    return _token_ids(args.prompt) if args.token_ids else str(args.prompt)


def _generate(client: EngineClient, args: argparse.Namespace) -> int:
    prompt = _prompt(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    finish = ""
    ids: list[int] = []
    for message in client.generate(prompt, params):
        ids.extend(message.token_ids)
        if not args.show_ids:
            sys.stdout.write(message.text)
            sys.stdout.flush()
        if message.finish_reason:
            finish = engine_pb2.FinishReason.Name(message.finish_reason)
    if args.show_ids:
        sys.stdout.write(" ".join(map(str, ids)))
    sys.stdout.write("\n")
    print(f"[{len(ids)} tokens, {finish}]", file=sys.stderr)
    return 0


def _to_json(message: Any) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


def _run(client: EngineClient, args: argparse.Namespace) -> int:
    if args.command in ("generate", "chat"):
        return _generate(client, args)
    if args.command == "tokenize":
        ids = client.tokenize(args.text, add_special_tokens=not args.no_special_tokens)
        print(" ".join(map(str, ids)))
        return 0
    if args.command == "info":
        print(json.dumps({"model": _to_json(client.model_info()),
                          "server": _to_json(client.server_info()),
                          "load": _to_json(client.load())}, indent=2, sort_keys=True))
        return 0
    status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


def _report(error: grpc.RpcError) -> None:
    code = error.code().name if hasattr(error, "code") else "UNKNOWN"
    details = error.details() if hasattr(error, "details") else str(error)
    print(f"esurge-client: {code}: {details}", file=sys.stderr)
    status = status_from_rpc_error(error)
    for violation in field_violations(status) if status is not None else ():
        print(f"  {violation.field}: {violation.description}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one client command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _client(args) as client:
            return _run(client, args)
    except grpc.RpcError as err:
        _report(err)
        return 1
    except (OSError, ValueError) as err:
        print(f"esurge-client: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
