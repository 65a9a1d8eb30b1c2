"""The Qwen3.5 target (hybrid: gated delta rule layers between gated full-attention ones) against transformers'
Qwen3_5ForCausalLM (fp32) on tiny random configs: logits and captured layers, steps of any width, a verify block's
rejected tokens rolled back out of the recurrent state, the multimodal checkpoint's language model; DFlash on top
stays lossless, token for token against transformers' greedy and in distribution when sampling."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM as HFQwen3_5
from transformers import Qwen3_5TextConfig

from dflash_trt import SamplingParams
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.layers.attention import AttentionMetadata
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.qwen3_5 import Qwen3_5ForCausalLM
from dflash_trt.models.registry import load_target
from tests.conftest import EOS, VOCAB, make_drafter, needs_bf16_kernels, save_tiny_model
from tests.forced_drafts import force_drafts, force_tree_drafts
from tests.models.helpers import meta, sample_prompts, spec_engine
from tests.stats import assert_matches

TOL = 1e-4  # fp32
HIDDEN = 64
NEW = 24


def make_qwen3_5(path: Path, seed: int = 0, vocab: int = VOCAB, **overrides) -> Path:
    """A random Qwen3.5 language model saved by transformers: three linear-attention layers, then a full-attention one
    (its default pattern), value heads twice the key heads; its norms away from their initial values."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=256, eos_token_id=EOS,
              bos_token_id=1, tie_word_embeddings=False)
    kw.update(overrides)
    return _saved(HFQwen3_5(Qwen3_5TextConfig(**kw)).eval(), path, vocab)


