"""Descriptions of the served model, the server and its load, as response messages."""

from __future__ import annotations

import importlib.metadata
import math
from typing import TYPE_CHECKING

from esurge.sampling_params import MAX_LOGPROBS
from esurge.structured_output.params import CONSTRAINT_KINDS
from generated.esurge.v1 import service_pb2
from service.convert import SAMPLING_FIELDS, config_to_proto

if TYPE_CHECKING:
    from esurge.engine.api import eSurge
    from esurge.engine.stats import EngineStats

__all__ = ["API_VERSION", "MAX_N", "load_info", "model_info", "server_info"]

API_VERSION = "esurge.v1"
# Samples per request the server accepts; more would let one call fill the batch.
MAX_N = 16
_LIBRARIES = ("esurge-grpc", "jax", "jaxlib", "flax", "grpcio", "protobuf", "tokenizers",
              "llguidance", "numpy", "transformers")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _optional_id(hf_config: object, name: str) -> int | None:
    value = getattr(hf_config, name, None)
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def model_info(engine: eSurge) -> service_pb2.GetModelInfoResponse:
    """What clients need to know about the served model."""
    model = engine.model
    hf = model.hf_config
    special = service_pb2.SpecialTokenIds(eos_token_ids=model.eos_token_ids)
    bos, pad = _optional_id(hf, "bos_token_id"), _optional_id(hf, "pad_token_id")
    if bos is not None:
        special.bos_token_id = bos
    if pad is not None:
        special.pad_token_id = pad
    return service_pb2.GetModelInfoResponse(
        model_name=model_name(engine),
        architecture=model.architecture,
        model_type=str(getattr(hf, "model_type", "")),
        max_model_len=engine.config.scheduler_config.max_model_len,
        vocab_size=model.vocab_size,
        special_token_ids=special,
        supported_options=service_pb2.SupportedOptions(
            sampling_params=sorted(SAMPLING_FIELDS | {"max_tokens_unbounded"}),
            max_logprobs=MAX_LOGPROBS,
            has_tokenizer=engine.tokenizer is not None,
            max_n=MAX_N,
            has_chat_template=engine.chat_template is not None,
            structured_output_kinds=(list(CONSTRAINT_KINDS) if engine.grammars.available
                                     else []),
            structured_output_backend=(f"llguidance {_version('llguidance')}"
                                       if engine.grammars.available else ""),
        ),
        dtype=model.dtype,
        checkpoint_format=model.source_kind,
    )


def server_version() -> str:
    """This server's version (the esurge-grpc distribution's)."""
    return _version("esurge-grpc") or "unknown"


def model_name(engine: eSurge) -> str:
    """The served model's name: its directory's, or its GGUF file's without the extension."""
    model = engine.model
    path = model.model_dir.resolve()
    return path.stem if model.source_kind == "gguf" else path.name


def server_info(engine: eSurge) -> service_pb2.GetServerInfoResponse:
    """Versions and the engine configuration in effect."""
    import jax  # the engine already imported it; kept local so info stays cheap to import

    versions = {name: v for name in _LIBRARIES if (v := _version(name)) is not None}
    spec = engine.config.speculative_config
    axes = engine.mesh_axes
    return service_pb2.GetServerInfoResponse(
        server_version=versions.get("esurge-grpc", "unknown"),
        api_version=API_VERSION,
        library_versions=versions,
        config=config_to_proto(engine.config),
        page_size=engine.stats.page_size,
        num_pages=engine.stats.num_pages,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        platform=jax.devices()[0].platform,
        num_devices=math.prod(axes.values()),
        mesh_axes=axes,
    )


def load_info(stats: EngineStats, draining: bool) -> service_pb2.GetLoadResponse:
    """The engine's load, from the stats the engine loop last published.

    Speculative decoding counters are the engine's own, over every request
    since start-up.
    """
    spec = stats.spec
    return service_pb2.GetLoadResponse(
        num_running_requests=stats.num_running,
        num_waiting_requests=stats.num_waiting,
        kv_cache_usage=stats.kv_cache_usage,
        num_free_pages=stats.num_free_pages,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        prefix_cache_queried_tokens=stats.prefix_cache_queries,
        prefix_cache_hit_tokens=stats.prefix_cache_hits,
        num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        mean_acceptance_length=spec.mean_acceptance_length,
        num_verifications=spec.num_verifications,
        draining=draining,
    )
