"""Writing a trained demo model as a standard HF checkpoint directory, replaced atomically."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path


def save_checkpoint(model, out_dir: Path, write_files: Callable[[Path], None], language: str | None = None) -> None:
    """`write_files(dir)` adds the tokenizer/processor files; then the weights, the config and a greedy
    generation config (with `language`, the ISO-639-1 code of a speech model's training data, which
    /v1/audio/transcriptions reports). A reader of out_dir never sees a half-written checkpoint."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_files(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    text = model.config.get_text_config()
    gen = {"do_sample": False, "eos_token_id": [text.eos_token_id, text.pad_token_id],
           "pad_token_id": text.pad_token_id, "max_new_tokens": 32}
    if language is not None:
        gen["language"] = language
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
