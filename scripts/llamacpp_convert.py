"""Runs llama.cpp's vendored convert_hf_to_gguf.py on a Tessera checkpoint (demo-vl, bench-medium).

    python scripts/llamacpp_convert.py LLAMA_CPP_DIR MODEL_DIR [converter args...]

(sentencepiece, which the converter imports, is looked for beside LLAMA_CPP_DIR, in pydeps/: see
build_llamacpp.sh.)

One change, made here at run time and never written to llama.cpp's files: the converter names a BPE
tokenizer's pre-tokenizer by hashing how it splits a fixed text, and refuses hashes missing from its table.
demo-vl's tokenizer (549 tokens, trained for the demo) is in no table, but its pre-tokenizer is ByteLevel
with the GPT-2 regex (tokenizer.json says so), which is what llama.cpp's `gpt-2` pre-tokenizer does; so an
unknown hash maps to `gpt-2` when, and only when, tokenizer.json declares exactly that.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path


def is_gpt2_byte_level(model_dir: Path) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return False
    tok = json.loads(path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    return tok.get("model", {}).get("type") == "BPE" and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def main() -> None:
    llama_dir, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
    sys.path.append(str(llama_dir.parent / "pydeps"))  # ROOT/llama.cpp is a link: ROOT/pydeps
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if is_gpt2_byte_level(model_dir):
                print("llamacpp_convert: unknown pre-tokenizer hash; tokenizer.json is ByteLevel with the GPT-2 "
                      "regex, so it is converted as gpt-2", file=sys.stderr)
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), str(model_dir), *sys.argv[3:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
