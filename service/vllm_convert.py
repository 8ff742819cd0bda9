"""vLLM's engine protocol (`vllm.grpc.engine`, from smg-grpc-proto) in engine terms.

Requests: every field of `GenerateRequest` and its `SamplingParams` is
mapped to ours or refused with INVALID_ARGUMENT naming it (the protocol's
own path, e.g. `sampling_params.logprobs`), with the protocol's "unset means
default" conventions as vLLM's servicer reads them: top_p and
repetition_penalty 0 mean 1, top_k 0 means no cut, n 0 means 1, an unset
temperature means 1. The protocol returns token ids only (the gateway
detokenizes), so `skip_special_tokens` and `spaces_between_special_tokens`
shape nothing but stop-string matching, as in vLLM.

Responses: logprobs in the protocol's columnar form.
"""

from __future__ import annotations

import json
from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

from esurge.errors import InvalidRequestError
from esurge.outputs import TokenLogprobs
from esurge.sampling_params import MAX_LOGPROBS, SamplingParams
from esurge.structured_output.params import StructuredOutputsParams
from service.convert import GenerationRequest
from service.errors import FieldViolation, InvalidFieldError
from service.field_paths import sampling_field_name
from service.info import MAX_N

__all__ = ["input_logprobs", "output_logprobs", "request_from_vllm", "vllm_field_path"]

# Our SamplingParams names that the protocol spells differently.
_CONSTRAINT_FIELDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                      "choice": "choice", "grammar": "grammar"}
# GenerateRequest fields that ask for what this engine does not do.
_REFUSED_REQUEST_FIELDS = {
    "kv_transfer_params": "KV transfer (prefill/decode disaggregation) is not supported",
    "kv_transfer_params_json": "KV transfer (prefill/decode disaggregation) is not supported",
    "mm_inputs": "the served model takes text only",
    "media_refs": "the served model takes text only",
}


def vllm_field_path(name: str) -> str:
    """The protocol's path of one of our SamplingParams field names (`logit_bias[5]`,
    `structured_outputs.json`)."""
    if name.startswith("structured_outputs."):
        rest = name.split(".", 2)[1]
        return f"sampling_params.{_CONSTRAINT_FIELDS.get(rest, rest)}"
    if name == "structured_outputs":
        return "sampling_params"
    return f"sampling_params.{name}"


def _fail(field: str, message: str) -> None:
    raise InvalidFieldError([FieldViolation(field, message)])


def _logprob_count(msg: vllm_pb2.SamplingParams, name: str) -> int | None:
    if not msg.HasField(name):
        return None
    value = getattr(msg, name)
    if not 0 <= value <= MAX_LOGPROBS:
        _fail(f"sampling_params.{name}", f"{name} must be in [0, {MAX_LOGPROBS}] "
                                         f"(-1, all of them, is not offered), got {value}")
    return int(value)


def _constraint(msg: vllm_pb2.SamplingParams) -> StructuredOutputsParams | None:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "structural_tag":
        _fail("sampling_params.structural_tag", "structural tags are not supported; use "
                                                 "json_schema, regex, grammar or choice")
    if kind == "json_object" and not msg.json_object:
        _fail("sampling_params.json_object", "json_object must be true when set")
    values: dict[str, Any] = {
        "json_schema": {"json": msg.json_schema}, "regex": {"regex": msg.regex},
        "grammar": {"grammar": msg.grammar}, "json_object": {"json_object": True},
        "choice": {"choice": tuple(msg.choice.choices)},
    }
    return StructuredOutputsParams(**values[kind])


def _sampling_kwargs(msg: vllm_pb2.SamplingParams) -> dict[str, Any]:
    return {
        "n": msg.n or 1,
        "temperature": msg.temperature if msg.HasField("temperature") else 1.0,
        "top_p": msg.top_p or 1.0,
        "top_k": msg.top_k or None,
        "min_p": msg.min_p,
        "frequency_penalty": msg.frequency_penalty,
        "presence_penalty": msg.presence_penalty,
        "repetition_penalty": msg.repetition_penalty or 1.0,
        "max_tokens": msg.max_tokens if msg.HasField("max_tokens") else None,
        "min_tokens": msg.min_tokens,
        "stop": tuple(msg.stop),
        "stop_token_ids": tuple(msg.stop_token_ids),
        "skip_special_tokens": msg.skip_special_tokens,
        "ignore_eos": msg.ignore_eos,
        "include_stop_str_in_output": msg.include_stop_str_in_output,
        "logit_bias": dict(sorted(msg.logit_bias.items())) or None,
        "seed": msg.seed if msg.HasField("seed") else None,
        "logprobs": _logprob_count(msg, "logprobs"),
        "prompt_logprobs": _logprob_count(msg, "prompt_logprobs"),
        "structured_outputs": _constraint(msg),
    }