def _saved(model, path: Path, vocab: int) -> Path:
    """model saved with its norms away from their initial values (a missing norm shows) and a sharper head."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.8, 1.2)
            elif "norm" in name:  # zero-centred: the scale is 1 + weight
                p.uniform_(-0.3, 0.3)
    return save_tiny_model(model, path, vocab)


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory) -> Path:
    return make_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "t")


@pytest.fixture(scope="module")
def hf_model(q35_dir):
    return HFQwen3_5.from_pretrained(q35_dir).eval()


@pytest.mark.parametrize("config", [
    {},
    {"layer_types": ["full_attention", "linear_attention", "full_attention", "linear_attention"],
     "linear_num_value_heads": 2, "attention_bias": True},
    {"num_hidden_layers": 6, "full_attention_interval": 3, "linear_conv_kernel_dim": 3},
], ids=["every 4th full", "alternating, biased attention, as many value as key heads", "every 3rd full, kernel 3"])
def test_logits_and_captured_layers_equal_transformers(tmp_path, config):
    d = make_qwen3_5(tmp_path / "t", **config)
    hf = HFQwen3_5.from_pretrained(d).eval()
    ours = load_target(d)
    assert isinstance(ours, Qwen3_5ForCausalLM)
    assert list(ours.params.layer_types) == hf.config.layer_types
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        hidden, feats = ours(ids, meta(ids), ours.make_cache(2, 32), capture_layer_ids=(1, 3))
        logits = ours.compute_logits(hidden)
    assert (logits - ref.logits).abs().max() < TOL
    assert (feats[..., :HIDDEN] - ref.hidden_states[2]).abs().max() < TOL
    assert (feats[..., HIDDEN:] - ref.hidden_states[4]).abs().max() < TOL


def test_a_config_that_leaves_out_the_rotated_fraction_rotates_a_quarter_as_transformers(q35_dir, hf_model, tmp_path):
    d = Path(shutil.copytree(q35_dir, tmp_path / "t"))
    raw = json.loads((d / "config.json").read_text())
    assert raw["rope_parameters"].pop("partial_rotary_factor") == 0.25
    raw.pop("partial_rotary_factor", None)
    (d / "config.json").write_text(json.dumps(raw))
    ids = torch.randint(0, VOCAB, (1, 30))
    ours = load_target(d)
    with torch.no_grad():  # (transformers' config takes 0.25 where the key is missing)
        got = ours.compute_logits(ours(ids, meta(ids), ours.make_cache(1, 32))[0])
        assert (got - HFQwen3_5.from_pretrained(d).eval()(ids).logits).abs().max() < TOL


def test_steps_of_any_width_continue_the_recurrent_state(q35_dir, hf_model):
    ours = load_target(q35_dir)
    ours.pack_for_inference()
    ids = torch.randint(0, VOCAB, (2, 33))
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = ours.make_cache(2, 40, queries=8)
        parts = [ours.compute_logits(ours(ids[:, :12], meta(ids[:, :12]), cache)[0])]
        for a, b in ((12, 13), (13, 20), (20, 21), (21, 28), (28, 33)):
            parts.append(ours.compute_logits(ours(ids[:, a:b], meta(ids[:, a:b], a), cache)[0]))
    assert (torch.cat(parts, 1) - ref).abs().max() < TOL


def test_a_long_prompt_taken_in_by_chunks_then_steps_equals_transformers(q35_dir, hf_model):
    """Rows of 200 and 150 prompt tokens, each alone: the first 168 and 118 by chunks (all but the last 32), the rest
    token by token; then steps continue from the states kept."""
    ours = load_target(q35_dir)
    ids = torch.randint(0, VOCAB, (2, 206))
    lens = [200, 150]
    with torch.no_grad():
        cache = ours.make_cache(2, 216, queries=8)
        rows = torch.arange(2)
        for i, n in enumerate(lens):  # each row alone: its chunked part is its own length's
            meta = AttentionMetadata.causal_step(rows[i:i + 1], torch.arange(n)[None])
            hidden = ours(ids[i:i + 1, :n], meta, cache)[0]
            assert (ours.compute_logits(hidden) - hf_model(ids[i:i + 1, :n]).logits).abs().max() < TOL
        starts = torch.tensor(lens)[:, None]
        step = torch.stack([ids[0, 200:206], ids[1, 150:156]])
        logits = ours.compute_logits(ours(step, AttentionMetadata.causal_step(rows, starts + torch.arange(6)),
                                          cache)[0])
        assert (logits[0] - hf_model(ids[:1, :206]).logits[0, 200:]).abs().max() < TOL
        assert (logits[1] - hf_model(ids[1:, :156]).logits[0, 150:]).abs().max() < TOL


@pytest.mark.parametrize("accepted", [0, 3, 6])
def test_a_verify_blocks_rejected_tokens_leave_the_recurrent_state(q35_dir, hf_model, accepted):
    """A block of 7 whose tokens after `accepted` are wrong: the next step, from the first wrong position, sees the
    state the right tokens leave (the wrong ones were taken in, then dropped)."""
    ours = load_target(q35_dir)
    ids = torch.randint(3, VOCAB, (2, 30))
    block = ids[:, 12:19].clone()
    block[:, accepted + 1:] = (block[:, accepted + 1:] + 1) % VOCAB
    nxt = 12 + accepted + 1
    with torch.no_grad():
        ref = hf_model(ids).logits
        cache = ours.make_cache(2, 40, queries=7)
        ours(ids[:, :12], meta(ids[:, :12]), cache)
        ours(block, meta(block, 12), cache)
        logits = ours.compute_logits(ours(ids[:, nxt:nxt + 5], meta(ids[:, nxt:nxt + 5], nxt), cache)[0])
    assert (logits - ref[:, nxt:nxt + 5]).abs().max() < TOL


def test_a_step_from_a_position_no_state_is_held_after_is_refused(q35_dir):
    ours = load_target(q35_dir)
    ids = torch.randint(3, VOCAB, (1, 20))
    cache = ours.make_cache(1, 40, queries=4)
    with torch.no_grad():
        ours(ids[:, :12], meta(ids[:, :12]), cache)
        with pytest.raises(RuntimeError, match=r"row 0: .* no state after position 4 \(it holds positions 8..11, and "
                                               r"marks at \[\]\)"):
            ours(ids[:, 5:8], meta(ids[:, 5:8], 5), cache)


def test_the_multimodal_checkpoints_language_model_is_read(q35_dir, hf_model, tmp_path, caplog):
    """Qwen3.5's published checkpoints (Qwen3_5ForConditionalGeneration): the language model's keys under
    text_config, its tensors under model.language_model., a vision tower and a multi-token prediction head beside
    it (not read, and not warned of)."""
    d = tmp_path / "vl"
    d.mkdir()
    text = json.loads((q35_dir / "config.json").read_text())
    eos = text.pop("eos_token_id")
    text.pop("architectures")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "eos_token_id": eos,
        "tie_word_embeddings": False, "text_config": text, "vision_config": {"depth": 1, "hidden_size": 32}}))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(q35_dir / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(32, 3, 2, 16, 16)
    tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.zeros(96, HIDDEN)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    ours = load_target(d)
    assert ours.config.eos_token_ids == (EOS,) and ours.config.num_hidden_layers == 4
    assert "not used" not in caplog.text
    ids = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        logits = ours.compute_logits(ours(ids, meta(ids), ours.make_cache(1, 20))[0])
        assert (logits - hf_model(ids).logits).abs().max() < TOL


@pytest.mark.parametrize("change, says", [
    ({"layer_types": ["linear_attention", "mamba", "linear_attention", "full_attention"]}, r"layer_types \['mamba'\]"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    ({"full_attention_interval": 0, "layer_types": None}, "'full_attention_interval' must be >= 1"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported")])
def test_malformed_hybrid_keys_are_refused_naming_them(q35_dir, tmp_path, change, says):
    d = tmp_path / "t"
    d.mkdir()
    cfg = json.loads((q35_dir / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    (d / "model.safetensors").symlink_to(q35_dir / "model.safetensors")
    with pytest.raises(ValueError, match=says) as raised:
        load_target(d)
    assert str(d / "config.json") in str(raised.value)


def make_qwen3_5_moe(path: Path, seed: int = 0, **overrides) -> Path:
    """A random Qwen3.5-MoE language model saved by transformers: 8 experts, top-2, a shared expert; its router's
    logits far from ties."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=256,
              eos_token_id=EOS, bos_token_id=1, tie_word_embeddings=False)
    kw.update(overrides)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or "experts" in name:
                p.normal_(0, 0.5 if name.endswith("gate.weight") else 0.1)
    return _saved(model, path, VOCAB)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return make_qwen3_5_moe(tmp_path_factory.mktemp("qwen3_5_moe") / "t")


