"""esurge-serve flags -> Config, and errors that name the offending flag."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from esurge.config import CacheConfig, Config, ParallelConfig, SchedulerConfig, SpeculativeConfig
from esurge.settings import EngineSettings, derived_config, expected_backend
from service.cli_args import (
    FlagError,
    build_config,
    build_parser,
    build_settings,
    config_or_exit,
    parse_args,
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


def _args(model_dir: Path, *flags: str) -> argparse.Namespace:
    return parse_args(["--model", str(model_dir), *flags])


def _exit_message(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_defaults_give_the_documented_config(model_dir: Path) -> None:
    args = _args(model_dir)
    assert (args.host, args.port) == ("127.0.0.1", 50051)
    assert (args.dtype, args.log_level) == ("auto", "info")
    assert (args.max_message_bytes, args.max_queued_requests) == (16 * 1024 * 1024, 1024)
    assert args.max_concurrent_streams is None and args.grace_period == 30.0
    assert args.tls_cert is None and args.model == str(model_dir) and args.decode_steps == 1
    # No engine flag: the config eSurge derives for the backend (chunked
    # prefill, async scheduling, the backend's budget), from the one place
    # that derives it.
    assert build_config(args, model_max_len=4096) == derived_config(4096, "cpu")
    assert build_config(args, model_max_len=4096, backend="gpu") == derived_config(4096, "gpu")
    derived = Config(
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                         max_model_len=4096, chunked_prefill_enabled=True,
                                         async_scheduling=True),
        cache_config=CacheConfig(num_pages=None, page_size=16, enable_prefix_caching=True),
        speculative_config=None,
    )
    assert build_config(args, model_max_len=4096) == derived
    assert build_config(args, model_max_len=4096, backend="gpu") == dataclasses.replace(
        derived, scheduler_config=dataclasses.replace(
            derived.scheduler_config, max_num_seqs=32, max_num_batched_tokens=2048))


def test_every_config_flag_reaches_the_config(model_dir: Path, tmp_path: Path) -> None:
    draft = tmp_path / "eagle"
    draft.mkdir()
    args = _args(
        model_dir, "--max-num-seqs", "32", "--max-num-batched-tokens", "512",
        "--max-model-len", "2048", "--policy", "priority",
        "--long-prefill-token-threshold", "128", "--enable-chunked-prefill",
        "--token-safety-margin", "4", "--max-num-seq-buckets", "8,16,32",
        "--async-scheduling", "--num-pages", "900", "--page-size", "32",
        "--no-enable-prefix-caching", "--num-speculative-tokens", "3",
        "--speculative-model", str(draft),
    )
    assert build_config(args, model_max_len=8192) == Config(
        scheduler_config=SchedulerConfig(
            max_num_seqs=32, max_num_batched_tokens=512, max_model_len=2048, policy="priority",
            long_prefill_token_threshold=128, chunked_prefill_enabled=True,
            token_safety_margin=4, max_num_seq_buckets=(8, 16, 32), async_scheduling=True),
        cache_config=CacheConfig(num_pages=900, page_size=32, enable_prefix_caching=False),
        speculative_config=SpeculativeConfig(num_speculative_tokens=3,
                                             speculative_model=str(draft)),
    )


def test_server_flags_parse(model_dir: Path, tmp_path: Path) -> None:
    pem = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    for path in pem.values():
        path.write_text("-----BEGIN-----\n")
    args = _args(model_dir, "--host", "0.0.0.0", "--port", "0", "--dtype", "bfloat16",
                 "--max-message-bytes", "1048576", "--max-concurrent-streams", "100",
                 "--max-queued-requests", "8", "--grace-period", "2.5", "--log-level", "debug",
                 "--tls-cert", str(pem["cert"]), "--tls-key", str(pem["key"]),
                 "--tls-client-ca", str(pem["ca"]))
    assert (args.host, args.port, args.dtype) == ("0.0.0.0", 0, "bfloat16")
    assert (args.max_message_bytes, args.max_concurrent_streams) == (1048576, 100)
    assert (args.max_queued_requests, args.grace_period, args.log_level) == (8, 2.5, "debug")
    assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (pem["cert"], pem["key"],
                                                                 pem["ca"])


def test_without_chunked_prefill_a_step_holds_a_whole_prompt(model_dir: Path) -> None:
    config = build_config(_args(model_dir, "--no-enable-chunked-prefill",
                                "--no-async-scheduling"), model_max_len=8192)
    assert config is not None
    assert config.scheduler_config.max_num_batched_tokens == 8192
    assert config.scheduler_config.chunked_prefill_enabled is False
    assert config.scheduler_config.async_scheduling is False
    short = build_config(_args(model_dir), model_max_len=100)
    assert short is not None and short.scheduler_config.max_num_batched_tokens == 100


@pytest.mark.parametrize(("env", "plugin", "backend"), [
    ("cpu", None, "cpu"), ("cuda", None, "gpu"), ("tpu,cpu", None, "tpu"), ("", None, "cpu"),
    ("", "jax-cuda12-plugin", "gpu"), ("", "libtpu", "tpu")])
def test_the_backend_is_told_without_starting_jax(
        monkeypatch: pytest.MonkeyPatch, env: str, plugin: str | None, backend: str) -> None:
    from importlib import metadata

    def version(dist: str) -> str:
        if dist == plugin:
            return "1.0"
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setenv("JAX_PLATFORMS", env)
    monkeypatch.setattr(metadata, "version", version)
    assert expected_backend() == backend


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an int >= 1, got '0'"),
        (["--page-size", "x"], "argument --page-size: must be an int >= 1, got 'x'"),
        (["--decode-steps", "0"], "argument --decode-steps: must be an int >= 1, got '0'"),
        (["--kv-cache-dtype", "int8"], "argument --kv-cache-dtype: invalid choice: 'int8'"),
        (["--speculation", "never"], "argument --speculation: invalid choice: 'never'"),
        (["--max-num-seq-buckets", "8,a"],
         "argument --max-num-seq-buckets: must be comma-separated ints such as 8,16,32"),
        (["--grace-period", "inf"],
         "argument --grace-period: must be a finite number of seconds >= 0, got 'inf'"),
        (["--port", "70000"], "argument --port: must be a port in [0, 65535], got '70000'"),
        (["--policy", "lifo"], "argument --policy: invalid choice: 'lifo'"),
        (["--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["--speculative-model", "/no/such/dir"],
         "argument --speculative-model: no such directory: '/no/such/dir'"),
    ],
)
def test_bad_single_value_names_the_flag(
    model_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    assert expected in _exit_message(capsys, ["--model", str(model_dir), *flags])


def test_missing_model_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from service.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--model", str(tmp_path / "absent")])
    assert info.value.code == 2
    assert ("argument --model: " f"{str(tmp_path / 'absent')!r} is neither a checkpoint "
            "directory, a .gguf file nor a packaged model name") in capsys.readouterr().err


def test_the_default_model_is_the_packaged_one() -> None:
    assert parse_args([]).model == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tls-cert", "{cert}"], "argument --tls-key: required when --tls-cert is given"),
        (["--tls-key", "{cert}"], "argument --tls-cert: required when --tls-key is given"),
        (["--tls-client-ca", "{cert}"],
         "argument --tls-client-ca: mutual TLS needs --tls-cert and --tls-key"),
    ],
)
def test_incomplete_tls_is_refused(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    flags: list[str], expected: str,
) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("pem\n")
    argv = ["--model", str(model_dir), *(f.format(cert=cert) for f in flags)]
    assert expected in _exit_message(capsys, argv)


@pytest.mark.parametrize(
    ("flags", "model_max_len", "flag", "fragment"),
    [
        (["--max-num-batched-tokens", "128", "--no-enable-chunked-prefill"], 4096,
         "--max-num-batched-tokens",
         "max_num_batched_tokens (128) is smaller than max_model_len (4096)"),
        (["--max-num-seqs", "16", "--max-num-seq-buckets", "8,32"], 4096,
         "--max-num-seq-buckets", "max_num_seq_buckets must be"),
        (["--max-num-seq-buckets", "16,8"], 4096, "--max-num-seq-buckets", "strictly increasing"),
        (["--max-model-len", "9000"], 4096, "--max-model-len",
         "9000 exceeds the model's limit of 4096 tokens"),
        (["--num-speculative-tokens", "2"], 4096, "--num-speculative-tokens",
         "2 drafts need --speculative-model"),
    ],
)
def test_config_refusals_name_the_flag(
    model_dir: Path, flags: list[str], model_max_len: int, flag: str, fragment: str
) -> None:
    with pytest.raises(FlagError) as info:
        build_config(_args(model_dir, *flags), model_max_len=model_max_len)
    assert info.value.flag == flag
    assert str(info.value).startswith(f"argument {flag}: ")
    assert fragment in str(info.value)


def test_draft_model_without_draft_tokens_names_the_model_flag(
    model_dir: Path, tmp_path: Path
) -> None:
    args = _args(model_dir, "--speculative-model", str(tmp_path))
    with pytest.raises(FlagError) as info:
        build_config(args, model_max_len=1024)
    assert info.value.flag == "--speculative-model"


def test_unknown_max_model_len(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(model_dir)
    assert build_config(args, model_max_len=None) is None
    explicit = build_config(_args(model_dir, "--max-model-len", "512"), model_max_len=None)
    assert explicit is not None and explicit.scheduler_config.max_model_len == 512
    with pytest.raises(SystemExit):
        config_or_exit(build_parser(), args, model_max_len=None)
    assert "argument --max-model-len: required" in capsys.readouterr().err


def test_config_or_exit_reports_flag_errors(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = build_parser()
    args = parse_args(["--model", str(model_dir), "--max-num-batched-tokens", "64",
                       "--no-enable-chunked-prefill"], parser)
    with pytest.raises(SystemExit) as info:
        config_or_exit(parser, args, model_max_len=1024)
    assert info.value.code == 2
    assert "esurge-serve: error: argument --max-num-batched-tokens:" in capsys.readouterr().err


def test_settings_flags_reach_the_settings(model_dir: Path) -> None:
    args = _args(model_dir, "--dtype", "bfloat16", "--memory-fraction", "0.5",
                 "--decode-steps", "4", "--kv-cache-dtype", "float32", "--speculation",
                 "always")
    config = build_config(args, model_max_len=1024)
    assert config is not None
    assert build_settings(args, config) == EngineSettings(dtype="bfloat16", memory_fraction=0.5,
                                                          decode_steps=4,
                                                          kv_cache_dtype="float32",
                                                          speculation="always")
    defaults = _args(model_dir)
    plain = build_config(defaults, model_max_len=1024)
    assert plain is not None and build_settings(defaults, plain) == EngineSettings()
    job = _args(model_dir, "--tensor-parallel-size", "4", "--num-hosts", "2", "--host-rank",
                "1", "--coordinator-address", "10.0.0.1:7000")
    assert build_settings(job, plain).parallel_config == ParallelConfig(
        tensor_parallel_size=4, num_hosts=2, host_rank=1, coordinator_address="10.0.0.1:7000")


@pytest.mark.parametrize(
    ("flags", "flag", "fragment"),
    [
        (["--memory-fraction", "0"], "--memory-fraction", "memory_fraction must be in (0, 1]"),
        (["--memory-fraction", "1.5"], "--memory-fraction", "got 1.5"),
        (["--num-speculative-tokens", "2", "--speculative-model", "{draft}", "--decode-steps",
          "4"], "--decode-steps", "decode_steps=4 with speculative decoding"),
        (["--num-hosts", "2"], "--coordinator-address", "'host:port' when num_hosts > 1"),
        (["--num-hosts", "2", "--host-rank", "2", "--coordinator-address", "h:1"],
         "--host-rank", "in [0, num_hosts=2)"),
        (["--num-hosts", "2", "--tensor-parallel-size", "3", "--coordinator-address", "h:1"],
         "--tensor-parallel-size", "a multiple of num_hosts=2"),
    ],
)
def test_settings_refusals_name_the_flag(model_dir: Path, tmp_path: Path, flags: list[str],
                                         flag: str, fragment: str) -> None:
    args = _args(model_dir, *(f.format(draft=tmp_path) for f in flags))
    config = build_config(args, model_max_len=1024)
    assert config is not None
    with pytest.raises(FlagError) as info:
        build_settings(args, config)
    assert info.value.flag == flag
    assert str(info.value).startswith(f"argument {flag}: ")
    assert fragment in str(info.value)
