"""Chat prompts: messages rendered with the model's own chat template.

The template is the checkpoint's (tokenizer_config.json / chat_template.jinja
of an HF directory, `tokenizer.chat_template` of a GGUF), rendered by
transformers' `apply_chat_template`, the same sandboxed Jinja environment
and helpers every HF model card assumes. The rendered text already holds the
template's special tokens, so it is encoded without adding any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from esurge.errors import InvalidRequestError, RequestField

__all__ = ["ChatMessage", "ChatPrompt", "ChatTemplate"]

_MESSAGES = RequestField.CHAT_MESSAGES
_GEN_PROMPT = RequestField.CHAT_ADD_GENERATION_PROMPT
_KWARGS = RequestField.CHAT_TEMPLATE_KWARGS
# transformers' apply_chat_template parameters and the variables it sets itself:
# as template_kwargs they would collide with the renderer's own arguments (a
# TypeError) or change what it does (another template, token ids, tensors).
# `tools` and `documents` are template variables and stay allowed.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "chat_template",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "raise_exception", "strftime_now",
})


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn: who speaks (system, user, assistant, ...) and what they say."""

    role: str
    content: str

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise InvalidRequestError(_MESSAGES, f"role must be a non-empty string, "
                                                     f"got {self.role!r}")
        if not isinstance(self.content, str):
            raise InvalidRequestError(_MESSAGES, f"content must be a string, "
                                                        f"got {self.content!r}")


def _as_message(item: ChatMessage | Mapping[str, Any]) -> ChatMessage:
    if isinstance(item, ChatMessage):
        return item
    if not isinstance(item, Mapping) or set(item) - {"role", "content"}:
        raise InvalidRequestError(_MESSAGES, f"a message must be a ChatMessage or a mapping "
                                            f"with 'role' and 'content', got {item!r}")
    return ChatMessage(item.get("role", ""), item.get("content", ""))


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation to continue with the model's chat template.

    add_generation_prompt: end the rendering with the assistant's turn opener,
    so the model answers (the usual case). template_kwargs: extra variables
    the template reads (e.g. `enable_thinking`, `tools`).
    """

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.messages, str | bytes) or not isinstance(self.messages, Sequence):
            raise InvalidRequestError(_MESSAGES, f"messages must be a sequence of messages, "
                                                f"got {self.messages!r}")
        messages = tuple(_as_message(m) for m in self.messages)
        if not messages:
            raise InvalidRequestError(_MESSAGES, "messages must not be empty")
        object.__setattr__(self, "messages", messages)
        if not isinstance(self.add_generation_prompt, bool):
            raise InvalidRequestError(_GEN_PROMPT, f"add_generation_prompt must be a "
                                    f"bool, got {self.add_generation_prompt!r}")
        if not isinstance(self.template_kwargs, Mapping) or not all(
                isinstance(k, str) for k in self.template_kwargs):
            raise InvalidRequestError(_KWARGS, f"template_kwargs must map names to "
                                    f"values, got {self.template_kwargs!r}")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(self.template_kwargs))
        if reserved:
            raise InvalidRequestError(_KWARGS, f"template_kwargs may not set {reserved}: "
                                               f"the renderer sets them itself")

    @classmethod
    def of(cls, messages: Sequence[ChatMessage | Mapping[str, Any]] | ChatPrompt
           ) -> ChatPrompt:
        """A ChatPrompt from messages (dicts with role/content, or ChatMessages)."""
        if isinstance(messages, ChatPrompt):
            return messages
        return cls(tuple(_as_message(m) for m in messages))


class ChatTemplate:
    """A model's chat template and the tokens that end an assistant turn."""

    def __init__(self, hf_tokenizer: Any, end_of_turn_ids: tuple[int, ...]) -> None:
        self._tokenizer = hf_tokenizer
        self.end_of_turn_ids = end_of_turn_ids

    @classmethod
    def of(cls, hf_tokenizer: Any, eos_token_ids: tuple[int, ...]) -> ChatTemplate | None:
        """The template of a transformers tokenizer, None when it has none."""
        if hf_tokenizer is None or not getattr(hf_tokenizer, "chat_template", None):
            return None
        ids = list(eos_token_ids)
        eos = getattr(hf_tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos not in ids:
            ids.append(eos)
        return cls(hf_tokenizer, tuple(ids))

    def render(self, prompt: ChatPrompt) -> str:
        """The prompt text the template makes of the conversation."""
        from jinja2 import TemplateError

        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt.add_generation_prompt,
                **dict(prompt.template_kwargs))
        except TemplateError as err:
            raise InvalidRequestError(_MESSAGES, f"the chat template refused the messages: "
                                                f"{err}") from err
        except (TypeError, ValueError) as err:
            # A template that trips over a value it was given (tools=5 iterated).
            field = _KWARGS if prompt.template_kwargs else _MESSAGES
            raise InvalidRequestError(field, f"the chat template failed on the request: "
                                             f"{err}") from err
        if not isinstance(text, str):
            raise InvalidRequestError(_MESSAGES, "the chat template did not render text")
        return text
