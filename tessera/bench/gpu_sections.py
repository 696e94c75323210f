"""The GPU check's sections (see gpu_check.py): what each measures, on the Plan's sizes, within the Budget.

Every section takes the run's Budget and asks it before each long part (a checkpoint, a parity case, a
batch size, a system, the serving load): a part that would not fit is not started, and the Budget records
it as cut, so a section that stops early says so in the report instead of running past the deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# (text: hidden, layers, heads, kv heads, intermediate; vision: depth, width, heads)
SIZES: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 128, 2, 32, 2),
    "2b": (1536, 28, 12, 2, 8960, 32, 1280, 16),  # Qwen2-VL-2B's shapes
    "7b": (3584, 28, 28, 4, 18944, 32, 1280, 16),  # Qwen2-VL-7B's shapes
}
DRY_SIZES = {"2b": (128, 2, 2, 1, 256, 2, 64, 2), "7b": (128, 2, 4, 2, 256, 2, 64, 2)}

# Seconds a section (to start) or a part of one needs on an H200: estimates from the sizes (weights
# written and read at a few GB/s, a 7B-sized engine's start with its graph captures, HF's eager generate).
# The dry run needs none.
NEEDS_S = {"preflight": 0, "bandwidth": 0, "checkpoints": 60, "parity_fp32": 30, "parity_bf16": 30, "decode_7b": 60,
           "decode_2b": 40, "offline_a_7b": 90, "serving_7b": 90,
           "serving_7b_overlap": 90,
           "checkpoint tiny": 5, "checkpoint 7b": 60, "checkpoint 2b": 20, "parity case": 5, "Tessera decode": 5,
           "HF batch 1": 25, "HF largest batch": 15, "offline tessera": 40, "offline hf": 60, "serving stop": 35,
           "unfused batch 1": 30, "spec_oracle_7b": 90, "lora_7b": 60, "compiled batch 1": 120}

# SGLang's published Qwen2.5-VL-7B serving figure on one H200 (MMMU): a reference, not a target.
SGLANG_VL7B_H200_OUTPUT_TOK_S = 8800


@dataclass(frozen=True)
class Plan:
    """What a run does: full sizes on a GPU, or the dry run's small ones."""

    device: str
    tiny: bool
    budget_s: float
    decode_tokens: int
    batch_sizes: tuple[int, ...]
    offline_requests: int
    serving_prompts: int
    serving_concurrency: int
    speed_models: tuple[str, ...]  # the models decode is measured on, most important first

    @classmethod
    def make(cls, device: str, tiny: bool, budget_s: float) -> Plan:
        if tiny:  # 2b's section is 7b's code on other sizes: the dry run leaves it out
            return cls(device, True, budget_s, 6, (8,), 4, 8, 4, ("7b",))
        return cls(device, False, budget_s, 64, (8, 32, 64), 64, 256, 64, ("7b", "2b"))

    def sizes(self, name: str) -> tuple[int, ...]:
        return DRY_SIZES[name] if self.tiny and name in DRY_SIZES else SIZES[name]

    def needs(self, part: str) -> float:
        return 0.0 if self.tiny else NEEDS_S[part]

    @property
    def speed_dtype(self) -> str:
        return "float32" if self.device == "cpu" else "bfloat16"


@dataclass
class Budget:
    """The run's deadline, asked inside sections too; `cuts` collects the current section's cut parts."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(init=False)
    cuts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def allows(self, part: str, needs_s: float) -> bool:
        """Whether `part` fits; if not, it is recorded as cut (and the caller stops)."""
        left = self.left()
        if left >= needs_s and left > 0:
            return True
        self.cuts.append(f"{part}: not started, {left:.0f} s left, needs about {needs_s:.0f} s")
        return False


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- checkpoints -----------------------------------------------------------------------------------------
def build_checkpoint(path: Path, size: tuple[int, ...], dtype: torch.dtype, device: str, skeleton: Path, base,
                     seed: int = 0) -> Path:
    """A random-weight Qwen2-VL with demo-vl's tokenizer, chat template and processor files (copied from
    `skeleton`, which build_skeleton wrote once; `base` is its config). As demo-vl's, the LM head is the
    embedding table."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    hidden, layers, heads, kv_heads, inter, depth, width, vheads = size
    shutil.copytree(skeleton, path, dirs_exist_ok=True)
    head_dim = hidden // heads
    section = [head_dim // 4 - head_dim // 8, head_dim // 8 + head_dim // 16, 0]
    section[2] = head_dim // 2 - section[0] - section[1]  # 128 -> (16, 24, 24), as Qwen2-VL
    text = base.text_config.to_dict()
    text.pop("layer_types", None)
    text.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, max_position_embeddings=32768,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section})
    vision = base.vision_config.to_dict()
    vision.update(depth=depth, embed_dim=width, num_heads=vheads, hidden_size=hidden)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=base.image_token_id,
                        video_token_id=base.video_token_id, vision_start_token_id=base.vision_start_token_id,
                        vision_end_token_id=base.vision_end_token_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(cfg, dtype=dtype)
    with torch.no_grad():  # larger than HF's init: greedy choices of a random model are less degenerate
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2 if hidden <= 256 else 0.02)
    model.save_pretrained(path)
    del model
    return path