def test_the_moe_models_logits_equal_transformers_in_either_expert_layout(moe_dir, tmp_path):
    """Qwen3.5-MoE: routed experts (top 2 of 8, renormalised) and a gated shared expert on every layer; its experts
    each their own, as Qwen's checkpoints and transformers save them, or stacked, as transformers holds them."""
    from transformers import Qwen3_5MoeForCausalLM as HFMoe

    hf = HFMoe.from_pretrained(moe_dir).eval()
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        ref = hf(ids).logits
    tensors = load_file(moe_dir / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in tensors
    for i in range(4):
        m = f"model.layers.{i}.mlp.experts."
        tensors[m + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{m}{e}.gate_proj.weight"),
                                                              tensors.pop(f"{m}{e}.up_proj.weight")])
                                                   for e in range(8)])
        tensors[m + "down_proj"] = torch.stack([tensors.pop(f"{m}{e}.down_proj.weight") for e in range(8)])
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    (stacked / "config.json").write_bytes((moe_dir / "config.json").read_bytes())
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    for d in (moe_dir, stacked):
        ours = load_target(d)
        ours.pack_for_inference()
        with torch.no_grad():
            logits = ours.compute_logits(ours(ids, meta(ids), ours.make_cache(2, 32))[0])
        assert (logits - ref).abs().max() < TOL


