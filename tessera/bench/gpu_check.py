"""One-command GPU check: `python -m tessera.bench.gpu_check --out DIR` (one GPU, about 8 minutes).

Builds random-weight Qwen2-VL checkpoints with demo-vl's tokenizer and processor (a tiny one for parity,
a 2B-sized and a 7B-sized one for speed; the vocabulary is demo-vl's 576 tokens, so the embedding tables are
small and the weight bytes are those of the transformer blocks and the vision tower), then measures, side by
side in one run, and writes DIR/gpu_check.json and DIR/gpu_check.md:

1. parity with HF transformers on the device: fp32 on the tiny config token-identical (images, video, a batch,
   chunked prefill, a prefix-cache hit); bf16 the fraction of identical greedy tokens and the max difference
   of the chosen tokens' logprobs;
2. the device's copy bandwidth and the decode floor it implies per model (weight bytes / bandwidth);
3. batch-1 decode ms per token, Tessera vs HF vs the floor; Tessera's decode step at batch 8, 32, 64;
4. `tessera bench offline` workload a, Tessera vs HF output tok/s;
5. `tessera bench serving` random-image 448x448 at concurrency 64 against a `tessera serve` subprocess.

Each section has a time budget and is skipped, with the reason recorded, when the run's deadline would not
leave it room; a failing section records its error and the next one runs. `--device cpu --tiny` runs every
section on tiny sizes on a CPU in about a minute (the dry run tests/bench/test_gpu_check.py makes).
Needs only torch, transformers and the project's own small dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# (text: hidden, layers, heads, kv heads, intermediate; vision: depth, width, heads)
SIZES: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 128, 2, 32, 2),
    "2b": (1536, 28, 12, 2, 8960, 32, 1280, 16),  # Qwen2-VL-2B's shapes
    "7b": (3584, 28, 28, 4, 18944, 32, 1280, 16),  # Qwen2-VL-7B's shapes
}
DRY_SIZES = {"2b": (128, 2, 2, 1, 256, 2, 64, 2), "7b": (256, 2, 4, 2, 512, 2, 64, 2)}


@dataclass(frozen=True)
class Plan:
    """What a run does: full sizes on a GPU, or the dry run's small ones."""

    device: str
    tiny: bool
    deadline_s: float
    decode_tokens: int
    batch_sizes: tuple[int, ...]
    offline_requests: int
    serving_prompts: int
    serving_concurrency: int

    @classmethod
    def make(cls, device: str, tiny: bool, deadline_s: float) -> Plan:
        if tiny:
            return cls(device, True, deadline_s, 6, (8,), 4, 8, 4)
        return cls(device, False, deadline_s, 64, (8, 32, 64), 64, 256, 64)

    def sizes(self, name: str) -> tuple[int, ...]:
        return DRY_SIZES[name] if self.tiny and name in DRY_SIZES else SIZES[name]