def build_checkpoints(work: Path, plan: Plan, budget: Budget, models: dict[str, Path]) -> dict:
    """tiny (parity, fp32) and the speed models (bf16 on a GPU), most important first; fills `models`."""
    from tessera.demo.build_vl import build_skeleton

    skeleton = work / "skeleton"
    base = build_skeleton(skeleton)  # the tokenizer is trained: once, then copied
    out = {}
    for name in ("tiny", *plan.speed_models):
        if not budget.allows(f"checkpoint {name}", plan.needs(f"checkpoint {name}")):
            break
        dtype = torch.float32 if name == "tiny" or plan.device == "cpu" else torch.bfloat16
        models[name] = build_checkpoint(work / name, plan.sizes(name), dtype, plan.device, skeleton, base)
        out[name] = {"shape": plan.sizes(name), "file_bytes": sum(f.stat().st_size for f in
                                                                   models[name].glob("*.safetensors"))}
    return out


def _tensor_bytes(path: Path) -> dict[str, int]:
    """Each tensor's bytes, from the safetensors headers (8-byte length, then JSON), nothing loaded."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        out.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"})
    return out


def decode_weight_bytes(path: Path) -> dict:
    """The weight bytes one decode step reads: the language model's decoder layers, final norm and LM head.
    The vision tower is not run in decode; of the token embedding only one row per token is gathered, so
    its table counts only where it is also the (tied) LM head, which reads it whole."""
    sizes = _tensor_bytes(path)
    vision = {k for k in sizes if "visual." in k or "vision_tower." in k}
    embed = {k for k in sizes if k.endswith("embed_tokens.weight")}
    tied = not any(k.startswith("lm_head.") or ".lm_head." in k for k in sizes)
    counted = set(sizes) - vision - (set() if tied else embed)
    excluded = {"vision tower": sum(sizes[k] for k in vision),
                "embedding table (row gather)": 0 if tied else sum(sizes[k] for k in embed)}
    return {"bytes": sum(sizes[k] for k in counted), "tensors": len(counted), "lm_head_tied": tied,
            "counted": "language model: decoder layers, final norm, LM head"
                       + (" (tied: the embedding table, read whole)" if tied else ""),
            "excluded": excluded}


def copy_bandwidth(device: str, tiny: bool) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 5."""
    n = (16 if tiny else 1024) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n / sorted(times[1:])[2]


# ---- parity ----------------------------------------------------------------------------------------------
def _chat(processor, images: int, text: str, videos: int = 0) -> str:
    content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def _parity_cases(processor) -> list[dict]:
    from tessera.demo import scenes

    rng = random.Random(42)
    images = [scenes.image_sample(rng).frames[0] for _ in range(3)]
    video = list(scenes.video_sample(random.Random(9)).frames)  # frames: no video decoding (PyAV) needed
    return [dict(name="text", prompt=_chat(processor, 0, "Hello there, how are you?")),
            dict(name="image", prompt=_chat(processor, 1, "What color is the circle?"), image_data=[images[0]]),
            dict(name="two images", prompt=_chat(processor, 2, "Describe the image."), image_data=images[1:3]),
            dict(name="video", prompt=_chat(processor, 0, "Describe the video.", videos=1), video_data=[video])]


