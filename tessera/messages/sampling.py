"""SamplingParams: one request's decoding controls, with SGLang's names and defaults.

The object is built at the edge (`from_dict` for user JSON, or the constructor in the offline API),
then `normalize()`d and `verify()`d once; everything downstream (scheduler, sampler, detokenizer)
trusts it. Errors are `ValueError`s whose message starts with the offending field's name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any

from tessera.constrained.grammar import CONSTRAINT_FIELDS, grammar_text

# Temperatures below this are treated as greedy (argmax), as in SGLang and vLLM: dividing logits by
# such a value would overflow float32 anyway.
SAMPLING_EPS = 1e-6
# OpenAI caps `top_logprobs` at 20; SGLang accepts more, but each extra entry is host-side work per token.
MAX_TOP_LOGPROBS_NUM = 20
# OpenAI's documented range for frequency_penalty and presence_penalty.
MAX_ABS_ADDITIVE_PENALTY = 2.0
# OpenAI's documented range of a logit_bias value.
MAX_ABS_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """Decoding controls for one request (and each of its `n` samples).

    Semantics (shared with the sampler, see tessera/worker/sampler.py):
      temperature: 0 (or < SAMPLING_EPS) means greedy; otherwise logits are divided by it.
      top_k: -1 = off; otherwise keep the k most likely tokens.
      top_p: keep the smallest prefix of the sorted distribution whose mass reaches top_p; 1 = off.
      min_p: keep tokens whose probability is >= min_p * the largest probability; 0 = off.
      frequency_penalty / presence_penalty: OpenAI semantics over previously generated tokens,
        logit -= frequency_penalty * count + presence_penalty * (count > 0).
      repetition_penalty: HF/CTRL semantics over prompt + generated tokens: a positive logit is
        divided by it, a negative one multiplied; 1 = off.
      stop / stop_token_ids: finish when a stop string appears in the text or a stop id is sampled.
      min_new_tokens: EOS and stop_token_ids are banned until this many tokens were generated
        (stop strings are not: they are matched on text, after sampling).
      seed: makes this request's samples reproducible, independent of what it is batched with.
      logprobs: return the sampled token's logprob for every output token.
      top_logprobs_num: also return this many most likely (id, logprob) pairs per output token.
      logit_bias: {token id: bias} added to those logits before sampling (OpenAI semantics, |bias| <= 100;
        -100 effectively bans a token, +100 effectively forces it).
      no_stop_trim: keep a matched stop string at the end of the output text (SGLang's name; vLLM's
        include_stop_str_in_output).
      speculative: False opts this request out of speculative decoding (the server's
        --speculative-algorithm); its tokens are the same either way, only its latency changes.
      json_schema / regex / ebnf: constrain the output (at most one): a JSON Schema (text; a dict is
        serialised by normalize()), generated as compact JSON; a full-match regular expression; or a
        GBNF/Lark grammar. Only tokens that keep the output inside the language are sampled, EOS only
        once it is complete, and the request finishes when the grammar admits nothing more. The
        grammar decides the length: min_new_tokens does not hold EOS back on such a request.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    top_logprobs_num: int = 0
    min_new_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    no_stop_trim: bool = False
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    speculative: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a user dict (e.g. the `sampling_params` of a /generate request).

        Raises ValueError naming every key that is not a field. Values are taken as given: the
        result is normalized but not verified, because verification needs the model's vocab size
        (call `verify(vocab_size)` next). A None value is kept as None, so a null for a field
        that does not accept None (e.g. "temperature": null) fails verification by name.
        """
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(d).__name__}")
        if "max_tokens" in d:  # vLLM's SamplingParams (and the OpenAI API) call it so; SGLang max_new_tokens
            d = dict(d)
            value = d.pop("max_tokens")
            if "max_new_tokens" in d and d["max_new_tokens"] != value:
                raise ValueError(f"max_tokens ({value}) and max_new_tokens ({d['max_new_tokens']}) disagree: "
                                 "they are one setting; give one")
            d["max_new_tokens"] = value
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            hints = {"n_predict": "max_new_tokens", "stop_sequences": "stop", "max_completion_tokens": "max_new_tokens"}
            hint = "".join(f" ({k}: use {hints[k]})" for k in unknown if k in hints)
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}{hint}")
        return cls(**d).normalize()

    def normalize(self) -> SamplingParams:
        """Canonicalise in place and return self: `stop` becomes a list of strings and
        `stop_token_ids` a list of ints (empty when unset). Idempotent. Values of the wrong type are
        left for `verify` to report."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):  # JSON object keys are strings: "50256" -> 50256
            self.logit_bias = {_int_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.json_schema, dict):  # the Python API may pass the schema itself
            self.json_schema = json.dumps(self.json_schema)
        return self

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError, naming the field, for the first invalid value. `vocab_size`, when
        given, bounds stop_token_ids. Accepts stop / stop_token_ids before or after normalize().

        A request passes several edges (the OpenAI layer checks early to name its own fields, the frontend
        checks every request): the checks run once per content and vocabulary, a later call with nothing
        changed returns at once."""
        key = (vocab_size, repr([getattr(self, f.name) for f in fields(self)]))
        if self.__dict__.get("_verified") == key:
            return
        self._check(vocab_size)
        self.__dict__["_verified"] = key

    def _check(self, vocab_size: int | None) -> None:
        for name in ("max_new_tokens", "top_k", "n", "top_logprobs_num", "min_new_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            _check_real(name, getattr(self, name))
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "logprobs", "no_stop_trim",
                     "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.seed is not None:
            _check_int("seed", self.seed)

        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_ABS_ADDITIVE_PENALTY <= value <= MAX_ABS_ADDITIVE_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS_NUM:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS_NUM}], got {self.top_logprobs_num}")
        self._verify_stop(vocab_size)
        self._verify_logit_bias(vocab_size)
        self._verify_constraint()

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, Integral) or isinstance(token_id, bool) or token_id < 0 or (
                    vocab_size is not None and token_id >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"logit_bias keys must be token ids in {bound}, got {token_id!r}")
            _check_real("logit_bias", bias)
            if abs(bias) > MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")

    def _verify_constraint(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one of {', '.join(CONSTRAINT_FIELDS)} may be set, got {given}")
        if given:
            kind = given[0]
            source = getattr(self, kind)
            if not isinstance(source, str) or not source:
                raise ValueError(f"{kind} must be a non-empty string, got {source!r}")
            grammar_text(kind, source)  # raises ValueError naming the field; cached by content

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, source) of the request's output constraint, or None when decoding is free."""
        for name in CONSTRAINT_FIELDS:
            source = getattr(self, name)
            if source is not None:
                return name, source
        return None

    def _verify_stop(self, vocab_size: int | None) -> None:
        stop = self.stop
        stop_list = [stop] if isinstance(stop, str) else stop
        if stop_list is not None:
            if not isinstance(stop_list, (list, tuple)):
                raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
            for s in stop_list:
                if not isinstance(s, str) or not s:
                    # An empty stop string would match before the first token.
                    raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        ids = self.stop_token_ids
        if ids is None:
            return
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}")
        for token_id in ids:
            if not isinstance(token_id, Integral) or isinstance(token_id, bool):
                raise ValueError(f"stop_token_ids must contain only ints, got {token_id!r}")
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"stop_token_ids entries must be in {bound}, got {token_id}")

    def stop_ids(self, eos_ids: Collection[int]) -> set[int]:
        """The token ids that end the request (and that min_new_tokens bans until then): its stop_token_ids,
        and the model's EOS ids unless ignore_eos."""
        return set(self.stop_token_ids or ()) | (set() if self.ignore_eos else set(eos_ids))

    @property
    def is_greedy(self) -> bool:
        """True when decoding is argmax (temperature ~ 0). top_k == 1 is equivalent in effect but
        goes through the sampling path."""
        return self.temperature < SAMPLING_EPS


def _int_key(key: object) -> object:
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; `"max_new_tokens": true` is a client bug, not 1.
    if not isinstance(value, Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_real(name: str, value: object) -> None:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value!r}")