def test_the_moe_models_greedy_speculative_output_equals_transformers(moe_dir, tmp_path):
    from transformers import Qwen3_5MoeForCausalLM as HFMoe

    hf = HFMoe.from_pretrained(moe_dir).eval()
    drafter = make_drafter(tmp_path / "d", moe_dir, layers=1, block_size=8, target_layer_ids=(0, 2, 3))
    prompts = sample_prompts(4)
    refs = _greedy_refs(hf, prompts)
    engine = _engine(moe_dir, drafter, 7, 4)
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.15)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs and max(max(o.acceptance_lengths) for o in outs) >= 4


# --- DFlash on top ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q35_drafter(q35_dir, tmp_path_factory) -> Path:
    return make_drafter(tmp_path_factory.mktemp("qwen3_5_drafter") / "d", q35_dir, layers=1, block_size=8,
                        target_layer_ids=(0, 2, 3))


def _engine(target_dir, drafter_dir, k, rows, dtype=torch.float32, **cfg):
    return spec_engine(target_dir, drafter_dir, k, rows, dtype, max_model_len=224, **cfg)


def _greedy_refs(hf_model, prompts):
    return [hf_model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_transformers_greedy(q35_dir, q35_drafter, hf_model, batch):
    prompts = sample_prompts(batch)
    refs = _greedy_refs(hf_model, prompts)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in _engine(q35_dir, q35_drafter, 7, batch).generate(prompts, params)] == refs
    engine = _engine(q35_dir, q35_drafter, 7, batch)  # mostly-right drafts: long acceptances and rollbacks
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.15)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs and max(max(o.acceptance_lengths) for o in outs) >= 4


def test_chunked_prompts_and_shared_chunks_stay_exact(q35_dir, q35_drafter, hf_model):
    """Prompts in chunks of 16 (padded in their forwards) and one prompt twice (the second copies the chunks the first
    computes, with their states): every answer is transformers' greedy one."""
    long = sample_prompts(4)[3] + sample_prompts(4)[1]
    prompts = [long, long, sample_prompts(4)[2]]
    refs = _greedy_refs(hf_model, prompts)
    engine = _engine(q35_dir, q35_drafter, 7, 4, prefill_chunk=16)
    assert engine.scheduler.config.holds_prefix == engine.runner.target_cache.holds_prefix
    copied = []
    real_copy = engine.runner.target_cache.copy_rows
    engine.runner.target_cache.copy_rows = lambda *a: copied.append(a[2:]) or real_copy(*a)
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.2)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs and copied == [(0, 16), (16, 32), (32, 47)]


@pytest.mark.parametrize("batch, nodes", [(1, 6), (4, 12)])
def test_greedy_draft_trees_equal_transformers_greedy(q35_dir, q35_drafter, hf_model, batch, nodes):
    """Draft trees whose accepted paths run off the first nodes (forced: the true token ranked 0-3 or absent): each
    node's state continues its parent's, and the accepted path's states line up by depth for the next step."""
    prompts = sample_prompts(batch)
    refs = _greedy_refs(hf_model, prompts)
    engine = _engine(q35_dir, q35_drafter, 7, batch, draft_tree={batch: nodes})
    force_tree_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})
    moved = []
    real_move = engine.runner.target_cache.move
    engine.runner.target_cache.move = lambda moves: moved.extend(moves) or real_move(moves)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert moved and max(max(o.acceptance_lengths) for o in outs) >= 3


def test_a_draft_tree_past_the_states_a_row_keeps_is_refused(q35_dir, q35_drafter):
    with pytest.raises(ValueError, match="a step of 41 queries a row .* draft trees of at most 31 nodes"):
        _engine(q35_dir, q35_drafter, 7, 1, draft_tree={1: 40})


