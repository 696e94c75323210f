"""The LoRA HTTP API, as SGLang's: `lora_path` on /generate (a name, or one per prompt), OpenAI `model`
"base:adapter" or the adapter's own name, adapters listed in /v1/models, /load_lora_adapter and
/unload_lora_adapter; unknown adapters are a 400/404 naming them and a bad adapter leaves the server serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.lora.lora_testing import ALL_LINEARS, make_adapter, make_text_checkpoint, peft_greedy
from tests.server.server_process import ServerProcess

PROMPT = [5, 17, 33, 100, 200, 7, 9]
SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lora-server")
    base = make_text_checkpoint(root / "tiny", "qwen2", seed=11)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(base)
    adapters = {"sql": make_adapter(hf, root / "sql", seed=12, targets=ALL_LINEARS),
                "poet": make_adapter(hf, root / "poet", seed=13, r=2, targets=["q_proj", "down_proj"])}
    refs = {name: peft_greedy(base, transformers.Qwen2ForCausalLM, adapters.get(name), PROMPT, SP["max_new_tokens"])
            for name in ("sql", "poet", None)}
    srv = ServerProcess("--model-path", str(base), "--skip-server-warmup", "--max-total-tokens", "2048",
                        "--lora-paths", f"sql={adapters['sql']}", "--max-lora-rank", "4")
    yield srv, adapters, refs, root
    srv.stop()


def test_generate_openai_and_models(lora_server):
    srv, _, refs, _ = lora_server
    url = srv.base_url
    out = httpx.post(f"{url}/generate", json={"input_ids": [PROMPT, PROMPT], "sampling_params": SP,
                                              "lora_path": ["sql", None]}, timeout=60).json()
    assert [o["output_ids"] for o in out] == [refs["sql"], refs[None]]
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "sql"] and models[1]["parent"] == "tiny"
    assert httpx.get(f"{url}/v1/models/sql").json()["id"] == "sql"
    texts = []
    for model in ("tiny:sql", "sql"):
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
        texts.append(r.json()["choices"][0]["text"])
    want = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": SP, "lora_path": "sql"},
                      timeout=60).json()["text"]
    assert texts == [want, want]
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny:nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and "'nope' is not loaded" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": SP, "lora_path": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert httpx.get(f"{url}/get_server_info").json()["lora_adapters"][0]["name"] == "sql"


def test_load_unload_and_bad_adapter(lora_server):
    srv, adapters, refs, root = lora_server
    url = srv.base_url
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(adapters["poet"])},
                   timeout=60)
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {"sql": str(adapters["sql"]),
                                                                    "poet": str(adapters["poet"])}
    out = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": SP, "lora_path": "poet"},
                     timeout=60).json()
    assert out["output_ids"] == refs["poet"]
    bad = root / "bad"
    bad.mkdir()
    (bad / "adapter_model.safetensors").write_bytes((adapters["sql"] / "adapter_model.safetensors").read_bytes())
    config = json.loads((adapters["sql"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)}, timeout=60)
    assert r.status_code == 400 and "adapter 'bad'" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "poet"}, timeout=60).status_code == 200
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "poet"}, timeout=60).status_code == 404
    out = httpx.post(f"{url}/generate", json={"input_ids": [PROMPT] * 2, "sampling_params": SP,
                                              "lora_path": [None, "sql"]}, timeout=60).json()
    assert [o["output_ids"] for o in out] == [refs[None], refs["sql"]]
