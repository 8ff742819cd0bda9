"""Token-level stop conditions, checked after each appended output token.

Stop strings need detokenized text, so they are checked by the detokenizer,
which ends the request through `Scheduler.finish_requests`.
"""

from __future__ import annotations

from esurge.request import EngineRequest, EngineRequestStatus

__all__ = ["check_stop"]


def check_stop(request: EngineRequest, max_model_len: int) -> bool:
    """Set the request's finished status and return True when its last token ends it.

    EOS (unless ignore_eos) and stop_token_ids end it as FINISHED_STOPPED once
    min_tokens outputs exist; stop_reason is the stop token, None for EOS. A
    stop token that lands exactly on the length cap still reports STOPPED: the
    model ended on its own. Otherwise reaching max_tokens or max_model_len ends
    it as FINISHED_LENGTH_CAPPED. The stop token stays in output_token_ids.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if num_output >= params.min_tokens:
        last = request.output_token_ids[-1]
        if last == request.eos_token_id and not params.ignore_eos:
            request.status = EngineRequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = EngineRequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    max_tokens = params.max_tokens
    if (max_tokens is not None and num_output >= max_tokens) or (
        len(request.all_token_ids) >= max_model_len
    ):
        request.status = EngineRequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