def test_a_chats_next_turn_takes_over_its_last_turns_prompt_with_the_state_after_it(q35_dir, q35_drafter, hf_model):
    """Turn 1 (40 prompt tokens, chunks of 16) marks the state after each chunk; turn 2 (turn 1's prompt, its answer
    and more: 81 tokens) takes over 32 of them in the freed row and starts from the mark after position 31; a request
    sharing turn 2's first 64 tokens, sent while turn 2 runs, copies them and the mark after them from turn 2's row,
    whose marks are its last two chunks' and the two roundest before them (those after positions 15 and 47 gone).
    Every answer is transformers' greedy one."""
    engine = _engine(q35_dir, q35_drafter, 7, 2, prefill_chunk=16)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = (sample_prompts(4)[3] * 2)[:40]
    answer = engine.generate([first], params)[0]
    assert answer.token_ids == _greedy_refs(hf_model, [first])[0]
    second = first + answer.token_ids + sample_prompts(4)[1]
    other = second[:64] + sample_prompts(4, seed=9)[3]
    refs = _greedy_refs(hf_model, [second, other])
    marks = engine.runner.target_cache.linear[0].marks
    assert 31 in marks[0] and 15 in marks[0]
    turn = engine.add_request(second, params)
    engine.step()  # turn 2 admitted into row 0, taking over 32 positions
    sharing = engine.add_request(other, params)
    while not (turn.is_finished and sharing.is_finished):
        engine.step()
    outs = [engine.make_output(s) for s in (turn, sharing)]
    assert [o.token_ids for o in outs] == refs
    assert [o.num_cached_tokens for o in outs] == [32, 64]
    assert sorted(marks[0]) == [31, 63, 79, 80]


def test_a_shared_prefix_keeps_a_mark_half_way_into_it_however_long_the_prompts_after_it(q35_dir, hf_model):
    """A system prompt of 70 tokens under a 60-token question (chunks of 16: 9 marked in turn) keeps the mark after
    its 64th position (the roundest chunk end), not only the last four chunks': the next request, the same system
    prompt under another question, takes over 64 positions. Every answer is transformers' greedy one."""
    engine = LLMEngine(load_target(q35_dir, torch.float32), None, None,
                       EngineConfig(max_batch_size=1, max_model_len=224, speculative=False, prefill_chunk=16))
    g = torch.Generator().manual_seed(4)
    system, first, second = (torch.randint(3, 90, (n,), generator=g).tolist() for n in (70, 60, 30))
    prompts = [system + first, system + second]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    outs = [engine.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in outs] == _greedy_refs(hf_model, prompts)
    assert [o.num_cached_tokens for o in outs] == [0, 64]


def test_a_request_takes_no_prefix_over_from_a_row_whose_own_copy_has_not_landed(q35_dir, hf_model):
    """B copies 96 prompt positions from running X into a row whose last occupant marked its state after 47; C,
    admitted in the same step, shares 48 positions with X, which marked its state after 31, not 47: C must take 32
    over from X (B's row holds none of X's prompt before B's copy lands, and no more than X after it), not read the
    old occupant's mark. Every answer is transformers' greedy one."""
    target = load_target(q35_dir, torch.float32)
    engine = LLMEngine(target, None, None, EngineConfig(max_batch_size=3, max_model_len=224, speculative=False,
                                                         prefill_chunk=16))
    g = torch.Generator().manual_seed(3)
    tokens = lambda n: torch.randint(3, 90, (n,), generator=g).tolist()  # noqa: E731
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine.generate([tokens(56), tokens(56)], SamplingParams(max_new_tokens=2, ignore_eos=True))
    marks = engine.runner.target_cache.linear[0].marks
    x = tokens(101)
    running = engine.add_request(x, params)
    engine.step()  # X prefilled in the third row
    assert sorted(marks[running.slot]) == [31, 63, 95, 100] and all(47 in marks[r] for r in (0, 1))
    prompts = [x[:96] + tokens(10), x[:48] + tokens(20)]
    seqs = [engine.add_request(p, params) for p in prompts]
    while not all(s.is_finished for s in (running, *seqs)):
        engine.step()
    assert [engine.make_output(s).token_ids for s in (running, *seqs)] == _greedy_refs(hf_model, [x, *prompts])
    assert [s.num_reused for s in seqs] == [96, 32]


