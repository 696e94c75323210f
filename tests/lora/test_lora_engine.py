"""Multi-LoRA through the Engine: greedy tokens identical to HF transformers + PEFT (PeftModel.from_pretrained)
for each adapter, with three adapters and the base model mixed in one batch, over fewer slots than adapters
(evictions), chunked prefill and the radix cache (an adapter never reuses another's KV); adapters loaded and
unloaded at run time; bad adapters refused while the engine keeps serving."""

from __future__ import annotations

import pytest

from tessera import Engine
from tessera.frontend.lora_registry import AdapterOpFailed
from tests.lora.lora_testing import ALL_LINEARS, make_adapter, make_text_checkpoint, peft_greedy

MAX_NEW = 8
PROMPTS = [[5, 17, 33, 100, 200, 7, 9], [41, 42, 43, 300, 12, 19, 250, 251, 3], [8, 99, 140, 12]]
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def qwen2_adapters(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lora-qwen2")
    base = make_text_checkpoint(root / "base", "qwen2")
    hf = transformers.Qwen2ForCausalLM.from_pretrained(base)
    adapters = {
        "all": make_adapter(hf, root / "all", seed=1, targets=ALL_LINEARS),
        # rsLoRA, a per-module rank and alpha (PEFT's rank_pattern / alpha_pattern), attention only
        "attn": make_adapter(hf, root / "attn", seed=2, r=8, alpha=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                             use_rslora=True, rank_pattern={"layers.1.self_attn.q_proj": 2},
                             alpha_pattern={"v_proj": 12}),
        "mlp": make_adapter(hf, root / "mlp", seed=3, r=2, alpha=16, targets=["gate_proj", "up_proj", "down_proj"]),
        "late": make_adapter(hf, root / "late", seed=4, r=4, targets=["o_proj", "down_proj"]),
    }
    refs = {(name, i): peft_greedy(base, transformers.Qwen2ForCausalLM, adapters.get(name), ids, MAX_NEW)
            for name in (*adapters, None) for i, ids in enumerate(PROMPTS)}
    return base, adapters, refs


@pytest.fixture(scope="module")
def engine(qwen2_adapters):
    base, adapters, _ = qwen2_adapters
    paths = [f"{n}={adapters[n]}" for n in ("all", "attn")] + [str(adapters["mlp"])]  # a bare path: named "mlp"
    with Engine(str(base), lora_paths=paths, max_loras_per_batch=2, max_lora_rank=8, chunked_prefill_size=6,
                page_size=2, max_total_tokens=2048, show_progress=False) as e:
        yield e


def test_mixed_batch_matches_peft_per_adapter(engine, qwen2_adapters):
    _, _, refs = qwen2_adapters
    assert all(refs[(n, 0)] != refs[(None, 0)] for n in ("all", "attn", "mlp"))  # each adapter changes the output
    # Every prompt under every adapter and the base, in one call: three adapters over two slots, so the
    # scheduler holds some back and evicts; the same prompt under several adapters shares no KV.
    cases = [(name, i) for i in range(len(PROMPTS)) for name in ("all", "attn", "mlp", None)]
    outs = engine.generate(input_ids=[PROMPTS[i] for _, i in cases], sampling_params=SP,
                           lora_path=[name for name, _ in cases])
    assert [o["output_ids"] for o in outs] == [refs[c] for c in cases]
    # Each again alone (now from the radix cache, keyed by its adapter).
    for name in ("attn", None, "mlp"):
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=SP, lora_path=name)
        assert out["output_ids"] == refs[(name, 0)]
        assert out["meta_info"]["cached_tokens"] > 0
    info = engine.get_server_info()
    assert [a["name"] for a in info["lora_adapters"]] == ["all", "attn", "mlp"]
    assert info["effective"]["lora_backend"]


def test_load_unload_and_bad_adapters_keep_serving(engine, qwen2_adapters, tmp_path):
    import json

    _, adapters, refs = qwen2_adapters
    with pytest.raises(ValueError, match="lora_path: adapter 'late' is not loaded"):
        engine.generate(input_ids=PROMPTS[1], sampling_params=SP, lora_path="late")
    engine.load_lora_adapter("late", str(adapters["late"]))
    assert engine.generate(input_ids=PROMPTS[1], sampling_params=SP, lora_path="late")["output_ids"] == \
        refs[("late", 1)]
    # Refused, each with one line naming it: a missing directory, DoRA, a rank above --max-lora-rank, wrong shapes.
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        (dora / f).write_bytes((adapters["late"] / f).read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterOpFailed, match="DoRA"):
        engine.load_lora_adapter("dora", str(dora))
    with pytest.raises(AdapterOpFailed, match="not a directory"):
        engine.load_lora_adapter("missing", str(tmp_path / "nowhere"))
    (dora / "adapter_config.json").write_text(json.dumps({**config, "r": 16, "lora_alpha": 16}))
    with pytest.raises(AdapterOpFailed, match="want \\[16"):
        engine.load_lora_adapter("shapes", str(dora))
    with pytest.raises(AdapterOpFailed, match="already loaded"):
        engine.load_lora_adapter("late", str(adapters["late"]))
    engine.unload_lora_adapter("late")
    with pytest.raises(ValueError, match="'late' is not loaded"):
        engine.generate(input_ids=PROMPTS[1], sampling_params=SP, lora_path="late")
    # Still serving, base and adapters alike.
    outs = engine.generate(input_ids=[PROMPTS[2]] * 2, sampling_params=SP, lora_path=[None, "all"])
    assert [o["output_ids"] for o in outs] == [refs[(None, 2)], refs[("all", 2)]]
