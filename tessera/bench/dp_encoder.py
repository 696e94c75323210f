"""How evenly the DP-sharded vision encoder shares a step's images out (`python -m tessera.bench.dp_encoder`).

Images are drawn as the serving benchmark's random-image mix draws them (`random:224-1536`, each side
uniform), sized into patches the way Qwen2-VL's processor does (28-pixel merged patches, its default pixel
bounds), grouped K to a step and assigned to R ranks. The figure is max/mean patches per rank (1.00 =
perfect; the step waits for the most loaded rank), the greedy assignment beside a plain split into
contiguous runs of equal count.
"""

from __future__ import annotations

import argparse
import random
import statistics

from tessera.bench.datasets import Resolution
from tessera.distributed.encoder_dp import dp_encoder_assignment

MERGED_PATCH = 28  # pixels per merged patch side (14-pixel patches, 2x2 merge)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384  # Qwen2-VL image processor defaults


def merged_patches(width: int, height: int) -> int:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(height, width, factor=MERGED_PATCH, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return (h // MERGED_PATCH) * (w // MERGED_PATCH)


def imbalance(loads: list[int]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def contiguous(sizes: list[int], ranks: int) -> list[list[int]]:
    per = -(-len(sizes) // ranks)
    return [list(range(r * per, min(len(sizes), (r + 1) * per))) for r in range(ranks)]


def run(steps: int = 200, seed: int = 0, images_per_step: tuple[int, ...] = (4, 8, 16, 32),
        ranks: tuple[int, ...] = (2, 4, 8)) -> list[dict]:
    rng = random.Random(seed)
    res = Resolution.parse("random:224-1536")
    rows = []
    for k in images_per_step:
        batches = [[merged_patches(*res.draw(rng)) for _ in range(k)] for _ in range(steps)]
        for r in ranks:
            greedy = [imbalance([sum(b[i] for i in s) for s in dp_encoder_assignment(b, r)]) for b in batches]
            naive = [imbalance([sum(b[i] for i in s) for s in contiguous(b, r)]) for b in batches]
            rows.append({"images_per_step": k, "ranks": r, "greedy_median": statistics.median(greedy),
                         "greedy_p90": sorted(greedy)[int(0.9 * steps)], "contiguous_median": statistics.median(naive)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| images per step | ranks | greedy max/mean (median) | greedy (p90) | contiguous split (median) |",
             "|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['images_per_step']} | {x['ranks']} | {x['greedy_median']:.3f} | {x['greedy_p90']:.3f} | "
                     f"{x['contiguous_median']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    print(markdown(run(ns.steps, ns.seed)))


if __name__ == "__main__":
    main()
