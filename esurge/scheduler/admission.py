"""Whether a request can ever run: checked once, when it arrives.

A request that could never fit would wait forever (or, once running, preempt
itself forever), so it is refused at `add_request` with the numbers that rule
it out.
"""

from __future__ import annotations

from esurge.core.kv_cache_manager import KVCacheManager
from esurge.errors import InvalidRequestError, RequestField
from esurge.request import EngineRequest

__all__ = ["check_fits"]

_MAX_TOKENS = RequestField.sampling("max_tokens")


def check_fits(request: EngineRequest, kv: KVCacheManager, max_model_len: int,
               num_lookahead_tokens: int, max_tokens_per_step: int | None) -> None:
    """InvalidRequestError unless the request's whole life fits max_model_len and the cache.

    With max_tokens None the request may grow to max_model_len, so that length
    must fit. The KV of the last output token is never computed, but draft
    tokens need num_lookahead_tokens of room; max_tokens_per_step bounds how
    much of a windowed group's pages a chunked prefill holds at once.
    """
    rid, num_prompt = request.request_id, request.num_prompt_tokens
    max_tokens = request.max_tokens
    if num_prompt >= max_model_len:
        # No max_tokens could help: at least one token is generated.
        raise InvalidRequestError(
            RequestField.PROMPT, f"request {rid!r}: prompt of {num_prompt} tokens leaves no "
                                 f"room to generate within max_model_len={max_model_len}")
    if max_tokens is None:
        final_len = max_model_len
    else:
        final_len = num_prompt + max_tokens
        if final_len > max_model_len:
            raise InvalidRequestError(
                _MAX_TOKENS, f"request {rid!r}: prompt ({num_prompt}) + max_tokens "
                             f"({max_tokens}) = {final_len} exceeds max_model_len={max_model_len}")
    kv_tokens = min(final_len - 1 + num_lookahead_tokens, max_model_len)
    if not kv.can_ever_fit(kv_tokens, max_tokens_per_step):
        # The prompt is at fault when even one generated token would not fit.
        least = min(num_prompt + num_lookahead_tokens, max_model_len)
        field = _MAX_TOKENS if kv.can_ever_fit(least, max_tokens_per_step) else (
            RequestField.PROMPT)
        raise InvalidRequestError(
            field, f"request {rid!r}: {kv_tokens} tokens of KV need "
                   f"{kv.peak_pages(kv_tokens, max_tokens_per_step)} pages but the cache "
                   f"has only {kv.num_usable_pages} usable pages")
