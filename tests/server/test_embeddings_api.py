"""/v1/embeddings on demo-vl through the `openai` client, unchanged (its default base64 encoding and float),
against transformers' base model (fp32, final-norm hidden state of the last token, L2-normalised): text,
token ids, vLLM's `messages` form with an image, Matryoshka `dimensions`; usage, /metrics, and 400s naming the
field."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from tessera.config import ASSETS_DIR
from tests.conftest import EXAMPLE_IMAGE

TEXTS = ["a red circle above a blue square", "two green triangles", "hello"]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    path = ASSETS_DIR / "demo-vl"
    return AutoProcessor.from_pretrained(path), Qwen2VLForConditionalGeneration.from_pretrained(path).eval()


@torch.no_grad()
def hf_embedding(hf, text: str, images=None, dims: int | None = None) -> np.ndarray:
    processor, model = hf
    enc = processor(text=[text], images=images, return_tensors="pt") if images else \
        processor.tokenizer([text], return_tensors="pt")
    v = model.model(**enc).last_hidden_state[0, -1]
    v = v[:dims] if dims else v
    return torch.nn.functional.normalize(v, dim=-1).numpy()


def assert_same(ours, ref: np.ndarray) -> None:
    ours = np.asarray(ours, dtype=np.float32)
    assert ours.shape == ref.shape
    assert float(ours @ ref / np.linalg.norm(ours) / np.linalg.norm(ref)) >= 0.99999
    assert float(np.abs(ours - ref).max()) <= 1e-4


def test_openai_client_embeddings_match_hf(vl_server, hf):
    from openai import OpenAI

    client = OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="none")
    refs = [hf_embedding(hf, t) for t in TEXTS]
    assert float(refs[0] @ refs[1]) < 0.999, "the reference ignores its input"
    res = client.embeddings.create(model="demo-vl", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in res.data] == [0, 1, 2]
    for d, ref in zip(res.data, refs):
        assert_same(d.embedding, ref)
    n_tokens = sum(len(hf[0].tokenizer(t)["input_ids"]) for t in TEXTS)
    assert res.usage.prompt_tokens == res.usage.total_tokens == n_tokens
    one = client.embeddings.create(model="demo-vl", input=TEXTS[0], encoding_format="float", dimensions=32)
    assert_same(one.data[0].embedding, hf_embedding(hf, TEXTS[0], dims=32))
    ids = hf[0].tokenizer(TEXTS[1])["input_ids"]
    assert_same(client.embeddings.create(model="demo-vl", input=[ids]).data[0].embedding, refs[1])


def test_messages_with_an_image_match_hf(vl_server, hf):
    from PIL import Image

    processor, _ = hf
    uri = "data:image/png;base64," + base64.b64encode(EXAMPLE_IMAGE.read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "the scene"}]}]
    r = httpx.post(f"{vl_server.base_url}/v1/embeddings", json={"messages": messages, "encoding_format": "base64"},
                   timeout=60)
    assert r.status_code == 200, r.text
    ours = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "the scene"}]}]
    prompt = processor.apply_chat_template(template, add_generation_prompt=False, tokenize=False)
    ref = hf_embedding(hf, prompt, images=[Image.open(EXAMPLE_IMAGE).convert("RGB")])
    assert_same(ours, ref)
    # SGLang's {text, image} input gives the same prompt, so the same vector.
    r = httpx.post(f"{vl_server.base_url}/v1/embeddings",
                   json={"input": [{"text": "the scene", "image": uri}], "encoding_format": "float"}, timeout=60)
    assert_same(r.json()["data"][0]["embedding"], ref)
    metrics = httpx.get(f"{vl_server.base_url}/metrics").text
    count = [line for line in metrics.splitlines() if line.startswith("tessera_embedding_requests{")]
    assert count and float(count[0].split()[-1]) >= 2


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [1.5]}, "input"),
    ({"input": "hi", "messages": []}, "input"),
    ({"input": "word " * 20000}, "input"),
    ({"input": "hi", "dimensions": 100000}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "temperature": 0}, "temperature"),
    ({"input": [[10 ** 9]]}, "input"),
    ({"input": ["fine", "word " * 20000, "also fine"]}, "input"),  # one bad input of a batch: the whole 400
])
def test_bad_requests_are_400s_naming_the_field(vl_server, body, param):
    r = httpx.post(f"{vl_server.base_url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{vl_server.base_url}/v1/embeddings", json={"input": ["fine", "x"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text  # and the server goes on