def build_checkpoint(path: Path, size: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """A random-weight Qwen2-VL with demo-vl's tokenizer, chat template and processor files."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from tessera.demo.build_vl import build_skeleton

    hidden, layers, heads, kv_heads, inter, depth, width, vheads = size
    base = build_skeleton(path)
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
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                        image_token_id=base.image_token_id, video_token_id=base.video_token_id,
                        vision_start_token_id=base.vision_start_token_id, vision_end_token_id=base.vision_end_token_id)
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


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, tiny: bool) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 5."""
    n = (16 if tiny else 1024) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n / sorted(times[1:])[2]


# ---- parity ----------------------------------------------------------------------------------------------
def _media():
    from tessera.demo import scenes

    rng = random.Random(42)
    return [scenes.image_sample(rng).frames[0] for _ in range(3)], list(scenes.video_sample(random.Random(9)).frames)


def _chat(processor, images: int, text: str, videos: int = 0) -> str:
    content = [{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def _parity_cases(processor) -> list[dict]:
    images, video = _media()
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


def parity(path: Path, plan: Plan, dtype: str, n: int = 8) -> dict:
    """Tessera vs HF greedy on every case, in one batch with chunked prefill (chunks of 16 cut through the
    image spans), then the first two again (prefix-cache hits)."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from tessera.entrypoints.engine import Engine

    torch_dtype = getattr(torch, dtype)
    processor = AutoProcessor.from_pretrained(path)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch_dtype).to(plan.device).eval()
    cases = _parity_cases(processor)
    want = [_hf_greedy(model, processor, c, n, plan.device) for c in cases]
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
    return {"dtype": dtype, "cases": rows, "all_identical": all(r["identical"] for r in rows),
            "identical_fraction": same / total, "max_logprob_diff": max_diff}


# ---- speed -----------------------------------------------------------------------------------------------
def _text_prompts(processor, count: int) -> list[str]:
    return [_chat(processor, 0, f"Write a long story about shape number {i}.") for i in range(count)]


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def tessera_decode_ms(engine, prompts: list[str], n: int, device: str) -> float:
    """Decode ms per step for this batch: (T(n tokens) - T(1 token)) / (n - 1), warm."""
    run = lambda k: engine.generate(prompts, {"temperature": 0, "max_new_tokens": k, "ignore_eos": True})  # noqa: E731
    run(2)
    t1, tn = _timed(lambda: run(1), device), _timed(lambda: run(n), device)
    return 1000 * (tn - t1) / (n - 1)


@torch.no_grad()
def hf_decode_ms(model, tokenizer, prompts: list[str], n: int, device: str) -> float:
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    run = lambda k: model.generate(**enc, max_new_tokens=k, min_new_tokens=k, do_sample=False,  # noqa: E731
                                   pad_token_id=0)
    run(2)
    t1, tn = _timed(lambda: run(1), device), _timed(lambda: run(n), device)
    return 1000 * (tn - t1) / (n - 1)


def decode_speed(path: Path, plan: Plan, bandwidth: float, budget_left: Callable[[], float]) -> dict:
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from tessera.entrypoints.engine import Engine

    dtype = "float32" if plan.device == "cpu" else "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = _text_prompts(tokenizer, max(plan.batch_sizes))
    out: dict[str, Any] = {"dtype": dtype, "weight_bytes": weight_bytes(path),
                           "floor_ms": 1000 * weight_bytes(path) / bandwidth, "tessera_step_ms": {}}
    with Engine(str(path), device=plan.device, dtype=dtype, max_running_requests=max(plan.batch_sizes),
                show_progress=False) as engine:
        out["tessera_b1_ms"] = tessera_decode_ms(engine, prompts[:1], plan.decode_tokens, plan.device)
        for bs in plan.batch_sizes:
            if budget_left() < 20:
                out["skipped"] = f"batch {bs} and above: out of time"
                break
            out["tessera_step_ms"][bs] = tessera_decode_ms(engine, prompts[:bs], plan.decode_tokens, plan.device)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype)).to(plan.device).eval()
    out["hf_b1_ms"] = hf_decode_ms(hf, tokenizer, prompts[:1], min(plan.decode_tokens, 32), plan.device)
    big = max(plan.batch_sizes)
    if budget_left() > 30:
        out["hf_step_ms"] = {big: hf_decode_ms(hf, tokenizer, prompts[:big], min(plan.decode_tokens, 16), plan.device)}
    del hf
    return out


def offline_a(path: Path, plan: Plan) -> dict:
    from tessera.bench.offline import OfflineConfig, run_offline

    dtype = "float32" if plan.device == "cpu" else "bfloat16"
    cfg = OfflineConfig(model_path=str(path), workloads=("a",), num_runs=1, num_requests=plan.offline_requests,
                        max_output_len=8 if plan.tiny else None, hf_batch_size=16 if plan.tiny else 64,
                        engine_args={"device": plan.device, "dtype": dtype})
    result = run_offline(cfg, log=lambda *_: None)
    return result["results"]


def serving(path: Path, plan: Plan, timeout_s: float) -> dict:
    from tessera.bench.report import LocalServer
    from tessera.bench.serving import ServingConfig, run_serving

    dtype = "float32" if plan.device == "cpu" else "bfloat16"
    start = time.monotonic()
    with LocalServer(str(path), "--device", plan.device, "--dtype", dtype, "--max-running-requests",
                     str(plan.serving_concurrency), startup_timeout_s=timeout_s / 2) as server:
        cfg = ServingConfig(base_url=server.base_url, dataset="random-image", num_prompts=plan.serving_prompts,
                            max_concurrency=plan.serving_concurrency, image_resolution="448x448",
                            output_len=8 if plan.tiny else 128, disable_tqdm=True,
                            timeout_s=max(timeout_s - (time.monotonic() - start), 10))
        m = run_serving(cfg, quiet=True)["metrics"]
    return {k: m[k] for k in ("num_completed", "num_failed", "output_throughput", "ttft_ms", "tpot_ms",
                              "duration_s", "errors")}


# ---- the run ---------------------------------------------------------------------------------------------
def run(out_dir: Path, plan: Plan, work_dir: Path | None = None, log=print) -> dict:
    start = time.monotonic()
    left = lambda: plan.deadline_s - (time.monotonic() - start)  # noqa: E731
    report: dict[str, Any] = {
        "device": plan.device, "tiny": plan.tiny, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if plan.device.startswith("cuda") else None, "sections": {}}
    work = Path(work_dir) if work_dir else out_dir / "checkpoints"
    models: dict[str, Path] = {}

    def section(name: str, needs_s: float, fn: Callable[[], Any]) -> None:
        if left() < needs_s:
            report["sections"][name] = {"skipped": f"{left():.0f} s left, needs about {needs_s:.0f} s"}
            log(f"[gpu_check] {name}: skipped (deadline)")
            return
        t = time.monotonic()
        try:
            report["sections"][name] = {"result": fn()}
        except Exception as e:  # one broken section must not hide the others' figures
            report["sections"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        report["sections"][name]["seconds"] = round(time.monotonic() - t, 1)
        log(f"[gpu_check] {name}: {report['sections'][name]['seconds']} s"
            + (f" ERROR {report['sections'][name]['error']}" if "error" in report["sections"][name] else ""))

    def build_all() -> dict:
        out = {}
        for name in ("tiny", "2b", "7b"):
            dtype = torch.float32 if name == "tiny" or plan.device == "cpu" else torch.bfloat16
            models[name] = build_checkpoint(work / name, plan.sizes(name), dtype, plan.device)
            out[name] = {"weight_bytes": weight_bytes(models[name]), "shape": plan.sizes(name)}
        return out

    section("checkpoints", 60 if not plan.tiny else 0, build_all)
    section("parity_fp32", 30 if not plan.tiny else 0, lambda: parity(models["tiny"], plan, "float32"))
    if plan.device != "cpu":
        section("parity_bf16", 30, lambda: parity(models["tiny"], plan, "bfloat16"))
    bandwidth: dict[str, float] = {}
    section("bandwidth", 0, lambda: bandwidth.setdefault("bytes_per_s", copy_bandwidth(plan.device, plan.tiny)))
    for name in ("2b", "7b"):
        section(f"decode_{name}", 60 if not plan.tiny else 0,
                lambda name=name: decode_speed(models[name], plan, bandwidth["bytes_per_s"], left))
    section("offline_a_7b", 90 if not plan.tiny else 0, lambda: offline_a(models["7b"], plan))
    section("serving_7b", 90 if not plan.tiny else 0, lambda: serving(models["7b"], plan, min(left(), 240)))
    report["seconds"] = round(time.monotonic() - start, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))  # first: figures kept
    (out_dir / "gpu_check.md").write_text(markdown(report))
    return report


def _get(report: dict, name: str) -> Any:
    return report["sections"].get(name, {}).get("result")


def _status(report: dict, name: str) -> str:
    s = report["sections"].get(name, {})
    return "skipped: " + s["skipped"] if "skipped" in s else "error: " + s.get("error", "not run")


def markdown(report: dict) -> str:
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [f"# GPU check ({report['device']}{', dry run' if report['tiny'] else ''}: {report.get('gpu') or ''})",
             "", f"{report['date']}, torch {report['torch']}, {report.get('seconds')} s in all.", ""]
    lines += ["## Parity with HF (tiny config)", "", "| dtype | case | identical | same tokens | max logprob diff |",
              "|---|---|---|---|---|"]
    for name in ("parity_fp32", "parity_bf16"):
        p = _get(report, name)
        if p is None:
            lines.append(f"| {name[7:]} | {_status(report, name)} | | | |")
            continue
        for r in p["cases"]:
            lines.append(f"| {p['dtype']} | {r['case']} | {r['identical']} | {r['same_tokens']}/{r['tokens']} | "
                         f"{r['max_logprob_diff']:.2e} |")
        lines.append(f"| {p['dtype']} | **all** | {p['all_identical']} | {p['identical_fraction']:.1%} | "
                     f"{p['max_logprob_diff']:.2e} |")
    bw = _get(report, "bandwidth")
    lines += ["", f"Copy bandwidth: {f(bw / 1e9 if bw else None)} GB/s.", "",
              "## Decode (ms per step)", "",
              "| model | weights GB | floor | Tessera b1 | HF b1 | Tessera b8 | b32 | b64 | HF at the largest batch |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name in ("2b", "7b"):
        d = _get(report, f"decode_{name}")
        if d is None:
            lines.append(f"| {name} | {_status(report, f'decode_{name}')} | | | | | | | |")
            continue
        steps, hf_steps = d["tessera_step_ms"], d.get("hf_step_ms", {})
        big = max([int(k) for k in hf_steps] or [0])
        lines.append(f"| {name} | {d['weight_bytes'] / 1e9:.2f} | {f(d['floor_ms'], 2)} | {f(d['tessera_b1_ms'], 2)} | "
                     f"{f(d['hf_b1_ms'], 2)} | " + " | ".join(f(steps.get(b), 2) for b in (8, 32, 64))
                     + f" | {f(hf_steps.get(big), 2)} |")
    lines += ["", "## Offline workload a (7b)", ""]
    o = _get(report, "offline_a_7b")
    lines.append(f"```\n{json.dumps(o, indent=1, default=str)[:3000]}\n```" if o is not None else
                 _status(report, "offline_a_7b"))
    lines += ["", "## Serving, random-image 448x448 (7b)", ""]
    s = _get(report, "serving_7b")
    if s is None:
        lines.append(_status(report, "serving_7b"))
    else:
        lines += ["| completed | failed | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
                  "|---|---|---|---|---|---|---|",
                  f"| {s['num_completed']} | {s['num_failed']} | {f(s['output_throughput'])} | "
                  f"{f(s['ttft_ms']['median'])} | {f(s['ttft_ms']['p99'])} | {f(s['tpot_ms']['median'])} | "
                  f"{f(s['tpot_ms']['p99'])} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tessera.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--device", default="cuda", help="cuda[:N], or cpu for a dry run")
    parser.add_argument("--tiny", action="store_true", help="dry run: every section on tiny sizes")
    parser.add_argument("--deadline-s", type=float, default=480.0, help="skip sections that would not fit")
    parser.add_argument("--work-dir", default=None, help="where checkpoints go (default OUT/checkpoints)")
    parser.add_argument("--keep-checkpoints", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out / "checkpoints"
    report = run(out, Plan.make(args.device, args.tiny, args.deadline_s), work)
    if not args.keep_checkpoints:
        shutil.rmtree(work, ignore_errors=True)
    print((out / "gpu_check.md").read_text())
    failed = [k for k, v in report["sections"].items() if "error" in v]
    if failed:
        print(f"sections with errors: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
