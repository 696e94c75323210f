"""Test helpers for Qwen3.5 (dense and MoE): Qwen3-VL's (qwen3_vl_testing.py: prompts, positions, the parity row,
fixture checks) with Qwen3.5's config: a hybrid text model (layer_types with both kinds, Gated DeltaNet heads,
partial RoPE) and a vision tower without DeepStack.

The spec: H = 64, 4 layers (linear, linear, full, linear), GQA 4/2 with head_dim 32 and RoPE on half of it
(M-RoPE section 2/3/3), linear attention with 2 key heads and 4 value heads of 16, conv kernel 4. The MoE spec
adds top-2 of 4 experts and a shared expert. The suite's prefix-cache test is left out (no prefix_cuts): it shares
K/V alone, while a hybrid prefix resumes only with the state snapshot the scheduler keeps at its end
(tests/engine/test_engine_hybrid.py checks those hits against HF).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from tests.models import qwen3_vl_testing as q3
from tests.models.fixture_checks import save_random_model

HYBRID_FIELDS = dict(
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4)
MOE_FIELDS = (("num_experts", 4), ("num_experts_per_tok", 2), ("moe_intermediate_size", 16),
              ("shared_expert_intermediate_size", 16))
SPECS = {
    "dense": q3.TinySpec("dense", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32, tie=False,
                         mrope_section=(2, 3, 3), vision_hidden=32, vision_depth=2, vision_heads=2, deepstack=(),
                         num_position_embeddings=36, seed=5),
}
SPECS["moe"] = dataclasses.replace(SPECS["dense"], name="moe", seed=6, moe=MOE_FIELDS)


def tiny_qwen3_5_config(spec: q3.TinySpec, vocab_size: int = q3.VOCAB, token_ids: dict[str, int] | None = None,
                        **special):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    ids = token_ids or {"image": q3.IMAGE_ID, "video": q3.VIDEO_ID, "start": q3.VSTART_ID, "end": q3.VEND_ID}
    special = special or dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    text = q3._text_config(spec, vocab_size, **special, **HYBRID_FIELDS, **dict(spec.moe))
    text["rope_parameters"]["partial_rotary_factor"] = 0.5
    # The gated norm divides each head's rule output by its RMS; random unit q and k score ~0.06 a pair, so
    # those outputs are ~0.02, sums of larger terms, and an eps of 1e-6 turns the vision tower's float32 noise
    # (~1e-6 in our embeddings vs HF's) into ~2e-4 in the logits. eps 1e-2 (both sides) damps that.
    text["rms_norm_eps"] = 1e-2
    vision = q3._vision_config(spec)
    del vision["deepstack_visual_indexes"]
    config_cls = Qwen3_5MoeConfig if spec.moe else Qwen3_5Config
    return config_cls(text_config=text, vision_config=vision, image_token_id=ids["image"], video_token_id=ids["video"],
                      vision_start_token_id=ids["start"], vision_end_token_id=ids["end"], tie_word_embeddings=spec.tie,
                      architectures=[config_cls.__name__.replace("Config", "ForConditionalGeneration")])


def make_hybrid_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """The hybrid decoder's fixture rules (Qwen3.5, Qwen3-Next): its RMSNorms scale by (1 + weight), so their
    weights are drawn from -0.5..0.5 (scales 0.5..1.5: activations stay text-sized, as float32 parity at 1e-4
    needs); the gated norms get random weights 0.5..1.5; the decays are moderate (below)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in hf.modules():
            kind = type(module).__name__
            if kind.endswith("RMSNormGated"):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            elif kind.endswith("RMSNorm") and kind.startswith(("Qwen3_5", "Qwen3Next")):  # not the tower's norms
                module.weight.copy_(torch.rand(module.weight.shape, generator=g) - 0.5)
            if hasattr(module, "A_log"):
                # transformers draws A from 0.01..16: decays down to exp(-20) per token wipe the state at every
                # token (an image 30 tokens back no longer matters) and leave some outputs ~1e-4, whose gated norm
                # magnifies float32 noise past the tolerance. A of 0.01..0.1 keeps ~0.95 of the state per token.
                module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.01, 0.1, generator=g).log())


def make_fixture_can_fail_(hf: torch.nn.Module, seed: int) -> None:
    """Qwen3-VL's (random norm weights and biases, text-sized mergers), then the hybrid decoder's."""
    q3.make_fixture_can_fail_(hf, seed)
    make_hybrid_can_fail_(hf, seed)



def tiny_qwen3_5_text_config(spec: q3.TinySpec):
    """The text config of tiny_qwen3_5_config, as `Qwen3_5ForCausalLM` (or its MoE sibling) saves it."""
    text = tiny_qwen3_5_config(spec).text_config
    text.architectures = ["Qwen3_5MoeForCausalLM" if spec.moe else "Qwen3_5ForCausalLM"]
    return text


