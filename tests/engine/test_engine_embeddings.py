"""Engine.encode against transformers (fp32): the base model's final-norm hidden states pooled (last token,
mean, first token), L2-normalised or not, truncated to `dimensions`; text, token ids and images in the
Engine's three image formats; alone and batched, beside generation, over prefill chunks (chunks of 16 tokens)
and from the prefix cache. Bad inputs fail by field name."""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tests.engine.hf_reference import chat_prompt, hf_greedy

TEXTS = ["Hello there, how are you doing on this fine day, my friend?", "a red circle", "x"]


@pytest.fixture(scope="module")
def hf(tiny_gqa):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    return AutoProcessor.from_pretrained(tiny_gqa), Qwen2VLForConditionalGeneration.from_pretrained(tiny_gqa).eval()


@pytest.fixture(scope="module")
def engine(tiny_gqa):
    with Engine(str(tiny_gqa), page_size=4, chunked_prefill_size=16, max_total_tokens=4096,
                show_progress=False) as eng:
        yield eng


@torch.no_grad()
def hf_hidden(hf, text: str | None = None, ids: list[int] | None = None, images=None) -> torch.Tensor:
    """HF's base model (Qwen2VLModel) last_hidden_state [L, H] of a text (the tokenizer's own special tokens),
    token ids or a templated prompt with images."""
    processor, model = hf
    if ids is not None:
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    enc = processor(text=[text], images=images, return_tensors="pt") if images else \
        processor.tokenizer([text], return_tensors="pt")
    return model.model(**enc).last_hidden_state[0]


def pooled(hidden: torch.Tensor, method: str = "last", normalize: bool = True, dims: int | None = None):
    v = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    v = v[:dims] if dims else v
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def assert_same(out: dict, ref: torch.Tensor) -> None:
    ours = torch.tensor(out["embedding"])
    assert ours.shape == ref.shape
    assert float(torch.nn.functional.cosine_similarity(ours, ref, dim=0)) >= 0.99999
    assert float((ours - ref).abs().max()) <= 1e-4


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_text_batch_and_alone_match_hf(engine, hf, method):
    refs = [pooled(hf_hidden(hf, t), method) for t in TEXTS]
    assert float(torch.dot(refs[0], refs[1])) < 0.999, "the reference ignores its input"
    for out, ref in zip(engine.encode(TEXTS, pooling=method), refs):
        assert_same(out, ref)
    alone = engine.encode(TEXTS[0], pooling=method)
    assert_same(alone, refs[0])
    assert alone["meta_info"]["prompt_tokens"] == len(hf[0].tokenizer(TEXTS[0])["input_ids"])


def test_token_ids_unnormalised_and_truncated_match_hf(engine, hf):
    ids = [[5, 17, 99, 3, 42, 7], [8, 9]]
    outs = engine.encode(input_ids=ids, pooling="mean", normalize=False)
    for out, i in zip(outs, ids):
        assert_same(out, pooled(hf_hidden(hf, ids=i), "mean", normalize=False))
    out = engine.encode(input_ids=ids[0], dimensions=16)
    assert_same(out, pooled(hf_hidden(hf, ids=ids[0]), "last", dims=16))
    assert abs(float(torch.tensor(out["embedding"]).norm()) - 1) < 1e-5


def test_images_in_three_formats_match_hf(engine, hf, scene_images):
    processor, model = hf
    image = scene_images[0]
    prompt = chat_prompt(processor, 1, "Describe.", add_generation_prompt=False)
    ref = pooled(hf_hidden(hf, prompt, images=[image]))
    enc = processor(text=[prompt], images=[image], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    with torch.no_grad():
        feature = torch.cat(model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"]).pooler_output)
    raw = engine.encode("Describe.", image_data=image)  # no placeholders: wrapped in the chat template
    templated = engine.encode(prompt, image_data=[image])
    processed = engine.encode(input_ids=ids, image_data=dict(enc, format="processor_output"))
    precomputed = engine.encode(input_ids=ids, image_data=dict(
        format="precomputed_embedding", feature=feature, image_grid_thw=enc["image_grid_thw"]))
    for out in (raw, templated, processed, precomputed):
        assert_same(out, ref)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
    # A batch of images alone (each its own templated request), with mean pooling across prefill chunks.
    outs = engine.encode(image_data=scene_images[1:3], pooling="mean")
    for img, out in zip(scene_images[1:3], outs):
        image_only = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}],
                                                   add_generation_prompt=False, tokenize=False)
        assert_same(out, pooled(hf_hidden(hf, image_only, images=[img]), "mean"))


def test_prefix_cache_and_generation_beside_embeddings(engine, hf):
    """A repeated embedding request takes its prompt from the radix cache (last-token pooling) and gives the
    same vector; generation requests batched with embedding requests keep HF's greedy tokens."""
    processor, model = hf
    text = TEXTS[0] * 3
    first = engine.encode(text)
    again = engine.encode(text)
    assert again["meta_info"]["cached_tokens"] > 0
    assert_same(again, torch.tensor(first["embedding"]))
    prompt = chat_prompt(processor, 0, "Hello there, how are you?")
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    want = hf_greedy(model, processor, prompt, None, None, 6)[0]

    async def both():
        gen = engine.async_generate(prompt, sp)
        import asyncio

        loop = asyncio.get_running_loop()
        emb = loop.run_in_executor(None, lambda: engine.encode(TEXTS, pooling="mean"))
        return await asyncio.gather(gen, emb)

    import asyncio

    out, embs = asyncio.run(both())
    assert out["output_ids"] == want
    for e, t in zip(embs, TEXTS):
        assert_same(e, pooled(hf_hidden(hf, t), "mean"))
    assert engine.get_stats().num_embedding_requests >= 10


