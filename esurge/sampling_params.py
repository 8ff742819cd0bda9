"""Per-request sampling and stopping options, named as in vLLM.

Every option accepted here is honoured by the engine; values it cannot honour
are refused with an `InvalidRequestError` (a ValueError) naming the field. Greedy decoding is
`temperature == 0`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from esurge.errors import InvalidRequestError, RequestField
from esurge.structured_output.params import StructuredOutputsParams

__all__ = ["FLOAT32_MAX", "MAX_LOGPROBS", "MAX_N", "MAX_TEMPERATURE", "SamplingParams"]

# Most alternatives per position logprobs / prompt_logprobs may ask for; the
# sampler's device arrays are sized by it.
MAX_LOGPROBS = 20

# Most samples one request may ask for. Each sample is a request of its own
# (its own prompt copy, pages and scheduler entry), made up front: n = 2**32
# would fill the host's memory before the first step.
MAX_N = 1024


# The sampler computes in float32. Compiled, it multiplies the logits by 1 / T,
# which past T ~ 1e37 is subnormal and flushed to zero: masked logits (-inf)
# become NaN and every mask is lost. Far below that, T ~ 1e4 already samples
# uniformly from the tokens the filters keep.
MAX_TEMPERATURE = 1e30
FLOAT32_MAX = 3.4028234663852886e38  # larger penalties would be infinite on the device


def _fail(name: str, value: object, rule: str) -> None:
    raise InvalidRequestError(RequestField.sampling(name), f"{name} must be {rule}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample and when to stop.

    top_k None means no top-k cut; max_tokens None means up to max_model_len;
    logprobs / prompt_logprobs N return the top-N alternatives (plus the chosen
    token) per position; None returns none.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar.
    structured_outputs: StructuredOutputsParams | None = None
    # Token-id sequences for `bad_words`, filled in by the engine's tokenizer.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self._normalize_sequences()
        self._check_numbers()
        self._check_tokens()
        self._check_structured()

    def _check_structured(self) -> None:
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so, dict):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as exc:
                _fail("structured_outputs", so, f"StructuredOutputsParams fields ({exc})")
            object.__setattr__(self, "structured_outputs", so)
        if not isinstance(so, StructuredOutputsParams):
            _fail("structured_outputs", so, "None or a StructuredOutputsParams")
        if self.ignore_eos:
            _fail("ignore_eos", self.ignore_eos,
                  "False with structured_outputs (the output ends where the grammar does)")

    def _normalize_sequences(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, tuple | list) or not all(isinstance(s, str) and s for s in stop):
            _fail("stop", self.stop, "a string or a sequence of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        bad = self.bad_words
        if isinstance(bad, str) or not isinstance(bad, tuple | list) or not all(
            isinstance(w, str) and w for w in bad
        ):
            _fail("bad_words", self.bad_words, "a sequence of non-empty strings")
        object.__setattr__(self, "bad_words", tuple(bad))
        for name in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            if value is None and name == "allowed_token_ids":
                continue
            if not isinstance(value, tuple | list) or not all(
                _is_int(t) and t >= 0 for t in value
            ):
                _fail(name, value, "a sequence of non-negative token ids")
            object.__setattr__(self, name, tuple(value))
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            _fail("allowed_token_ids", self.allowed_token_ids, "None or non-empty")
        words = tuple(tuple(int(t) for t in w) for w in self.bad_words_token_ids)
        object.__setattr__(self, "bad_words_token_ids", words)

    def _check_numbers(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            _fail("n", self.n, f"an int in [1, {MAX_N}]")
        if not _is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            _fail("temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}]")
        if not _is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "in (0, 1]")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            _fail("top_k", self.top_k, "None or an int >= 1")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or not -2.0 <= value <= 2.0:
                _fail(name, value, "in [-2, 2]")
        rp = self.repetition_penalty
        if not _is_num(rp) or not 0 < rp <= FLOAT32_MAX:
            _fail("repetition_penalty", rp, f"a number in (0, {FLOAT32_MAX:.4g}]")
        if self.seed is not None and not _is_int(self.seed):
            _fail("seed", self.seed, "None or an int")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", self.max_tokens, "None or an int >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                _fail(name, value, f"None or an int in [0, {MAX_LOGPROBS}]")

    def _check_tokens(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", self.logit_bias, "a dict of token id -> bias")
        clean: dict[int, float] = {}
        for token, bias in self.logit_bias.items():
            tid = int(token) if isinstance(token, str) and token.isdigit() else token
            if not _is_int(tid) or tid < 0:
                _fail("logit_bias", token, "keyed by non-negative token ids")
            if not _is_num(bias) or not -100.0 <= bias <= 100.0:
                _fail(f"logit_bias[{tid}]", bias, "a number in [-100, 100]")
            clean[int(tid)] = float(bias)
        object.__setattr__(self, "logit_bias", clean)

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0

    @property
    def uses_token_state(self) -> bool:
        """True when the next token depends on per-vocabulary state beyond the
        logits: penalties, a bias or allow-list, bad words, min_tokens."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.allowed_token_ids is not None
            or self.bad_words_token_ids or self.min_tokens > 0
        )

    @property
    def stateless_sampling(self) -> bool:
        """True when each token is a function of the logits, the seed and its
        output position alone (no penalties, masks or min_tokens) and nothing
        else is asked per token (no logprobs, no grammar): a decode burst may run it."""
        return (not self.uses_token_state and self.logprobs is None
                and self.structured_outputs is None)

    def validate_for_vocab(self, vocab_size: int) -> None:
        """InvalidRequestError when a token id named here is outside the vocabulary."""
        checks: list[tuple[str, tuple[int, ...]]] = [
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("logit_bias", tuple((self.logit_bias or {}).keys())),
        ]
        for name, ids in checks:
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                _fail(name, bad, f"token ids < vocab size {vocab_size}")

    def with_bad_words_token_ids(self, words: tuple[tuple[int, ...], ...]) -> SamplingParams:
        """Copy carrying the tokenized `bad_words`."""
        return replace(self, bad_words_token_ids=words)