@torch.no_grad()
def _hf_greedy(model, processor, case: dict, n: int, device: str) -> tuple[list[int], list[float]]:
    kwargs = {}
    if case.get("image_data"):
        kwargs["images"] = case["image_data"]
    if case.get("video_data"):
        kwargs["videos"] = case["video_data"]
    enc = processor(text=[case["prompt"]], return_tensors="pt", **kwargs).to(device)
    out = model.generate(**enc, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, enc["input_ids"].shape[1]:].tolist()
    return ids, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]


def parity(path: Path, plan: Plan, dtype: str, budget: Budget, n: int = 8) -> dict:
    """Tessera vs HF greedy on every case HF finished in time, in one batch with chunked prefill (chunks of
    16 cut through the image spans), then the first two again (prefix-cache hits)."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from tessera.entrypoints.engine import Engine

    processor = AutoProcessor.from_pretrained(path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype)).to(plan.device).eval()
    cases, want = [], []
    for case in _parity_cases(processor):
        if not budget.allows(f"parity case {case['name']}", plan.needs("parity case")):
            break
        cases.append(case)
        want.append(_hf_greedy(model, processor, case, n, plan.device))
    del model
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    with Engine(str(path), device=plan.device, dtype=dtype, chunked_prefill_size=16, max_running_requests=8,
                max_total_tokens=8192, show_progress=False) as engine:
        outs = engine.generate([c["prompt"] for c in cases], sp, image_data=[c.get("image_data") for c in cases],
                               video_data=[c.get("video_data") for c in cases], return_logprob=True)
        again = engine.generate([c["prompt"] for c in cases[:2]], sp,
                                image_data=[c.get("image_data") for c in cases[:2]], return_logprob=True)
    rows, same, total, max_diff = [], 0, 0, 0.0
    for case, (ids, lps), out in [*zip(cases, want, outs), *zip([dict(c, name=c["name"] + " (prefix hit)")
                                                               for c in cases[:2]], want[:2], again)]:
        ours = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
        equal = sum(a == b for a, b in zip(out["output_ids"], ids))
        # Logprobs compare while the two sequences agree (after a split they score different tokens).
        agree = next((i for i, (a, b) in enumerate(zip(out["output_ids"], ids)) if a != b), len(ids))
        diff = max((abs(a - b) for a, b in zip(ours[:agree], lps[:agree])), default=0.0)
        rows.append({"case": case["name"], "identical": out["output_ids"] == ids, "same_tokens": equal,
                     "tokens": len(ids), "max_logprob_diff": diff,
                     "cached_tokens": out["meta_info"].get("cached_tokens", 0)})
        same, total, max_diff = same + equal, total + len(ids), max(max_diff, diff)
    return {"dtype": dtype, "cases": rows, "all_identical": bool(rows) and all(r["identical"] for r in rows),
            "identical_fraction": same / total if total else None, "max_logprob_diff": max_diff}


# ---- speed -----------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def _step_ms(run: Callable[[int], Any], n: int, device: str) -> float:
    """Decode ms per step of `run(k tokens)`: (T(n) - T(1)) / (n - 1), warm."""
    run(2)
    t1, tn = _timed(lambda: run(1), device), _timed(lambda: run(n), device)
    return 1000 * (tn - t1) / (n - 1)


def graph_report(info: dict) -> dict:
    """The decode graphs an engine reports (get_server_info's effective `cuda_graph_batch_sizes` and
    `cuda_graph_status`: "captured", "off: <why>" or "capture failed, decode runs eagerly: <error>") against
    the buckets it should have captured. A status other than "captured" is the reason none were."""
    from tessera.worker.cuda_graph import DEFAULT_MAX_BS, capture_batch_sizes

    eff = info.get("effective") or {}
    expected = capture_batch_sizes(min(info.get("cuda_graph_max_bs") or DEFAULT_MAX_BS,
                                       info.get("max_running_requests") or DEFAULT_MAX_BS))
    captured = list(eff.get("cuda_graph_batch_sizes") or [])
    status = eff.get("cuda_graph_status") or "unknown: the server info reports no CUDA graph status"
    missing = [b for b in expected if b not in captured]
    ok = status.startswith("captured")  # "captured", or with how torch.compile took part
    reason = None if ok and not missing else (status if not ok else "some buckets not captured")
    return {"expected": expected, "captured": captured, "missing": missing, "reason": reason,
            "all_captured": reason is None}


def decode_speed(path: Path, plan: Plan, bandwidth: float, budget: Budget) -> dict:
    """Batch-1 decode ms per token against the floor (the bytes a step reads / the copy bandwidth), and
    the decode step at each batch size, Tessera then HF at Tessera's largest measured batch."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from tessera.entrypoints.engine import Engine

    dtype = plan.speed_dtype
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [_chat(tokenizer, 0, f"Write a long story about shape number {i}.") for i in range(max(plan.batch_sizes))]
    weights = decode_weight_bytes(path)
    out: dict[str, Any] = {"dtype": dtype, "decode_weights": weights, "floor_ms": 1000 * weights["bytes"] / bandwidth,
                           "tessera_step_ms": {}, "hf_step_ms": {}}
    with Engine(str(path), device=plan.device, dtype=dtype, max_running_requests=max(plan.batch_sizes),
                show_progress=False) as engine:
        out["cuda_graph"] = graph_report(engine.get_server_info())

        def run(prompt_list: list[str]) -> Callable[[int], Any]:
            return lambda k: engine.generate(prompt_list, {"temperature": 0, "max_new_tokens": k, "ignore_eos": True})

        out["tessera_b1_ms"] = _step_ms(run(prompts[:1]), plan.decode_tokens, plan.device)
        for bs in plan.batch_sizes:
            if not budget.allows(f"Tessera batch {bs}", plan.needs("Tessera decode")):
                break
            out["tessera_step_ms"][str(bs)] = _step_ms(run(prompts[:bs]), plan.decode_tokens, plan.device)
    if budget.allows("unfused batch 1", plan.needs("unfused batch 1")):
        # The same engine with the layers' fused Triton kernels off (torch's operators, as before issue 48): what
        # the fusion buys, side by side. The scheduler process reads the switch when it starts.
        os.environ["TESSERA_TRITON_OPS"] = "0"
        try:
            with Engine(str(path), device=plan.device, dtype=dtype, max_running_requests=1,
                        show_progress=False) as engine:
                out["unfused_b1_ms"] = _step_ms(
                    lambda k: engine.generate(prompts[:1], {"temperature": 0, "max_new_tokens": k, "ignore_eos": True}),
                    plan.decode_tokens, plan.device)
        finally:
            os.environ.pop("TESSERA_TRITON_OPS", None)
    if not budget.allows("HF batch 1", plan.needs("HF batch 1")):
        return out
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype)).to(plan.device).eval()
    tokenizer.padding_side = "left"

    def hf_run(prompt_list: list[str]) -> Callable[[int], Any]:  # generate runs without grad on its own
        enc = tokenizer(prompt_list, return_tensors="pt", padding=True).to(plan.device)
        return lambda k: hf.generate(**enc, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)

    out["hf_b1_ms"] = _step_ms(hf_run(prompts[:1]), min(plan.decode_tokens, 32), plan.device)
    big = max(map(int, out["tessera_step_ms"]), default=None)
    if big and budget.allows(f"HF batch {big}", plan.needs("HF largest batch")):
        out["hf_step_ms"][str(big)] = _step_ms(hf_run(prompts[:big]), min(plan.decode_tokens, 16), plan.device)
    hf = None  # the closures above are done with it: its memory goes before the compiled run
    if plan.device != "cpu" and budget.allows("compiled batch 1", plan.needs("compiled batch 1")):  # graphs only
        # --enable-torch-compile beside the hand-fused kernels: inductor's default mode, whose compile fits the
        # check's budget (max-autotune's search may not); the status says whether the compiled graph was kept.
        os.environ["TESSERA_TORCH_COMPILE_MODE"] = "default"
        try:
            with Engine(str(path), device=plan.device, dtype=dtype, max_running_requests=1, enable_torch_compile=True,
                        show_progress=False) as engine:
                out["compiled_graph_status"] = engine.get_server_info()["effective"].get("cuda_graph_status")
                out["compiled_b1_ms"] = _step_ms(
                    lambda k: engine.generate(prompts[:1], {"temperature": 0, "max_new_tokens": k, "ignore_eos": True}),
                    plan.decode_tokens, plan.device)
        finally:
            os.environ.pop("TESSERA_TORCH_COMPILE_MODE", None)
    return out


