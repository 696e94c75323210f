"""CPU time of a Qwen-VL vision tower over an offline workload's images: transformers' tower vs what Tessera
runs (Qwen2-VL: our own tower, tessera.models.qwen2_vl_vision; Qwen2.5-VL / Qwen3-VL: transformers' tower with
our attention and MLP modules swapped in), A/B interleaved in one process, one thread.

    python -m tessera.bench.vision_tower [--model-path demo-vl] [--workload a] [--runs 5] [--images-per-call 64]

CPU time (time.thread_time) rather than wall time: on a shared machine it moves far less with the load.
Both towers get the patch-embed matmul. Prints the per-run times, the medians and the largest output difference.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def _tower_and_inputs(model_path: str, workload: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from tessera.bench.datasets import offline_workload
    from tessera.config import resolve_model_path
    from tessera.models.hf_towers import patch_embed_as_matmul

    path = resolve_model_path(model_path)
    if "vl" not in AutoConfig.from_pretrained(path).model_type:
        raise SystemExit(f"{model_path}: not a Qwen-VL checkpoint")
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tower = hf.model.visual
    patch_embed_as_matmul(tower)
    images = [image for request in offline_workload(workload) for image in request.images]
    processed = AutoProcessor.from_pretrained(path).image_processor(images=images, return_tensors="pt")
    return tower, processed["pixel_values"], processed["image_grid_thw"]


def _tessera_tower(hf_tower: torch.nn.Module) -> torch.nn.Module:
    """The tower Tessera's model builds for this checkpoint, with the reference tower's weights."""
    from tessera.models.hf_towers import batch_vision_attention
    from tessera.models.qwen2_vl_vision import Qwen2VisionTower

    if hf_tower.config.model_type in ("qwen2_vl", "qwen2_vl_vision"):
        ours = Qwen2VisionTower(hf_tower.config).eval()
        ours.load_state_dict(hf_tower.state_dict())
        return ours
    ours = copy.deepcopy(hf_tower)
    batch_vision_attention(ours)
    return ours


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="demo-vl")
    parser.add_argument("--workload", default="a", choices=("a", "b", "c"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--images-per-call", type=int, default=64,
                        help="split the images into tower calls of this many (a scheduler step's share)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    before, pixels, grid = _tower_and_inputs(args.model_path, args.workload)
    after = _tessera_tower(before)
    rows = grid.prod(-1).tolist()
    calls, start = [], 0
    for first in range(0, len(rows), args.images_per_call):
        count = sum(rows[first:first + args.images_per_call])
        calls.append((pixels[start:start + count], grid[first:first + args.images_per_call]))
        start += count

    def run(tower: torch.nn.Module) -> tuple[float, torch.Tensor]:
        begin = time.thread_time()
        outs = [tower(p, grid_thw=g) for p, g in calls]
        out = torch.cat([o if isinstance(o, torch.Tensor) else o.pooler_output for o in outs])
        return time.thread_time() - begin, out

    times: dict[str, list[float]] = {"transformers": [], "tessera": []}
    with torch.inference_mode():
        _, want = run(before)  # warm-up, and the reference output
        _, got = run(after)
        for _ in range(args.runs):
            for name, tower in (("transformers", before), ("tessera", after)):
                times[name].append(run(tower)[0])
    print(f"{args.model_path}, workload {args.workload}: {len(rows)} images, {sum(rows)} patches, "
          f"{len(calls)} tower call(s), 1 thread, CPU seconds per pass")
    for name, xs in times.items():
        print(f"  {name:12s} {' '.join(f'{x:.3f}' for x in xs)}  median {sorted(xs)[len(xs) // 2]:.3f}")
    print(f"  max |difference| {float((got - want).abs().max()):.2e} (max |output| {float(want.abs().max()):.2f})")


if __name__ == "__main__":
    main()
