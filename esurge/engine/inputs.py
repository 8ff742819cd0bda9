"""Turns caller prompts and options into validated engine requests."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from esurge.engine.chat import ChatPrompt, ChatTemplate
from esurge.engine.tokenize import encode_ids
from esurge.errors import InvalidRequestError, RequestField
from esurge.request import EngineRequest
from esurge.sampling_params import SamplingParams

__all__ = ["InputProcessor", "PreparedRequest", "Prompt"]

# Text, token ids, or a conversation for the model's chat template.
Prompt = str | Sequence[int] | ChatPrompt


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request, ready to fan out into engine requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float

    def engine_requests(self, child_ids: list[str], eos_token_id: int | None
                        ) -> list[EngineRequest]:
        """One engine request per sample; sample i of a seeded request uses seed + i."""
        out = []
        for i, child_id in enumerate(child_ids):
            params = self.params
            if params.seed is not None and len(child_ids) > 1:
                params = dataclasses.replace(params, seed=params.seed + i)
            out.append(EngineRequest(
                request_id=child_id, prompt_token_ids=list(self.prompt_token_ids),
                sampling_params=params, eos_token_id=eos_token_id, priority=self.priority,
                arrival_time=self.arrival_time, cache_salt=self.cache_salt))
        return out


def _longest_token_chars(tokenizer: Tokenizer) -> int:
    """Characters in the vocabulary's longest token, added tokens included."""
    return max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)),
               default=1)


class InputProcessor:
    """Tokenizes, validates against the model, and resolves model defaults.

    A text longer than max_model_len times the longest token (in characters)
    cannot fit whatever it tokenizes to, so it is refused before tokenizing:
    that bounds the tokenizer's time per request.
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], max_model_len: int,
                 chat_template: ChatTemplate | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self._extra_eos = tuple(eos_token_ids[1:])
        self.max_model_len = max_model_len
        self.max_text_chars = (max_model_len * _longest_token_chars(tokenizer)
                               if tokenizer is not None else 0)

    def tokenize(self, text: str, field: str = RequestField.PROMPT) -> list[int]:
        """Token ids of text; InvalidRequestError (on `field`) when the model has
        no tokenizer or the text is too long to fit max_model_len."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                field, "prompt is text but this model directory has no tokenizer.json; "
                       "pass prompt token ids instead")
        if len(text) > self.max_text_chars:
            raise InvalidRequestError(
                field, f"text of {len(text)} characters is more than max_model_len "
                       f"({self.max_model_len}) tokens of this tokenizer can hold "
                       f"({self.max_text_chars} characters)")
        return encode_ids(self.tokenizer, text)

    def prepare(self, request_id: str, prompt: Prompt, params: SamplingParams | None,
                priority: int = 0, cache_salt: str | None = None) -> PreparedRequest:
        """Validate one request; every problem is an InvalidRequestError naming the field."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(RequestField.SAMPLING_PARAMS,
                                      f"sampling_params must be a SamplingParams, got {params!r}")
        text: str | None
        if isinstance(prompt, ChatPrompt):
            text, ids = self._render_chat(prompt)
            params = self._stop_at_end_of_turn(params)
        elif isinstance(prompt, str):
            text = prompt
            ids = self.tokenize(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        self._check_prompt(ids, params)
        params = self._resolve(params)
        params.validate_for_vocab(self.vocab_size)
        self._check_a_token_is_left(params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(RequestField.PRIORITY,
                                      f"priority must be an int, got {priority!r}")
        return PreparedRequest(request_id, text, ids, params, priority, cache_salt or None,
                               time.time())

    def _render_chat(self, prompt: ChatPrompt) -> tuple[str, list[int]]:
        if self.chat_template is None or self.tokenizer is None:
            # The whole chat input is at fault, not one of its messages.
            raise InvalidRequestError(RequestField.CHAT, "this model has no chat template; send "
                                                         "a text or token-id prompt instead")
        text = self.chat_template.render(prompt)
        # The template writes its special tokens itself.
        return text, encode_ids(self.tokenizer, text, add_special_tokens=False)

    def _stop_at_end_of_turn(self, params: SamplingParams) -> SamplingParams:
        """A chat reply ends at the template's end-of-turn tokens, unless ignore_eos."""
        if self.chat_template is None or params.ignore_eos:
            return params
        extra = tuple(t for t in self.chat_template.end_of_turn_ids
                      if t not in params.stop_token_ids and t != self.eos_token_id)
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError(RequestField.PROMPT, "prompt must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                RequestField.PROMPT, f"prompt_token_ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        # At least one token is generated: a prompt of max_model_len tokens or
        # more cannot fit whatever max_tokens is, so the prompt is at fault.
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                RequestField.PROMPT, f"prompt of {len(ids)} tokens leaves no room to generate "
                                     f"within max_model_len ({self.max_model_len})")
        total = len(ids) + (params.max_tokens or 1)
        if total > self.max_model_len:
            raise InvalidRequestError(
                RequestField.sampling("max_tokens"),
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{total} exceeds max_model_len ({self.max_model_len})")

    def _check_a_token_is_left(self, params: SamplingParams) -> None:
        """An allow-list that the bans empty leaves the sampler nothing to choose:
        it used to pick a token outside the list."""
        if params.allowed_token_ids is None:
            return
        banned = {word[0] for word in params.bad_words_token_ids if len(word) == 1}
        left = set(params.allowed_token_ids) - banned
        if not left:
            raise InvalidRequestError(
                RequestField.sampling("allowed_token_ids"),
                "every token in allowed_token_ids is a bad word: none is left to sample")
        stops = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stops.add(self.eos_token_id)
        if params.min_tokens and not left - stops:
            raise InvalidRequestError(
                RequestField.sampling("min_tokens"),
                f"min_tokens {params.min_tokens} cannot be met: every token allowed_token_ids "
                f"leaves ends the request (a stop token or EOS)")

    def _resolve(self, params: SamplingParams) -> SamplingParams:
        changes: dict[str, object] = {}
        if params.bad_words and not params.bad_words_token_ids:
            words: list[tuple[int, ...]] = []
            for word in params.bad_words:
                for variant in (word, " " + word):
                    ids = tuple(self.tokenize(variant, RequestField.sampling("bad_words")))
                    if ids and ids not in words:
                        words.append(ids)
            changes["bad_words_token_ids"] = tuple(words)
        extra = tuple(t for t in self._extra_eos if t not in params.stop_token_ids)
        if extra and not params.ignore_eos:
            changes["stop_token_ids"] = params.stop_token_ids + extra
        return dataclasses.replace(params, **changes) if changes else params  # type: ignore[arg-type]
