"""The HF transformers baseline of `tessera bench offline`: batched `generate` with left padding, greedy,
exactly the requested token counts (see offline.py for the workloads and how both sides are timed)."""

from __future__ import annotations

import time


from tessera.bench.agreement import GreedyOutput
from tessera.bench.datasets import OfflineRequest, Workload


class _ChosenLogprobs:
    """A logits processor that changes nothing and keeps, per step, each row's float32 log_softmax at its argmax:
    the logprob of the token greedy search picks (it runs last, so the argmax it sees is generate's choice).
    [B] floats per step, where output_scores would keep [B, vocab]."""

    def __init__(self) -> None:
        self.steps: list = []

    def __call__(self, input_ids, scores):
        import torch

        self.steps.append(torch.log_softmax(scores.float(), dim=-1).max(dim=-1).values)
        return scores


class HFRunner:
    """transformers' batched `generate`: left padding, greedy, exactly the requested token counts."""

    def __init__(self, model_path: str, batch_size: int, device: str = "auto", dtype: str = "auto"):
        import torch
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        from tessera.models.config import ModelConfig
        from tessera.platform.device import resolve_device, resolve_dtype

        self.torch = torch
        self.processor = AutoProcessor.from_pretrained(model_path)
        self.processor.tokenizer.padding_side = "left"  # decoder-only batching: pad before the prompt
        device = str(resolve_device(device))  # the same device and dtype the engine resolves to
        torch_dtype = resolve_dtype(dtype, ModelConfig.load(model_path).dtype, device)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(model_path, dtype=torch_dtype).to(device).eval()
        self.device, self.batch_size = device, batch_size
        self.pad_id = self.processor.tokenizer.pad_token_id or 0
        self.last_outputs: list[GreedyOutput] = []

    def close(self) -> None:
        del self.model

    def _batch(self, prompts: list[str], lens: list[int], reqs: list[OfflineRequest],
               record: bool) -> list[GreedyOutput]:
        """One static batch, decoded to its longest request's length; lens: each request's own length."""
        new_tokens = max(lens)
        from transformers import LogitsProcessorList

        images = [img for r in reqs for img in r.images]
        enc = self.processor(text=prompts, images=images or None, padding=True, return_tensors="pt").to(self.device)
        chosen = _ChosenLogprobs()
        # eos_token_id=None: the batch neither stops at EOS nor bans it, as Tessera's ignore_eos.
        with self.torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=self.pad_id,
                                      logits_processor=LogitsProcessorList([chosen]) if record else None)
        prompt_len = enc["input_ids"].shape[1]
        if out.shape[1] - prompt_len != new_tokens:
            raise RuntimeError(f"HF generated {out.shape[1] - prompt_len} tokens, expected {new_tokens}")
        if not record:
            return []
        ids = out[:, prompt_len:].tolist()
        lps = self.torch.stack(chosen.steps, dim=1).tolist()  # [B, new_tokens]
        return [GreedyOutput(ids[j][:n], lps[j][:n]) for j, n in enumerate(lens)]

    def run(self, work: Workload, output_len: int | None = None, batch_size: int | None = None,
            record: bool = False) -> float:
        bs = batch_size or self.batch_size
        outputs: list[GreedyOutput] = []
        t0 = time.perf_counter()
        for i in range(0, len(work.requests), bs):
            reqs = work.requests[i : i + bs]
            outputs += self._batch(work.prompts[i : i + bs], [output_len or r.output_len for r in reqs], reqs, record)
        seconds = time.perf_counter() - t0
        if record:
            self.last_outputs = outputs
        return seconds