def tiny_qwen3_next_config(vocab_size: int = q3.VOCAB):
    """Qwen3-Next text: 3 linear + 1 full layer, MoE layers 1 and 3 (top-2 of 4 experts and a shared expert),
    RoPE on a quarter of each head (transformers' default partial_rotary_factor)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-2, initializer_range=0.2, max_position_embeddings=512,
        **{**HYBRID_FIELDS, "linear_key_head_dim": 8, "linear_value_head_dim": 8}, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, decoder_sparse_step=2,
        norm_topk_prob=True, architectures=["Qwen3NextForCausalLM"], bos_token_id=None, eos_token_id=None,
        pad_token_id=None)


def build_tiny_qwen3_5(path: str | Path, spec: q3.TinySpec):
    import transformers

    config = tiny_qwen3_5_config(spec)
    return save_random_model(path, getattr(transformers, config.architectures[0]), config, spec.seed,
                             lambda m: make_fixture_can_fail_(m, spec.seed), "eager")


def check_state_matters(case: q3.Qwen3VLCase) -> None:
    """The linear-attention state carries the context: zeroing one request's state before its last prompt token
    moves that token's logits far beyond the tolerance (so a leaked or lost state would fail the suite)."""
    from tests.models.family_parity import ATOL
    from tests.models.paged_driver import PagedKV, make_batch

    prompt = case.prompt(q3.PROMPTS["square_image"], seed=1)
    n = len(prompt.input_ids)
    kv = PagedKV(case.ours.lm_config, max_context_len=512)
    row = kv.new_request()
    with torch.inference_mode():
        case.ours(make_batch(kv, [case.extend_step(row, prompt, 0, n - 1)]), kv.pool)
        whole = case.ours(make_batch(kv, [case.extend_step(row, prompt, n - 1, n)]), kv.pool)
    assert kv.pool.state is not None and kv.pool.state.recurrent[:, row].abs().sum() > 0
    torch.testing.assert_close(whole[-1], case.hf_logits(prompt)[-1], atol=ATOL, rtol=0)
    kv2 = PagedKV(case.ours.lm_config, max_context_len=512)
    row2 = kv2.new_request()
    with torch.inference_mode():
        case.ours(make_batch(kv2, [case.extend_step(row2, prompt, 0, n - 1)]), kv2.pool)
        kv2.pool.state.reset(torch.tensor([row2]))
        lost = case.ours(make_batch(kv2, [case.extend_step(row2, prompt, n - 1, n)]), kv2.pool)
    assert (lost - whole).abs().max() > 100 * ATOL


def load_case(name: str, path: Path) -> q3.Qwen3VLCase:
    from tessera.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    case, config = q3.Qwen3VLCase.load(SPECS[name], path, build_tiny_qwen3_5, Qwen3_5ForConditionalGeneration)
    assert config.mrope_section == case.spec.mrope_section and case.ours.num_deepstack_levels == 0
    case.check_fixture_can_fail(q3.DECODE_PROMPT, lambda p: q3.hf_generate_masked(case.hf, p.hf_inputs(), 8))
    check_state_matters(case)
    return case


# Qwen3-VL's row with fewer prompts (the layouts Qwen3-VL's suite covers; kept to the suite's time budget) and the
# chunked prefill at one page size (the state does not depend on pages).
FIXTURE = dataclasses.replace(
    q3.FIXTURE, specs=("dense",), load_case=load_case, bytes_spec="dense", prefix_cuts={}, checks={},
    prompts={k: q3.PROMPTS[k] for k in ("text", "nonsquare_image", "two_images", "image_and_video")},
    chunked=q3.FIXTURE.chunked[1:],
    build=lambda path, name: build_tiny_qwen3_5(path, SPECS[name]))


def tiny_qwen3_5_processor_and_config(spec_name: str = "dense") -> tuple[Any, Any]:
    """(q3.tiny_qwen3_vl_processor_and_config's processor over the demo-vl tokenizer, a Qwen3.5 config with its
    token ids)."""
    processor, vl = q3.tiny_qwen3_vl_processor_and_config(q3.CHECKPOINT_SPEC)
    text = vl.text_config
    config = tiny_qwen3_5_config(
        SPECS[spec_name], vocab_size=text.vocab_size,
        token_ids={"image": vl.image_token_id, "video": vl.video_token_id, "start": vl.vision_start_token_id,
                   "end": vl.vision_end_token_id},
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id)
    return processor, config


def make_tiny_qwen3_5_checkpoint(path: str | Path, spec_name: str = "dense") -> Path:
    """A complete random Qwen3.5 checkpoint directory: q3.make_tiny_qwen3_vl_checkpoint's tokenizer, chat template
    and processor with a Qwen3.5 config over them."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = SPECS[spec_name]
    processor, config = tiny_qwen3_5_processor_and_config(spec_name)
    processor.save_pretrained(path)
    text = config.text_config
    save_random_model(path, getattr(transformers, config.architectures[0]), config, spec.seed,
                      lambda m: make_fixture_can_fail_(m, spec.seed), None, text.eos_token_id, text.pad_token_id)
    return path
