"""`bench-medium`: a ~150M-parameter random-weight Qwen2-VL, built on the fly for benchmarks.

demo-vl (4.8M parameters) is so small that per-step Python overhead dominates any measurement;
bench-medium has GPT-2-small-sized layers, so matrix multiplies dominate, as they do for real
models. Its weights are random (from a seed), its tokenizer, chat template and processor are
demo-vl's files, copied. It is written to a temp dir and reused while that dir lives; weights are
never committed.

    python -m tessera.bench.medium [--seed 0] [--dtype float32|bfloat16|float16] [--out DIR]    # prints its dir
    tessera serve --model-path "$(python -m tessera.bench.medium)"

`--dtype bfloat16` / `float16` writes the same random weights rounded to that dtype (a 16-bit checkpoint, as
real ones ship) into a directory of its own.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from tessera.config import ASSETS_DIR, resolve_model_path

MEDIUM_NAME = "bench-medium"
# Bump when the architecture below changes, so stale cached checkpoints are not reused.
MEDIUM_VERSION = 1
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                   "video_preprocessor_config.json", "processor_config.json")
# Text: GPT-2-small width/depth with GQA; vision: 12 blocks of width 576. 152.8M parameters in all.
TEXT_SIZES = dict(hidden_size=768, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4)
VISION_SIZES = dict(depth=12, embed_dim=576, num_heads=9, hidden_size=768)


def medium_config(skeleton_dir: Path):
    """The bench-medium config; token ids come from the tokenizer files in skeleton_dir."""
    from transformers import Qwen2VLConfig

    from tessera.demo.build_vl import build_config

    base = build_config(skeleton_dir)  # demo-vl's config, read from the same tokenizer: right token ids
    text = base.text_config.to_dict()
    text.pop("layer_types", None)  # derived from num_hidden_layers; a stale copy would be rejected
    text.update(TEXT_SIZES)
    # head_dim 64 like demo-vl, so demo-vl's M-RoPE sections (8, 12, 12; sum = head_dim / 2) fit.
    assert TEXT_SIZES["hidden_size"] // TEXT_SIZES["num_attention_heads"] == 64
    vision = base.vision_config.to_dict()
    vision.update(VISION_SIZES)
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                         image_token_id=base.image_token_id, video_token_id=base.video_token_id,
                         vision_start_token_id=base.vision_start_token_id,
                         vision_end_token_id=base.vision_end_token_id)


def processor_digest(directory: Path) -> str:
    """Hash of the tokenizer/processor files: demo-vl's may still change (retraining rebuilds them),
    and a checkpoint built from older copies would tokenize prompts differently from demo-vl."""
    h = hashlib.sha256()
    for name in PROCESSOR_FILES:
        path = directory / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"<missing>") + b"\0")
    return h.hexdigest()[:12]


DTYPES = ("float32", "bfloat16", "float16")


def default_dir(seed: int, dtype: str = "float32") -> Path:
    digest = processor_digest(ASSETS_DIR / "demo-vl")
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return Path(tempfile.gettempdir()) / f"tessera-{MEDIUM_NAME}-v{MEDIUM_VERSION}-seed{seed}-{digest}{suffix}"


def is_complete(path: Path) -> bool:
    return (path / "config.json").exists() and (path / "model.safetensors").exists() and all(
        (path / f).exists() for f in PROCESSOR_FILES)


def is_current(path: Path) -> bool:
    """Complete, and built from demo-vl's present tokenizer/processor files."""
    return is_complete(path) and processor_digest(path) == processor_digest(ASSETS_DIR / "demo-vl")


def build_medium(seed: int = 0, out_dir: str | Path | None = None, dtype: str = "float32") -> Path:
    """Writes (or reuses) the bench-medium checkpoint, its weights in `dtype`, and returns its directory."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r}; choose one of {', '.join(DTYPES)}")
    target = Path(out_dir) if out_dir is not None else default_dir(seed, dtype)
    if is_current(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename at the end: a crash or a concurrent build never leaves a
    # half-written checkpoint under the name a later run would trust.
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from a server run as another user
    try:
        src = ASSETS_DIR / "demo-vl"
        for name in PROCESSOR_FILES:
            shutil.copy2(src / name, work / name)
        cfg = medium_config(work)
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(cfg)  # HF's init: normal(0, initializer_range)
        model.to(getattr(torch, dtype)).save_pretrained(work)
        del model
        if target.exists():  # a stale build (older processor files): replace it file by file
            for path in work.iterdir():
                os.replace(path, target / path.name)
        else:
            try:
                os.rename(work, target)
            except OSError:
                if not is_current(target):  # somebody else's concurrent build is fine; anything else is not
                    raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target


def resolve_bench_model(model_path: str, seed: int = 0) -> str:
    """`bench-medium` -> a built checkpoint dir; bundled names and local dirs -> their directory.

    Both sides of a comparison load from this directory; neither may reach the network (transformers
    would otherwise try the Hub for a name it does not find locally, and wait on timeouts)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model_path == MEDIUM_NAME:
        return str(build_medium(seed))
    return resolve_model_path(model_path)


def count_parameters(model_dir: str | Path) -> int:
    """Parameters of a checkpoint, counted on the meta device (no weights loaded)."""
    import torch
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(cfg)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tessera.bench.medium", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="the weights' dtype in the checkpoint")
    ap.add_argument("--out", default=None, help="checkpoint directory (default: a per-seed, per-dtype temp dir)")
    ns = ap.parse_args(argv)
    print(build_medium(ns.seed, ns.out, ns.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