@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", dimensions=0), "dimensions"),
    (dict(prompt="hi", dimensions=10_000), "dimensions"),
    (dict(prompt="hi", pooling="max"), "pooling"),
    (dict(prompt="word " * 5000), "prompt"),
])
def test_bad_input_names_the_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.encode(**kwargs)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A text-only Qwen3 (q/k norms) with demo-vl's tokenizer."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tessera.config import ASSETS_DIR

    path = tmp_path_factory.mktemp("tiny-qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS_DIR / "demo-vl" / name, path / name)
    cfg = Qwen3Config(vocab_size=576, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=2)
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


def test_text_family_matches_hf_and_refuses_images(tiny_qwen3, scene_images):
    from transformers import AutoModel, AutoTokenizer

    tok, base = AutoTokenizer.from_pretrained(tiny_qwen3), AutoModel.from_pretrained(tiny_qwen3).eval()
    with torch.no_grad():
        refs = [base(**tok([t], return_tensors="pt")).last_hidden_state[0] for t in TEXTS]
    with Engine(str(tiny_qwen3), pooling="mean", page_size=2, chunked_prefill_size=8, max_total_tokens=1024,
                show_progress=False) as engine:
        for out, ref in zip(engine.encode(TEXTS), refs):  # the server's --pooling: mean
            assert_same(out, pooled(ref, "mean"))
        for out, ref in zip(engine.encode(TEXTS, pooling="last"), refs):
            assert_same(out, pooled(ref, "last"))
        with pytest.raises(ValueError, match="^media: .* takes text only"):
            engine.encode("a picture", image_data=scene_images[0])


def test_headless_base_model_is_an_embedding_model(tiny_qwen3, tmp_path):
    """`Qwen3Model` (a base model saved without its LM head, as e5 / gte-style checkpoints are) loads as an
    embedding model: its vectors are the base model's, generation is refused."""
    import json
    import shutil

    from transformers import AutoModel, AutoTokenizer

    base = AutoModel.from_pretrained(tiny_qwen3).eval()
    base.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen3 / name, tmp_path / name)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    tok = AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        refs = [base(**tok([t], return_tensors="pt")).last_hidden_state[0] for t in TEXTS]
    with Engine(str(tmp_path), max_total_tokens=1024, show_progress=False) as engine:
        for out, ref in zip(engine.encode(TEXTS), refs):
            assert_same(out, pooled(ref, "last"))
        with pytest.raises(ValueError, match="^prompt: Qwen3Model is served for embeddings only"):
            engine.generate("hello", {"max_new_tokens": 2})


def test_a_batch_mixes_texts_token_ids_and_images(engine, hf, scene_images):
    """Engine.encode of a list goes as one batch (frontend/embed_batch.py): the texts in one tokenizer call
    and one message, each image on its own; every answer in its input's place, as HF gives it."""
    processor, _ = hf
    prompts = ["a red circle", "Hello there", "x", "the scene"]
    outs = engine.encode(prompts, image_data=[None, None, None, scene_images[0]])
    for out, text in zip(outs[:3], prompts):
        assert_same(out, pooled(hf_hidden(hf, text)))
    templated = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "the scene"}]}],
        add_generation_prompt=False, tokenize=False)
    assert_same(outs[3], pooled(hf_hidden(hf, templated, images=[scene_images[0]])))
    ids = processor.tokenizer("a red circle")["input_ids"]
    assert_same(engine.encode(input_ids=[ids, ids])[1], pooled(hf_hidden(hf, "a red circle")))


def test_a_bad_input_fails_its_batch_and_nothing_else(engine, hf):
    """One input too long: the batch fails naming the field, its other requests are dropped (the frontend
    holds none of them), and the engine answers the next batch and the prompts' own tokenization unchanged."""
    with pytest.raises(ValueError, match="^prompt:"):
        engine.encode(["a red circle", "word " * 5000, "x"])
    tm = engine.tokenizer_manager
    assert not tm.states and not any(tm.dispatcher.in_flight)
    outs = engine.encode(TEXTS)
    for out, text in zip(outs, TEXTS):
        assert_same(out, pooled(hf_hidden(hf, text)))
        assert out["meta_info"]["prompt_tokens"] == len(hf[0].tokenizer(text)["input_ids"])
    assert engine.encode([]) == []


def test_batched_tokenizer_call_gives_each_text_its_own_ids(hf):
    """The batch path's assumption: the fast tokenizer's batch call gives every text what encode gives it."""
    tok = hf[0].tokenizer
    texts = ["a red circle", "", "  spaced  out ", "ünïcödé ✓ 漢字", "<|im_start|>user", "x" * 300]
    for special in (True, False):
        batch = tok(texts, add_special_tokens=special)["input_ids"]
        assert batch == [tok.encode(t, add_special_tokens=special) for t in texts]
