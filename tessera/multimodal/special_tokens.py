"""Media placeholder tokens of a model: their strings, their ids, and one regex over all of them.

Contract: after `build(processor)`, every configured modality has a placeholder id that the
tokenizer maps its placeholder string(s) to, and `split` / `count` find placeholders with ONE
compiled regex (longest alternative first, so a token that prefixes another cannot steal it).
`check_counts` raises ValueError naming the modality and both counts when a prompt's
placeholders do not match the media given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tessera.messages.items import Modality

__all__ = ["MultimodalSpecialTokens"]


@dataclass
class MultimodalSpecialTokens:
    """Placeholder strings per modality (one string or several aliases) and their token ids.

    An id may be given instead of a string (the string is then looked up), or both (they
    must agree with the tokenizer).
    """

    image_token: str | list[str] | None = None
    video_token: str | list[str] | None = None
    audio_token: str | list[str] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None
    _regex: re.Pattern[str] | None = field(default=None, init=False, repr=False)
    _modality_of: dict[str, Modality] = field(default_factory=dict, init=False, repr=False)

    # ------------------------------------------------------------ construction

    def build(self, processor: Any) -> MultimodalSpecialTokens:
        """Resolve ids with `processor.tokenizer` (or `processor` itself if it is a tokenizer)
        and compile the combined regex. Returns self."""
        tokenizer = getattr(processor, "tokenizer", processor)
        for modality in Modality:
            strings = self.tokens(modality)
            token_id = self.token_id(modality)
            if not strings and token_id is not None:
                strings = [tokenizer.convert_ids_to_tokens(token_id)]
                setattr(self, f"{modality.value}_token", strings[0])
            if not strings:
                continue
            resolved = tokenizer.convert_tokens_to_ids(strings[0])
            unk = getattr(tokenizer, "unk_token_id", None)
            if resolved is None or (unk is not None and resolved == unk):
                raise ValueError(f"{modality.value} placeholder {strings[0]!r} is not in the tokenizer vocabulary")
            if token_id is not None and token_id != resolved:
                raise ValueError(
                    f"{modality.value}_token_id={token_id} disagrees with the tokenizer's id {resolved} "
                    f"for {strings[0]!r}"
                )
            setattr(self, f"{modality.value}_token_id", int(resolved))
        self.compile_regex()
        return self

    def compile_regex(self) -> None:
        """Compile the combined placeholder regex (build() does this; no tokenizer needed)."""
        self._modality_of = {}
        for modality in Modality:
            for s in self.tokens(modality):
                if not s:
                    raise ValueError(f"{modality.value} placeholder string is empty")
                other = self._modality_of.setdefault(s, modality)
                if other is not modality:
                    raise ValueError(f"placeholder {s!r} is configured for both {other.value} and {modality.value}")
        if self._modality_of:
            alternatives = sorted(self._modality_of, key=len, reverse=True)
            self._regex = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")
        else:
            self._regex = None

    # ------------------------------------------------------------ lookups

    def tokens(self, modality: Modality) -> list[str]:
        value = getattr(self, f"{Modality(modality).value}_token")
        if value is None:
            return []
        return [value] if isinstance(value, str) else list(value)

    def token_id(self, modality: Modality) -> int | None:
        return getattr(self, f"{Modality(modality).value}_token_id")

    @property
    def modalities(self) -> list[Modality]:
        """Modalities with a placeholder configured."""
        return [m for m in Modality if self.tokens(m) or self.token_id(m) is not None]

    @property
    def combined_regex(self) -> re.Pattern[str] | None:
        if self._regex is None and not self._modality_of:
            self.compile_regex()
        return self._regex

    def modality_of(self, piece: str) -> Modality | None:
        """The modality whose placeholder is exactly `piece`, else None."""
        if not self._modality_of:
            self.compile_regex()
        return self._modality_of.get(piece)

    # ------------------------------------------------------------ prompts

    def split(self, prompt: str) -> list[str]:
        """`prompt` cut at placeholders; placeholders are their own pieces; no empty pieces."""
        regex = self.combined_regex
        if regex is None:
            return [prompt] if prompt else []
        return [p for p in regex.split(prompt) if p]

    def count(self, prompt: str) -> dict[Modality, int]:
        """Placeholders per configured modality (zero counts included)."""
        counts = {m: 0 for m in self.modalities}
        regex = self.combined_regex
        if regex is not None:
            for match in regex.finditer(prompt):
                counts[self._modality_of[match.group(0)]] += 1
        return counts

    def count_ids(self, input_ids: list[int]) -> dict[Modality, int]:
        """Placeholder token ids per configured modality in `input_ids`."""
        by_id = {self.token_id(m): m for m in self.modalities if self.token_id(m) is not None}
        counts = {m: 0 for m in self.modalities}
        for t in input_ids:
            m = by_id.get(t)
            if m is not None:
                counts[m] += 1
        return counts

    def check_counts(self, prompt: str, num_items: Mapping[Modality, int]) -> None:
        """Raise ValueError unless `prompt` has exactly one placeholder per item per modality."""
        check_placeholder_counts(self.count(prompt), num_items, self, what="prompt")


def check_placeholder_counts(found: Mapping[Modality, int], num_items: Mapping[Modality, int],
                             tokens: MultimodalSpecialTokens, *, what: str) -> None:
    """Shared by prompt and input_ids checks: names the modality, the placeholder and the counts."""
    wanted = {Modality(m): n for m, n in num_items.items() if n}
    for m in wanted:
        if not tokens.tokens(m) and tokens.token_id(m) is None:
            raise ValueError(f"this model has no {m.value} placeholder; {m.value} inputs are not supported")
    if wanted and not any(found.get(m, 0) for m in wanted):
        given = ", ".join(f"{n} {m.value}(s)" for m, n in wanted.items())
        names = ", ".join(repr(tokens.tokens(m)[0]) for m in wanted if tokens.tokens(m))
        raise ValueError(
            f"{what} contains no media placeholders ({names}) but {given} were given; "
            "format the prompt with the chat template or insert one placeholder per item"
        )
    for m in Modality:
        n_found, n_items = found.get(m, 0), wanted.get(m, 0)
        if n_found != n_items:
            name = tokens.tokens(m)[0] if tokens.tokens(m) else f"id {tokens.token_id(m)}"
            raise ValueError(
                f"{what} has {n_found} {m.value} placeholder(s) ({name!r}) but {n_items} {m.value} item(s) were given"
            )