def test_a_request_whose_state_a_failed_step_moved_on_finishes_with_error_and_the_engine_steps_on(q35_dir,
                                                                                                 hf_model):
    """A step that fails after the target's forward (an error in sampling, say) has moved the rows' recurrent states
    past what they accepted: their requests cannot be continued. They finish with "error" (a K/V target's would be
    retried), and the engine goes on serving: a later request's answer is transformers' greedy one."""
    engine = LLMEngine(load_target(q35_dir, torch.float32), None, None,
                       EngineConfig(max_batch_size=2, max_model_len=224, speculative=False))
    prompts = sample_prompts(4)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    running = engine.add_request(prompts[3], params)
    for _ in range(3):
        engine.step()
    real = engine.runner._note_logprobs

    def fail(*args):  # after the target forward
        engine.runner._note_logprobs = real
        raise MemoryError("after the target forward")
    engine.runner._note_logprobs = fail
    with pytest.raises(MemoryError):
        engine.step()
    later = engine.add_request(prompts[1], params)
    while not later.is_finished:
        engine.step()
    assert running.finish_reason == "error"
    assert engine.make_output(later).token_ids == _greedy_refs(hf_model, [prompts[1]])[0]


@pytest.mark.parametrize("rule, tree", [("match", None), ("rejection", None), ("match", 5)],
                         ids=["match chain", "rejection chain", "match tree of 5"])
def test_sampled_output_follows_the_target_distribution(tmp_path, rule, tree):
    """Four tokens over a four-token vocabulary (256 outcomes, enumerated by transformers) sampled 3,000 times with
    K=3, chains or trees: speculative samples follow the target's joint distribution."""
    t = make_qwen3_5(tmp_path / "t", seed=11, vocab=4)
    d = make_drafter(tmp_path / "d", t, block_size=8, target_layer_ids=(1, 3), seed=12)
    prompt = [1, 3, 0, 2, 1]
    hf = HFQwen3_5.from_pretrained(t).eval()
    import itertools

    seqs = list(itertools.product(range(4), repeat=4))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        probs = torch.softmax(hf(ids).logits[:, len(prompt) - 1:-1] / 1.5, dim=-1)
    picked = probs.gather(-1, ids[:, len(prompt):, None])[..., 0].prod(-1)
    expected = {s: float(p) for s, p in zip(seqs, picked)}
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config), EngineConfig(
        max_batch_size=1000, max_draft_len=3, **({"draft_tree": {1000: tree}} if tree else {})))
    n = 3000
    params = [SamplingParams(max_new_tokens=4, temperature=1.5, seed=s, acceptance=rule, ignore_eos=True)
              for s in range(n)]
    outs = engine.generate([prompt] * n, params)
    assert sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs) > n / 10  # drafts accepted
    assert_matches([tuple(o.token_ids) for o in outs], expected)


@needs_bf16_kernels
@pytest.mark.parametrize("temperature, tree", [(0.0, None), (1.0, None), (0.0, 10)],
                         ids=["greedy", "sampled", "greedy tree of 10"])
def test_bf16_speculative_equals_bf16_plain_decoding(q35_dir, q35_drafter, temperature, tree):
    """In bf16 the oracle is the same runtime decoding one token a step: verify blocks of forced, mostly-right drafts
    give the same tokens (greedy, and seeded samples under the "match" rule); the delta rule takes a block's tokens
    one by one, as one-token steps do."""
    prompts = sample_prompts(4)
    prompts[3] = (prompts[3] * 6)[:170]  # taken in partly by chunks
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=temperature, seed=i) for i in range(4)]
    plain = LLMEngine(load_target(q35_dir, torch.bfloat16), None, None, EngineConfig(
        max_batch_size=4, max_model_len=224, dtype="bfloat16", speculative=False)).generate(prompts, params)
    engine = _engine(q35_dir, q35_drafter, 7, 4, torch.bfloat16, **({"draft_tree": {4: tree}} if tree else {}))
    truth = {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    if tree:
        force_tree_drafts(engine, truth)
    else:
        force_drafts(engine, truth, error_rate=0.15)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] and all(o.tau > 1.5 for o in outs)