def offline_a(path: Path, plan: Plan, budget: Budget) -> dict:
    """`tessera bench offline` workload a (one timed run per system after a warm-up): Tessera, then HF."""
    from transformers import AutoProcessor

    from tessera.bench.hf_baseline import HFRunner
    from tessera.bench.offline import OfflineConfig, TesseraRunner, build_workloads

    cfg = OfflineConfig(model_path=str(path), workloads=("a",), num_runs=1, num_requests=plan.offline_requests,
                        max_output_len=8 if plan.tiny else None, hf_batch_size=16 if plan.tiny else 64,
                        engine_args={"device": plan.device, "dtype": plan.speed_dtype})
    work = build_workloads(cfg, AutoProcessor.from_pretrained(path))["a"]
    out: dict[str, Any] = {"requests": len(work.requests), "output_tokens": work.output_tokens,
                           "dtype": plan.speed_dtype}
    systems = {"tessera": lambda: TesseraRunner(str(path), cfg.tessera_args),
               "hf": lambda: HFRunner(str(path), cfg.hf_batch_size, plan.device, plan.speed_dtype)}
    for name, make in systems.items():
        if not budget.allows(f"offline {name}", plan.needs(f"offline {name}")):
            break
        runner = make()
        try:
            runner.run(work.head(2, 2))  # first-call costs (lazy imports, allocator growth) stay out of the timing
            seconds = runner.run(work)
        finally:
            runner.close()
        out[name] = {"seconds": seconds, "tok_s": work.output_tokens / seconds}
    if "hf" in out:
        out["ratio_vs_hf"] = out["tessera"]["tok_s"] / out["hf"]["tok_s"]
    return out


