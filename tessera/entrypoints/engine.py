"""The offline Engine: `tessera.Engine(model_path=...).generate(...)`, SGLang-style.

The Engine owns a private event loop in a background thread; the TokenizerManager and all its
sockets live on that loop. Sync calls submit coroutines to it and wait; async calls await it
from the caller's own loop, so the Engine works inside Jupyter, asyncio apps and plain scripts.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tessera.config import ServerArgs
from tessera.frontend.embed_batch import run_batch
from tessera.frontend.embedding import embedding_request, embedding_result, media_prompt
from tessera.frontend.request import GenerateRequest
from tessera.frontend.tokenizer_manager import FrontendStats, TokenizerManager
from tessera.messages.pooling import PoolingParams
from tessera.messages.sampling import SamplingParams
from tessera.messages import SchedulerStats

_STREAM_END = object()


def _as_list(x: Any, n: int) -> list:
    return list(x) if isinstance(x, list) else [x] * n


class Engine:
    def __init__(self, model_path: str = "demo-vl", *, show_progress: bool = True, **kwargs: Any):
        """show_progress=False: no progress bars at all, neither generate's nor the weight loading's (the
        scheduler's, which follows disable_tqdm unless that is given explicitly)."""
        if not show_progress:
            kwargs.setdefault("disable_tqdm", True)
        self.server_args = ServerArgs.for_engine(model_path, **kwargs)
        self.show_progress = show_progress and not self.server_args.disable_tqdm
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tessera-engine-loop", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.tokenizer_manager = TokenizerManager(self.server_args)
            self._run(self.tokenizer_manager.start())
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)

    # ---- plumbing ---------------------------------------------------------------------------
    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def tokenizer(self):
        return self.tokenizer_manager.tokenizer

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        return self.tokenizer_manager.info.apply_chat_template(messages, add_generation_prompt, **kw)

    # ---- request building ---------------------------------------------------------------------
    @staticmethod
    def _build_requests(prompt, sampling_params, input_ids, image_data, video_data, audio_data,
                        return_logprob, stream, video_kwargs=None,
                        logprob_start_len: int = -1, lora_path=None) -> tuple[list[GenerateRequest], bool]:
        is_batch = isinstance(prompt, list) or (
            isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        if not is_batch:
            prompts, ids_list = [prompt], [input_ids]
            images, videos, audios = [image_data], [video_data], [audio_data]
            params_list = [sampling_params]
            loras = [lora_path]
        else:
            n = len(prompt) if isinstance(prompt, list) else len(input_ids)
            prompts = prompt if isinstance(prompt, list) else [None] * n
            ids_list = input_ids if input_ids is not None else [None] * n
            images = image_data if image_data is not None else [None] * n
            videos = video_data if video_data is not None else [None] * n
            audios = audio_data if audio_data is not None else [None] * n
            params_list = _as_list(sampling_params, n)
            loras = lora_path if isinstance(lora_path, list) else [lora_path] * n  # SGLang: a name, or one per prompt
            for name, lst in (("image_data", images), ("video_data", videos), ("audio_data", audios),
                              ("sampling_params", params_list), ("lora_path", loras)):
                if len(lst) != n:
                    raise ValueError(f"{name}: batch of {len(lst)} entries for {n} prompts")
        reqs = []
        for text, ids, img, vid, aud, sp, lora in zip(prompts, ids_list, images, videos, audios, params_list, loras):
            params = sp if isinstance(sp, SamplingParams) else SamplingParams.from_dict(sp or {})
            params.normalize()
            base = dict(text=text, input_ids=ids, image_data=img, video_data=vid, audio_data=aud,
                        return_logprob=return_logprob, stream=stream, video_kwargs=video_kwargs,
                        logprob_start_len=logprob_start_len, lora_path=lora)
            if params.n == 1:
                reqs.append(GenerateRequest(sampling_params=params, **base))
            else:  # n samples: independent requests sharing the prompt (and so its KV)
                for i in range(params.n):
                    seed = None if params.seed is None else params.seed + i
                    reqs.append(GenerateRequest(sampling_params=dataclasses.replace(params, n=1, seed=seed), **base))
        return reqs, is_batch or len(reqs) > 1

    async def _collect(self, req: GenerateRequest) -> dict:
        result = None
        async for out in self.tokenizer_manager.generate(req):
            result = out
        return result.to_dict()

    def _requests_of(self, stream: bool, *args) -> tuple[list[GenerateRequest], bool]:
        """_build_requests(*args); a stream takes a single prompt with n=1."""
        reqs, is_batch = self._build_requests(*args)
        if stream and len(reqs) != 1:
            raise ValueError("stream: streaming takes a single prompt with n=1")
        return reqs, is_batch

    async def _generate_all(self, reqs: list[GenerateRequest], progress: bool) -> list[dict]:
        bar = None
        if progress and len(reqs) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="Generating", unit="req")

        async def one(r: GenerateRequest) -> dict:
            out = await self._collect(r)
            if bar is not None:
                bar.update(1)
            return out

        try:
            return list(await asyncio.gather(*(one(r) for r in reqs)))
        finally:
            if bar is not None:
                bar.close()

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, image_data: Any = None,
                 video_data: Any = None, audio_data: Any = None, return_logprob: bool = False,
                 stream: bool = False, video_kwargs: dict | None = None,
                 logprob_start_len: int = -1, lora_path: str | list[str | None] | None = None
                 ) -> dict | list[dict] | Iterator[dict]:
        """Generates for one prompt (returns a dict) or a batch (returns a list of dicts).

        With stream=True (single prompt only) returns an iterator of cumulative output dicts.
        video_kwargs: how videos are sampled, e.g. {"num_frames": 8} (as the server's media_io_kwargs.video).
        logprob_start_len: SGLang's; >= 0 also returns meta_info["input_token_logprobs"] (and
        "input_top_logprobs" with top_logprobs_num) for the prompt tokens from that position on.
        lora_path: SGLang's; a loaded LoRA adapter's name (or one per prompt; None: the base model).
        """
        reqs, is_batch = self._requests_of(stream, prompt, sampling_params, input_ids, image_data, video_data,
                                           audio_data, return_logprob, stream, video_kwargs, logprob_start_len,
                                           lora_path)
        if stream:
            return self._stream_sync(reqs[0])
        outs = self._run(self._generate_all(reqs, self.show_progress))
        return outs if is_batch else outs[0]

    def _stream_sync(self, req: GenerateRequest) -> Iterator[dict]:
        import queue

        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate(req):
                    q.put(out.to_dict())
            except BaseException as e:  # surfaces in the caller's thread
                q.put(e)
            finally:
                q.put(_STREAM_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := q.get()) is not _STREAM_END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                             video_data=None, audio_data=None, return_logprob: bool = False,
                             stream: bool = False, logprob_start_len: int = -1, lora_path=None
                             ) -> dict | list[dict] | AsyncIterator[dict]:
        reqs, is_batch = self._requests_of(stream, prompt, sampling_params, input_ids, image_data, video_data,
                                           audio_data, return_logprob, stream, None, logprob_start_len, lora_path)
        if stream:
            return self._stream_async(reqs[0])
        fut = asyncio.run_coroutine_threadsafe(self._generate_all(reqs, False), self._loop)
        outs = await asyncio.wrap_future(fut)
        return outs if is_batch else outs[0]

    async def _stream_async(self, req: GenerateRequest) -> AsyncIterator[dict]:
        q: asyncio.Queue = asyncio.Queue()
        caller_loop = asyncio.get_running_loop()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate(req):
                    caller_loop.call_soon_threadsafe(q.put_nowait, out.to_dict())
            except BaseException as e:
                caller_loop.call_soon_threadsafe(q.put_nowait, e)
            finally:
                caller_loop.call_soon_threadsafe(q.put_nowait, _STREAM_END)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := await q.get()) is not _STREAM_END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()

    def encode(self, prompt: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
               image_data: Any = None, *, pooling: str | None = None, normalize: bool = True,
               dimensions: int | None = None, add_special_tokens: bool = True) -> dict | list[dict]:
        """Embeddings (SGLang's Engine.encode): {"embedding": [floats], "meta_info": {...}} for one input, a
        list for a batch (a list of prompts, of token-id lists, or, with neither, of images). Images come in
        the formats generate takes; a prompt without the model's image placeholders is wrapped in the chat
        template as one user turn. pooling: "last", "mean" or "cls" (default: the server's --pooling);
        dimensions: Matryoshka truncation (before normalising)."""
        params = PoolingParams(pooling or self.server_args.pooling or "last", normalize, dimensions)
        is_batch = isinstance(prompt, list) or (isinstance(input_ids, list) and bool(input_ids)
                                                and isinstance(input_ids[0], list))
        if is_batch:
            n = len(prompt) if isinstance(prompt, list) else len(input_ids)  # type: ignore[arg-type]
        elif prompt is None and input_ids is None and isinstance(image_data, list):
            is_batch, n = True, len(image_data)  # images alone: one embedding each
        else:
            n = 1
        texts = prompt if isinstance(prompt, list) else [prompt] * n
        ids_list = input_ids if is_batch and input_ids is not None else [input_ids] * n
        images = image_data if is_batch and image_data is not None else [image_data] * n
        if len(texts) != n or len(ids_list) != n or len(images) != n:
            raise ValueError(f"image_data: {len(images)} entries for {n} inputs")
        tm = self.tokenizer_manager
        reqs, sampling = [], SamplingParams(max_new_tokens=0)
        for text, ids, imgs in zip(texts, ids_list, images):
            imgs = None if imgs is None else imgs if isinstance(imgs, list) else [imgs]
            if ids is None:
                text = media_prompt(tm.info, tm.mm_processor, text, len(imgs or []))
            reqs.append(embedding_request(params, text, ids, imgs, add_special_tokens, sampling=sampling))
        outs = [embedding_result(o) for o in self._run(run_batch(tm, reqs))]
        return outs if is_batch else outs[0]

    def get_stats(self) -> SchedulerStats:
        """The scheduler's counters (KV use, prefix-cache and encoder-cache hits, ...)."""
        return self._run(self.tokenizer_manager.get_stats())

    def get_server_info(self) -> dict:
        """As SGLang's /get_server_info: the server arguments, the settings they resolved to (device,
        dtype, KV pool size, ...) and the scheduler's counters."""
        return {**self.tokenizer_manager.server_info(), "stats": self.get_stats().report()}

    def get_frontend_stats(self) -> FrontendStats:
        """The frontend's counters (preprocessing-cache hits and misses, ...)."""
        return self.tokenizer_manager.frontend_stats()

    def flush_cache(self) -> None:
        self._run(self.tokenizer_manager.flush_cache())

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Loads a PEFT LoRA adapter under `lora_name` (SGLang's Engine method); AdapterOpFailed says why not."""
        self._run(self.tokenizer_manager.lora.load(lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._run(self.tokenizer_manager.lora.unload(lora_name))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "tokenizer_manager"):
            self.tokenizer_manager.shutdown()
            try:
                self._run(self.tokenizer_manager.close(), timeout=5)
            except Exception:  # the loop may already be gone at interpreter exit
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
