"""The real embedded default (SmolLM2-135M-Instruct, Llama architecture, from the packaged GGUF)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_trt import SamplingParams
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from tests.conftest import make_drafter

PROMPTS = ["What is the capital of France?", "Write a haiku about autumn.", "List three primes."]


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir).eval(), AutoTokenizer.from_pretrained(smollm2_dir)


def _chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_logits_equal_transformers_on_the_real_weights(smollm2_dir, hf_smollm2):
    hf, tok = hf_smollm2
    ours = load_target(smollm2_dir)
    assert ours.config.num_hidden_layers == 30 and ours.config.hidden_size == 576
    ids = torch.tensor([_chat_ids(tok, PROMPTS[0])])
    n = ids.shape[1]
    with torch.no_grad():
        want = hf(ids).logits
        meta = AttentionMetadata.causal_step(torch.tensor([0]), torch.arange(n)[None])
        got = ours.compute_logits(ours(ids, meta, ours.make_cache(1, n))[0])
    # fp32 tolerance 1e-3 on logits of magnitude ~40; observed max |diff| 0.0
    assert (got - want).abs().max() < 1e-3


def test_greedy_speculative_equals_target_greedy_on_real_prompts(smollm2_dir, hf_smollm2, tmp_path):
    hf, tok = hf_smollm2
    target = load_target(smollm2_dir)
    d = make_drafter(tmp_path / "d", smollm2_dir, layers=1, block_size=8, target_layer_ids=(15,),
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, mask_token_id=49151)
    engine = LLMEngine(target, tok, load_drafter(d, target.config), EngineConfig(max_batch_size=3, max_draft_len=7))
    prompts = [_chat_ids(tok, p) for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == ref
    assert "Paris" in outs[0].text


def test_stop_strings_cut_the_text(smollm2_dir, hf_smollm2):
    _, tok = hf_smollm2
    engine = LLMEngine(load_target(smollm2_dir), tok, None, EngineConfig(max_batch_size=1, speculative=False))
    full = engine.generate([_chat_ids(tok, PROMPTS[0])], SamplingParams(max_new_tokens=16))[0]
    assert "Paris" in full.text
    cut = engine.generate([_chat_ids(tok, PROMPTS[0])], SamplingParams(max_new_tokens=16, stop=["Paris"]))[0]
    assert cut.finish_reason == "stop" and "Paris" not in cut.text and full.text.startswith(cut.text)