def serving(path: Path, plan: Plan, budget: Budget, *flags: str) -> dict:
    """`tessera bench serving` random-image 448x448 against a `tessera serve` subprocess (given flags added); the
    load is stopped (and recorded as cut) when the budget runs out, leaving time to stop the server."""
    import httpx

    from tessera.bench.report import LocalServer
    from tessera.bench.serving import ServingConfig, run_benchmark_async

    reserve = plan.needs("serving stop")
    with LocalServer(str(path), "--device", plan.device, "--dtype", plan.speed_dtype, "--max-running-requests",
                     str(plan.serving_concurrency), *flags,
                     startup_timeout_s=max(budget.left() - reserve, 10)) as server:
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
        out: dict[str, Any] = {"cuda_graph": graph_report(info), "prompts": plan.serving_prompts, "flags": list(flags),
                               "concurrency": plan.serving_concurrency,
                               "sglang_reference_output_tok_s": SGLANG_VL7B_H200_OUTPUT_TOK_S}
        cfg = ServingConfig(base_url=server.base_url, dataset="random-image", num_prompts=plan.serving_prompts,
                            max_concurrency=plan.serving_concurrency, image_resolution="448x448",
                            output_len=8 if plan.tiny else 128, disable_tqdm=True, timeout_s=600)
        wait = max(budget.left() - reserve, 1.0)
        try:
            m = asyncio.run(asyncio.wait_for(run_benchmark_async(cfg), wait))["metrics"]
        except asyncio.TimeoutError:
            budget.cuts.append(f"serving load: stopped after {wait:.0f} s, before its {cfg.num_prompts} requests "
                               "finished")
            return out
        stats = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()["stats"]
        # How much of the device's time went idle between steps (the host's work): what overlap would win back.
        out["device"] = {k: stats.get(k) for k in ("device_busy_s", "device_idle_s", "device_idle_fraction")}
    out.update({k: m[k] for k in ("num_completed", "num_failed", "output_throughput", "ttft_ms", "tpot_ms",
                                  "duration_s", "errors")})
    return out


def speculative_oracle(path: Path, plan: Plan) -> dict:
    """Batch-1 output tok/s with ORACLE drafts (k = 4: the plain engine's recorded greedy answer) beside plain
    decode, two engines timed in alternation (bench/speculative.py): the verify step's ceiling on this shape."""
    from tessera.bench.speculative import SpecBenchConfig, run_spec_bench

    cfg = SpecBenchConfig(model_path=str(path), algorithm="ORACLE", num_steps=4, num_prompts=2,
                          output_len=plan.decode_tokens, concurrency=(1,), num_runs=1 if plan.tiny else 3,
                          engine_args={"device": plan.device, "dtype": plan.speed_dtype,
                                       **({} if plan.device == "cpu" else {"mem_fraction_static": 0.4})})
    return run_spec_bench(cfg)["by_concurrency"]["1"]
