"""The LoRA adapters the server serves, as the frontend knows them: what requests may name, and the load and
unload operations, answered by every replica's scheduler (scheduler/lora_slots.py handle_lora_adapter).

A request names an adapter by `lora_path` (SGLang's field: the adapter's name) or, on the OpenAI endpoints, by
`model` ("base:adapter" or the adapter's own name); an unknown name is refused before anything is sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from collections.abc import Awaitable, Callable, Sequence

from tessera.config import ServerArgs
from tessera.messages.frontend import LoraAdapterReq, LoraAdapterResult
from tessera.messages.items import MultimodalInputs

OP_TIMEOUT_S = 120.0  # a large adapter on a slow disk; the server keeps serving meanwhile


class UnknownAdapter(ValueError):
    """A request named an adapter that is not loaded (its message names the field and the adapter): a 400, or a
    404 where the adapter is named as the OpenAI `model`."""


class AdapterOpFailed(ValueError):
    """/load_lora_adapter or /unload_lora_adapter refused: `status` is the HTTP status (400, 404, 409)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class LoraRegistry:
    """send_all: sends a message to every live replica; replicas: how many are live (each answers)."""

    def __init__(self, args: ServerArgs, send_all: Callable[[object], Awaitable[None]], replicas: Callable[[], int]):
        self.send_all, self.replicas = send_all, replicas
        self.enabled = args.enable_lora
        self.paths: dict[str, str] = dict(args.lora_adapters)  # name -> path, in load order
        self._pending: dict[str, tuple[asyncio.Future, dict[int, LoraAdapterResult], int]] = {}
        self._lock = asyncio.Lock()

    def resolve(self, name: str | None, field: str = "lora_path") -> str | None:
        """The adapter a request names (None: the base model); UnknownAdapter naming it and `field`."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise UnknownAdapter(f"{field}: expected an adapter's name, got {type(name).__name__}")
        if name not in self.paths:
            if not self.enabled:
                raise UnknownAdapter(f"{field}: adapter {name!r}: this server runs without --enable-lora")
            loaded = ", ".join(self.paths) or "none"
            raise UnknownAdapter(f"{field}: adapter {name!r} is not loaded (loaded: {loaded})")
        return name

    @staticmethod
    def tag(mm_inputs: MultimodalInputs | None, lora_name: str | None) -> MultimodalInputs | None:
        """A request's media items marked with its adapter, their hashes salted with it (copies: the processor's
        cache keeps the originals), so an adapter on the vision tower never shares an embedding with another."""
        if mm_inputs is None or lora_name is None:
            return mm_inputs
        salt = int.from_bytes(hashlib.blake2b(lora_name.encode(), digest_size=8).digest(), "little")
        items = [dataclasses.replace(item, hash=item.hash ^ salt, lora_name=lora_name) for item in mm_inputs.items]
        return dataclasses.replace(mm_inputs, items=items)

    def model_adapter(self, model: str | None, base_names: Sequence[str]) -> str | None:
        """The adapter an OpenAI `model` names: "base:adapter" or an adapter's own name (None: the base model)."""
        # The base model: no name, the served name or path, and the placeholders routers fill in for a request
        # that named none (sglang-router: "unknown"; OpenAI clients: "default").
        if model in (None, "", "default", "unknown", *base_names):
            return None
        if isinstance(model, str) and model in self.paths:
            return model
        base, sep, adapter = model.rpartition(":") if isinstance(model, str) else ("", "", "")
        if sep and base in base_names:
            return self.resolve(adapter, "model")
        raise UnknownAdapter(f"model: the model {model!r} does not exist; this server serves {base_names[0]!r}"
                             + (f" and its adapters {', '.join(self.paths)}" if self.paths else ""))

    async def load(self, name: str, path: str) -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise AdapterOpFailed("lora_name: a non-empty name without ':' (the OpenAI model is 'base:adapter')")
        if not isinstance(path, str) or not path:
            raise AdapterOpFailed("lora_path: the adapter's directory (adapter_config.json + adapter_model.safetensors)")
        if name in self.paths:
            raise AdapterOpFailed(f"lora_name: adapter {name!r} is already loaded (from {self.paths[name]})")
        await self._run(LoraAdapterReq(uuid.uuid4().hex, name, path))
        self.paths[name] = path

    async def unload(self, name: str) -> None:
        if name not in self.paths:
            raise AdapterOpFailed(f"lora_name: adapter {name!r} is not loaded", 404)
        await self._run(LoraAdapterReq(uuid.uuid4().hex, name, None))
        del self.paths[name]

    async def _run(self, msg: LoraAdapterReq) -> None:
        """Sends `msg` to every live replica and waits for all their answers; the first refusal is raised."""
        if not self.enabled:
            raise AdapterOpFailed("LoRA adapters need a server started with --enable-lora (or --lora-paths)")
        async with self._lock:  # one operation at a time: the replicas see them in the same order
            fut = asyncio.get_running_loop().create_future()
            self._pending[msg.op_id] = (fut, {}, self.replicas())
            try:
                await self.send_all(msg)
                results = await asyncio.wait_for(fut, OP_TIMEOUT_S)
            finally:
                self._pending.pop(msg.op_id, None)
        for result in results:
            if result.error is not None:
                raise AdapterOpFailed(result.error, result.status)

    def answered(self, result: LoraAdapterResult) -> None:
        """A replica's answer (from the receive loop)."""
        pending = self._pending.get(result.op_id)
        if pending is None:
            return
        fut, parts, replicas = pending
        parts[result.dp_rank] = result
        if len(parts) >= replicas and not fut.done():
            fut.set_result([parts[r] for r in sorted(parts)])

    def cards(self) -> list[dict]:
        return [{"name": name, "path": path} for name, path in self.paths.items()]
