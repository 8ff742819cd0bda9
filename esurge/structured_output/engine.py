"""The engine's structured-output front: one compiler, built off the caller's thread.

llguidance's tokenizer bridge takes about a second for a 50k vocabulary, so
it is built on the compile pool when the engine starts, and the first
constrained request's compile simply queues behind it. An engine without a
tokenizer refuses constraints with an InvalidRequestError.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from tokenizers import Tokenizer

from esurge.errors import InvalidRequestError
from esurge.structured_output.compiler import CompiledGrammar, GrammarCompiler
from esurge.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputs"]

# Seconds a request may wait for its grammar before it is refused.
DEFAULT_COMPILE_TIMEOUT = 30.0


class StructuredOutputs:
    """Compiles the constraints of one engine's requests."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int],
                 *, timeout: float = DEFAULT_COMPILE_TIMEOUT) -> None:
        self.timeout = timeout
        self._compiler: Future[GrammarCompiler] | None = None
        if tokenizer is not None:
            self._compiler = Future()
            threading.Thread(target=self._build, args=(tokenizer, vocab_size, eos_token_ids),
                             name="esurge-grammar-init", daemon=True).start()

    def _build(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
               ) -> None:
        if self._compiler is None:
            return
        try:
            self._compiler.set_result(GrammarCompiler(tokenizer, vocab_size, eos_token_ids))
        except Exception as exc:  # reported by every compile that needs it
            self._compiler.set_exception(exc)

    @property
    def available(self) -> bool:
        """True when this engine can constrain outputs (it has a tokenizer)."""
        return self._compiler is not None

    @property
    def compiler(self) -> GrammarCompiler | None:
        """The compiler once built (None before, or without a tokenizer)."""
        if self._compiler is None or not self._compiler.done():
            return None
        return self._compiler.result()

    def compile(self, params: StructuredOutputsParams | None) -> Future[CompiledGrammar] | None:
        """The compiled grammar of a constraint (None for no constraint)."""
        if params is None:
            return None
        if self._compiler is None:
            raise InvalidRequestError(params.field, "structured outputs need the model's "
                                      "tokenizer, and this engine has none")
        if self._compiler.done():
            return self._compiler.result().compile(params)
        out: Future[CompiledGrammar] = Future()

        def chain(built: Future[GrammarCompiler]) -> None:
            try:
                inner = built.result().compile(params)
            except Exception as exc:
                out.set_exception(exc)
                return
            inner.add_done_callback(lambda f: _copy(f, out))

        self._compiler.add_done_callback(chain)
        return out

    def shutdown(self) -> None:
        """Stop the compile threads."""
        compiler = self.compiler
        if compiler is not None:
            compiler.shutdown()


def _copy(src: Future[CompiledGrammar], dst: Future[CompiledGrammar]) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())