def _sampling(msg: vllm_pb2.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(**_sampling_kwargs(msg))
    except InvalidRequestError as err:
        name = sampling_field_name(err)
        field = vllm_field_path(name) if name is not None else "sampling_params"
        raise InvalidFieldError([FieldViolation(field, str(err))]) from err


def _prompt(msg: vllm_pb2.GenerateRequest, max_model_len: int
            ) -> tuple[tuple[int, ...] | None, str | None]:
    kind = msg.WhichOneof("input")
    if kind is None:
        _fail("tokenized", "the request has no input: set tokenized.input_ids or text")
    if kind == "text":
        if msg.sampling_params.HasField("truncate_prompt_tokens"):
            _fail("sampling_params.truncate_prompt_tokens",
                  "truncate_prompt_tokens needs a tokenized input")
        return None, msg.text
    ids = tuple(int(t) for t in msg.tokenized.input_ids)
    if msg.sampling_params.HasField("truncate_prompt_tokens"):
        keep = msg.sampling_params.truncate_prompt_tokens
        if keep == -1:
            keep = max_model_len
        if keep < 1:
            _fail("sampling_params.truncate_prompt_tokens",
                  f"truncate_prompt_tokens must be -1 or >= 1, got {keep}")
        ids = ids[-keep:]
    return ids, None


def request_from_vllm(msg: vllm_pb2.GenerateRequest, max_model_len: int) -> GenerationRequest:
    """Our request for a vLLM-protocol GenerateRequest (InvalidFieldError if refused)."""
    for name, why in _REFUSED_REQUEST_FIELDS.items():
        if msg.HasField(name):
            _fail(name, why)
    if msg.extra_mm_inputs:
        _fail("extra_mm_inputs", "the served model takes text only")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        _fail("data_parallel_rank", f"this engine has one data-parallel rank (0), "
                                    f"got {msg.data_parallel_rank}")
    if msg.sampling_params.n > MAX_N:  # each sample is a request of its own
        _fail("sampling_params.n", f"n must be <= {MAX_N}, got {msg.sampling_params.n}")
    prompt_ids, text = _prompt(msg, max_model_len)
    return GenerationRequest(
        request_id=msg.request_id or None, prompt_token_ids=prompt_ids, prompt_text=text,
        sampling_params=_sampling(msg.sampling_params), return_text=False)


def output_logprobs(entries: Any, top_n: int | None) -> vllm_pb2.OutputLogProbs | None:
    """The protocol's logprobs of sampled tokens (None when none were asked)."""
    if top_n is None:
        return None
    out = vllm_pb2.OutputLogProbs()
    for entry in entries:
        out.token_ids.append(entry.token_ids[0])
        out.token_logprobs.append(entry.logprobs[0])
        out.top_logprobs.add(values=entry.logprobs[1:1 + top_n],
                             token_ids=entry.token_ids[1:1 + top_n])
    return out


def input_logprobs(prompt_ids: Any, entries: list[TokenLogprobs | None],
                   top_n: int | None) -> vllm_pb2.InputLogProbs | None:
    """The protocol's prompt logprobs: one per prompt token, the first without a value."""
    if top_n is None:
        return None
    out = vllm_pb2.InputLogProbs(token_ids=list(prompt_ids))
    for entry in entries:
        if entry is None:
            out.token_logprobs.add()
            out.top_logprobs.add()
            continue
        out.token_logprobs.add(value=entry.logprobs[0])
        out.top_logprobs.add(values=entry.logprobs[1:1 + top_n],
                             token_ids=entry.token_ids[1:1 + top_n])
    return out


def default_sampling_json() -> str:
    """The engine's defaults for options a request leaves unset, as GetModelInfo says."""
    defaults = SamplingParams()
    return json.dumps({"temperature": defaults.temperature, "top_p": defaults.top_p,
                       "repetition_penalty": defaults.repetition_penalty})
