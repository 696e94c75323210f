"""Where a program's gen/select calls run: an in-process Engine or a `tessera serve` URL (RuntimeEndpoint).

Every call sends the whole conversation so far (messages with their media); the server's prefix cache
(and its media caches) make the shared part cheap, so a multi-turn program prefills each turn's new
tokens only. A conversation whose last message is the assistant's is continued from its text (a prefilled
answer); otherwise the reply starts a new assistant turn.
"""

from __future__ import annotations

import base64
import io
import json
import mimetypes
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tessera.lang.ir import Media


@dataclass
class Message:
    role: str
    parts: list[str | Media]  # text and media in order

    @property
    def text(self) -> str:
        return "".join(p for p in self.parts if isinstance(p, str))


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    token_logprobs: list[float]  # one per output token when asked, else []
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class Backend(Protocol):
    def complete(self, messages: list[Message], params: list[dict], logprobs: bool = False) -> list[Completion]:
        """One completion per entry of `params` (SamplingParams fields), all continuing `messages`."""

    def stream(self, messages: list[Message], params: dict) -> Iterator[str | Completion]:
        """One completion continuing `messages`: its text deltas as they come, then the Completion."""


def _split_prefill(messages: list[Message]) -> tuple[list[Message], str | None]:
    """(the conversation, the assistant's prefilled answer or None when a new turn starts)."""
    if messages and messages[-1].role == "assistant":
        last = messages[-1]
        if any(isinstance(p, Media) for p in last.parts):
            raise ValueError("assistant: media inside the assistant's own answer cannot be continued")
        return messages[:-1], last.text
    return messages, None


class EngineBackend:
    """Runs programs on a tessera.Engine in this process."""

    def __init__(self, engine):
        self.engine = engine

    def prompt(self, messages: list[Message]) -> tuple[str, dict[str, list], dict | None]:
        """(prompt text, media by modality, video kwargs) for continuing `messages`."""
        history, prefill = _split_prefill(messages)
        template, media = [], {"image": [], "video": [], "audio": []}
        frames = None
        for m in history:
            parts = []
            for p in m.parts:
                if isinstance(p, Media):
                    media[p.modality].append(p.source)
                    parts.append({"type": p.modality})
                    frames = p.num_frames or frames
                elif p:
                    parts.append({"type": "text", "text": p})
            template.append({"role": m.role, "content": parts})
        # The template's generation prompt opens the assistant turn; a prefilled answer follows it verbatim.
        text = self.engine.apply_chat_template(template, add_generation_prompt=True) + (prefill or "")
        return text, media, ({"num_frames": frames} if frames else None)

    def complete(self, messages: list[Message], params: list[dict], logprobs: bool = False) -> list[Completion]:
        text, media, video_kwargs = self.prompt(messages)

        def one(p: dict) -> dict:  # one call per completion (no progress bar); concurrent, so they batch
            return self.engine.generate(text, dict(p), image_data=media["image"] or None,
                                        video_data=media["video"] or None, audio_data=media["audio"] or None,
                                        return_logprob=logprobs, video_kwargs=video_kwargs)

        outs = [one(params[0])] if len(params) == 1 else _in_threads(one, params)
        return [_completion(out) for out in outs]

    def stream(self, messages: list[Message], params: dict) -> Iterator[str | Completion]:
        text, media, video_kwargs = self.prompt(messages)
        out = None
        for out in self.engine.generate(text, dict(params), image_data=media["image"] or None,
                                        video_data=media["video"] or None, audio_data=media["audio"] or None,
                                        stream=True, video_kwargs=video_kwargs):
            if out["delta"]:
                yield out["delta"]
        yield _completion(out)


def _completion(out: dict) -> Completion:
    meta = out["meta_info"]
    finish = meta.get("finish_reason") or {}
    return Completion(out["text"], finish.get("type"), [lp for lp, *_ in meta.get("output_token_logprobs", [])],
                      meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0), meta.get("completion_tokens", 0))


