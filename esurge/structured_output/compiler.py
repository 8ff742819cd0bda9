"""Grammar compilation with llguidance: off the engine loop, cached, bounded.

A constraint compiles to an llguidance `LLMatcher` in its initial state (the
grammar parsed, the lexer built over the tokenizer's trie); every request
gets a `deep_copy` of it. Compiles run on a small thread pool (llguidance
drops the GIL while it builds), so neither the engine loop nor the caller's
event loop waits on them, and the results are kept in an LRU keyed by the
constraint's digest and the tokenizer's. A compile error becomes an
`InvalidRequestError` naming the constraint's field.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
from tokenizers import Tokenizer

from esurge.errors import InvalidRequestError
from esurge.structured_output.params import StructuredOutputsParams

__all__ = ["CompiledGrammar", "GrammarCompiler", "grammar_source"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A compiled constraint: copy `matcher` for each request that uses it."""

    key: str
    matcher: llguidance.LLMatcher
    tokenizer: llguidance.LLTokenizer
    compile_seconds: float

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher in the grammar's initial state."""
        return self.matcher.deep_copy()


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object leaves it open."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _choice_lark(choices: Sequence[str]) -> str:
    # JSON string literals are valid Lark literals and escape everything.
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a constraint."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.schema()
        if params.disable_additional_properties:
            schema = _closed_objects(schema)
        options: dict[str, Any] = {}
        if params.disable_any_whitespace:
            options["whitespace_flexible"] = False
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=options or None)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(params.choice or ()))
    return llguidance.LLMatcher.grammar_from_lark(params.grammar or "")


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe.

    tokenizer is the engine's `tokenizers.Tokenizer`: llguidance builds its
    token trie from the tokenizer's own JSON (what its `llguidance.hf`
    helper hands it from a transformers tokenizer); vocab_size is the
    model's logits width, which may exceed the tokenizer's; eos_token_ids
    are the tokens that end a request where the grammar accepts.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 *, cache_size: int = 256, max_workers: int = 2) -> None:
        self.vocab_size = vocab_size
        plain = copy.copy(tokenizer)  # padding and truncation have no place in a token trie
        plain.no_padding()
        plain.no_truncation()
        spec = plain.to_str()
        self.tokenizer = llguidance.LLTokenizer(spec, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self._tokenizer_key = hashlib.sha256(spec.encode()).hexdigest()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="esurge-grammar")
        self.num_compiles = 0
        self.num_cache_hits = 0

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of a constraint, from the cache or a new compile."""
        key = hashlib.sha256(f"{self._tokenizer_key}:{params.cache_key()}".encode()).hexdigest()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:  # a failed compile fails the same way again
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return cached
            future = self._pool.submit(self._build, key, params)
            self._cache[key] = future
            self.num_compiles += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return future

    def _build(self, key: str, params: StructuredOutputsParams) -> CompiledGrammar:
        began = time.perf_counter()
        try:
            source = grammar_source(params)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(params.field, f"invalid {params.kind}: {exc}") from exc
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(params.field,
                                      f"invalid {params.kind}: {matcher.get_error()}")
        seconds = time.perf_counter() - began
        log.debug("compiled a %s constraint in %.1f ms", params.kind, seconds * 1e3)
        return CompiledGrammar(key, matcher, self.tokenizer, seconds)

    def shutdown(self) -> None:
        """Stop the compile threads (running compiles finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
