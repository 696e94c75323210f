"""CPU time of a Qwen-VL vision tower over an offline workload's images: transformers' own attention and MLP
modules vs ours (tessera.models.vision_attention), A/B interleaved in one process, one thread.

    python -m tessera.bench.vision_tower [--model-path demo-vl] [--workload a] [--runs 5] [--images-per-call 64]

CPU time (time.thread_time) rather than wall time: on a shared machine it moves far less with the load.
Both towers get the patch-embed matmul (kept before this change); they differ only in the swap this
measures. Prints the per-run times, the medians and the largest output difference.
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="demo-vl")
    parser.add_argument("--workload", default="a", choices=("a", "b", "c"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--images-per-call", type=int, default=64,
                        help="split the images into tower calls of this many (a scheduler step's share)")
    args = parser.parse_args(argv)

    from tessera.models.hf_towers import batch_vision_attention

    torch.set_num_threads(1)
    before, pixels, grid = _tower_and_inputs(args.model_path, args.workload)
    after = copy.deepcopy(before)
    batch_vision_attention(after)
    rows = grid.prod(-1).tolist()
    calls, start = [], 0
    for first in range(0, len(rows), args.images_per_call):
        count = sum(rows[first:first + args.images_per_call])
        calls.append((pixels[start:start + count], grid[first:first + args.images_per_call]))
        start += count

    def run(tower: torch.nn.Module) -> tuple[float, torch.Tensor]:
        begin = time.thread_time()
        out = torch.cat([tower(p, grid_thw=g).pooler_output for p, g in calls])
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