class RuntimeEndpoint:
    """Runs programs on a `tessera serve` (or any server with Tessera's OpenAI extras) at `base_url`,
    through /v1/chat/completions."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 300.0, max_parallel: int = 16):
        import httpx

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="tessera-endpoint")

    def _body(self, messages: list[Message], params: dict, logprobs: bool) -> dict:
        history, prefill = _split_prefill(messages)
        out_messages, media_kwargs = [], {}
        for m in history:
            parts = []
            for p in m.parts:
                if isinstance(p, Media):
                    parts.append(_media_part(p))
                    if p.num_frames:
                        media_kwargs = {"video": {"num_frames": p.num_frames}}
                elif p:
                    parts.append({"type": "text", "text": p})
            out_messages.append({"role": m.role, "content": parts})
        body: dict[str, Any] = {"model": "default", "messages": out_messages, "logprobs": logprobs}
        if prefill:
            body["messages"].append({"role": "assistant", "content": prefill})
            body["continue_final_message"] = True
        if media_kwargs:
            body["media_io_kwargs"] = media_kwargs
        for key, value in params.items():
            body[{"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(key, key)] = value
        return body

    def _post(self, body: dict) -> Completion:
        r = self._client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:500]
            raise (ValueError if r.status_code < 500 else RuntimeError)(message)
        data = r.json()
        choice, usage = data["choices"][0], data.get("usage") or {}
        lps = [e["logprob"] for e in ((choice.get("logprobs") or {}).get("content") or [])]
        return Completion(choice["message"].get("content") or "", choice.get("finish_reason"), lps,
                          usage.get("prompt_tokens", 0),
                          (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                          usage.get("completion_tokens", 0))

    def complete(self, messages: list[Message], params: list[dict], logprobs: bool = False) -> list[Completion]:
        bodies = [self._body(messages, p, logprobs) for p in params]
        return list(self._pool.map(self._post, bodies))

    def stream(self, messages: list[Message], params: dict) -> Iterator[str | Completion]:
        body = {**self._body(messages, params, False), "stream": True, "stream_options": {"include_usage": True}}
        text, finish, usage = [], None, {}
        with self._client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise (ValueError if r.status_code < 500 else RuntimeError)(r.text[:500])
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", "stream error"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        text.append(delta)
                        yield delta
                    finish = choice.get("finish_reason") or finish
        yield Completion("".join(text), finish, [], usage.get("prompt_tokens", 0),
                         (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                         usage.get("completion_tokens", 0))

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()


def _media_part(m: Media) -> dict:
    src = m.source
    if m.modality == "audio":
        data = src if isinstance(src, bytes) else Path(src).read_bytes() if _is_local(src) else None
        if data is None:
            return {"type": "audio_url", "audio_url": {"url": src}}
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    url = _data_uri(src) if (_is_local(src) or not isinstance(src, str)) else src
    key = "image_url" if m.modality == "image" else "video_url"
    return {"type": key, key: {"url": url}}


def _is_local(src: Any) -> bool:
    return isinstance(src, (str, Path)) and not str(src).startswith(("http://", "https://", "data:")) and \
        Path(src).is_file()


def _data_uri(src: Any) -> str:
    """A local file or a PIL image as a data URI (the server does not read this machine's files)."""
    if isinstance(src, (str, Path)):
        mime = mimetypes.guess_type(str(src))[0] or "application/octet-stream"
        return f"data:{mime};base64," + base64.b64encode(Path(src).read_bytes()).decode()
    if hasattr(src, "save"):  # a PIL image
        buf = io.BytesIO()
        src.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    raise TypeError(f"media: expected a path, URL, data URI or PIL image, got {type(src).__name__}")


def _in_threads(fn, items: list) -> list:
    """fn over items on short-lived threads (joined here, so nothing outlives the call), results in order."""
    results: list = [None] * len(items)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


_endpoints: dict[str, RuntimeEndpoint] = {}  # one per URL: runs share its connections and threads
_endpoints_lock = threading.Lock()


def as_backend(backend: Any) -> Backend:
    """An Engine, a server URL, or a backend object."""
    if hasattr(backend, "complete"):
        return backend
    if isinstance(backend, str):
        with _endpoints_lock:
            if backend not in _endpoints:
                _endpoints[backend] = RuntimeEndpoint(backend)
            return _endpoints[backend]
    if hasattr(backend, "generate") and hasattr(backend, "apply_chat_template"):
        return EngineBackend(backend)
    raise TypeError(f"backend: expected a tessera.Engine, a server URL or a RuntimeEndpoint, got {type(backend)!r}")


def grammar_for_choices(choices: tuple[str, ...]) -> str:
    """A Lark grammar whose language is exactly the choices (json.dumps quotes and escapes each one)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)
