"""Builds the untrained demo-vl checkpoint skeleton: tokenizer, chat template, processor, config.

Everything here is deterministic: the BPE tokenizer is trained on a corpus generated
from the scene grammar plus generic English, so the same code always yields the same
vocabulary and the same token ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tessera.demo import scenes

# Special tokens in Qwen2-VL order; the engine and the processor read them by name.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|AUDIO|>",
]
VOCAB_SIZE = 1024  # BPE merges + bytes + specials; small so the embedding stays cheap

# Image/video resolution is part of the model: few tokens keep CPU training and serving fast.
PATCH_SIZE = 14
MERGE_SIZE = 2
IMAGE_MAX_PIXELS = 224 * 224
# min == max: every image is resized to about the same area, so shapes on small canvases get as
# many patches as on large ones (shape recognition is what limits accuracy).
IMAGE_MIN_PIXELS = 224 * 224
VIDEO_MAX_PIXELS = 112 * 112
VIDEO_MIN_PIXELS = 56 * 56



def media_first_chat_template(media_parts: str) -> str:
    """A Qwen-style chat template in which, within a message, the media parts come before its text parts
    whatever their order in the request (as LLaVA's templates do), so "text then image_url" requests see the
    layout the demo models were trained on. `media_parts`: the Jinja run for one content part."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
        "{% else %}{% for content in message['content'] %}" + media_parts +
        "{% endfor %}{% for content in message['content'] %}"
        "{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
        "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHAT_TEMPLATE = media_first_chat_template(
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% endif %}"
)

# What demo-vl ships: CHAT_TEMPLATE for a request without tools (the same text, character for character), and
# with tools Qwen2.5's tool block and <tool_call> format, so clients that send tools by default (openai-agents,
# pydantic-ai, LangChain's bind_tools) are served (issue 63).
CHAT_TEMPLATE_WITH_TOOLS = (
    '{%- if tools %}<|im_start|>system\n'
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assi"
    'stant.{% endif %}\n'
    '\n'
    '# Tools\n'
    '\n'
    'You may call one or more functions to assist with the user query.\n'
    '\n'
    'You are provided with function signatures within <tools></tools> XML tags:\n'
    '<tools>{% for tool in tools %}\n'
    '{{ tool | tojson }}{% endfor %}\n'
    '</tools>\n'
    '\n'
    'For each function call, return a json object with function name and arguments within <tool_call></to'
    'ol_call> XML tags:\n'
    '<tool_call>\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    '</tool_call><|im_end|>\n'
    "{% endif %}{% for message in messages %}{% if tools and loop.first and message['role'] == 'system' %"
    "}{% elif message['role'] == 'tool' %}<|im_start|>user\n"
    '<tool_response>\n'
    "{{ message['content'] }}\n"
    '</tool_response><|im_end|>\n'
    "{% else %}{% if not tools and loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    'You are a helpful assistant.<|im_end|>\n'
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['co"
    "ntent'] %}{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<|visio"
    "n_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content or 'vid"
    "eo_url' in content %}<|vision_start|><|video_pad|><|vision_end|>{% endif %}{% endfor %}{% for conten"
    "t in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfo"
    "r %}{% endif %}{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}\n"
    '<tool_call>\n'
    '{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": {{ call[\'function\'][\'arguments\'] | tojson }}'
    '}\n'
    '</tool_call>{% endfor %}{% endif %}<|im_end|>\n'
    '{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n'
    '{% endif %}\n'
)


GENERIC_TEXT = """\
You are a helpful assistant. What is shown here? Please describe the picture in detail.
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
Tell me about this image and the objects in it. Transcribe the audio. What do you see?
Which way is it moving? The answer is yes or no. Count the objects from left to right.
There is a picture of a cat, a dog, a car, a house, a tree and a person on the street.
0 1 2 3 4 5 6 7 8 9 10 100 1000 zero one two three four five six seven eight nine ten
"""


def _corpus(seed: int = 0, num_samples: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = GENERIC_TEXT.splitlines() * 20
    for kind in scenes.SHAPES:
        for color in scenes.COLORS:
            for d in scenes.DIRECTIONS:
                lines.append(f"Which way is the {color} {kind} moving? {d}. a {color} {kind} moving {d}")
            lines.append(f"What color is the {kind}? {color}. What shape is the {color} object? {kind}")
    for _ in range(num_samples):
        s = scenes.image_sample(rng)
        lines.append(f"{s.question}\n{s.answer}")
    lines += ["You are a helpful assistant.", "system", "user", "assistant"] * 200
    return lines


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "model_specific_special_tokens": {
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def token_id(out_dir: Path, token: str) -> int:
    vocab = json.loads((out_dir / "tokenizer.json").read_text())
    for t in vocab["added_tokens"]:
        if t["content"] == token:
            return t["id"]
    raise KeyError(token)


def build_processor_files(out_dir: Path) -> None:
    image_cfg = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
        "patch_size": PATCH_SIZE, "temporal_patch_size": 2, "merge_size": MERGE_SIZE,
        "size": {"shortest_edge": IMAGE_MIN_PIXELS, "longest_edge": IMAGE_MAX_PIXELS},
    }
    video_cfg = dict(image_cfg)
    video_cfg.pop("image_processor_type")
    video_cfg["video_processor_type"] = "Qwen2VLVideoProcessor"
    video_cfg["size"] = {"shortest_edge": VIDEO_MIN_PIXELS, "longest_edge": VIDEO_MAX_PIXELS}
    video_cfg["do_sample_frames"] = False
    video_cfg["cap_pixels_per_frame"] = False
    (out_dir / "preprocessor_config.json").write_text(json.dumps(image_cfg, indent=2))
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video_cfg, indent=2))
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE_WITH_TOOLS)
    (out_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2))


def build_config(out_dir: Path):
    from transformers import Qwen2VLConfig

    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    vocab_size = max(len(vocab), 1 + max(token_id(out_dir, t) for t in SPECIAL_TOKENS))
    vocab_size = (vocab_size + 63) // 64 * 64  # room for alignment; unused rows never win argmax
    text = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
        bos_token_id=token_id(out_dir, "<|endoftext|>"), eos_token_id=token_id(out_dir, "<|im_end|>"),
        pad_token_id=token_id(out_dir, "<|endoftext|>"),
    )
    vision = dict(
        depth=6, embed_dim=128, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, in_channels=3,
    )
    return Qwen2VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True,
        image_token_id=token_id(out_dir, "<|image_pad|>"),
        video_token_id=token_id(out_dir, "<|video_pad|>"),
        vision_start_token_id=token_id(out_dir, "<|vision_start|>"),
        vision_end_token_id=token_id(out_dir, "<|vision_end|>"),
    )


def build_skeleton(out_dir: Path):
    """Writes tokenizer and processor files; returns the model config (weights come from training)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    build_processor_files(out_dir)
    return build_config(out_dir)
