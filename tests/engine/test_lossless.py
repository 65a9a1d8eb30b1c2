"""The contract: speculative output equals the target's own output (greedy: token for token;
sampling: in distribution), on every path: batch 1 and ragged batches, every K, both acceptance rules."""

import itertools
import logging
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_trt import SamplingParams
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.kernels import cpu_ops
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.spec.context_lookup import ContextLookup
from dflash_trt.spec.draft_vocab import rank_tokens
from tests.conftest import bf16_kernels_serve, make_drafter, make_target, needs_bf16_kernels
from tests.engine.conftest import V
from tests.forced_drafts import force_drafts, force_lookup_drafts, force_tree_drafts
from tests.forward_widths import record_forward_widths
from tests.stats import assert_matches

NEW = 40
_refs: dict = {}


def _prompts(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (length,), generator=g).tolist() for length in (5, 17, 9, 30)[:n]]


def hf_model(target_dir):
    """transformers' model of the target (the oracle), loaded once."""
    if str(target_dir) not in _refs:
        _refs[str(target_dir)] = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    return _refs[str(target_dir)]


def hf_greedy(target_dir, prompt, new=NEW, eos=None):
    """transformers' own greedy continuation (the oracle)."""
    key = (str(target_dir), tuple(prompt), new, eos)
    if key not in _refs:
        hf = hf_model(target_dir)
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)
        _refs[key] = out[0, len(prompt):].tolist()
    return _refs[key]


def _engine(tiny_dirs, arch, k, rows=4, **cfg):
    config = EngineConfig(max_batch_size=rows, max_draft_len=k, **cfg)
    target = load_target(tiny_dirs[arch], config.torch_dtype)
    drafter = load_drafter(tiny_dirs[f"{arch}_drafter"], target.config, config.torch_dtype)
    return LLMEngine(target, None, drafter, config)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_target_greedy(tiny_dirs, arch, k, batch):
    prompts = _prompts(batch)
    outs = _engine(tiny_dirs, arch, k, rows=batch).generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_dirs[arch], p)
        assert sum(o.acceptance_lengths) == NEW - 1  # every token after the first came from a verify step


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
def test_greedy_is_lossless_when_most_drafts_are_accepted(tiny_dirs, arch, k):
    """The random tiny drafters accept almost nothing (the test above runs the every-draft-rejected path: a bonus
    taken one place off after two accepted drafts passed it), so here drafts carry the true continuation."""
    prompts = _prompts(4)
    refs = [hf_greedy(tiny_dirs[arch], p) for p in prompts]
    engine = _engine(tiny_dirs, arch, k)
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.08)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.tau > min(2.0, 1.5 * k)  # drafts accepted, many times
        if k > 1:
            assert any(1 < a < k + 1 for a in o.acceptance_lengths)  # rollback after partial acceptance
    if k <= 7:  # 16 tokens at once seldom pass the 8% corruption and fit what the answers have left
        assert k + 1 in [a for o in outs for a in o.acceptance_lengths]  # whole blocks, with their bonus


def _recorded_moves(engine) -> list:
    """Wrap the target cache's move (a draft tree's accepted path off the chain of top tokens) to record its calls."""
    cache, moves = engine.runner.target_cache, []
    real = cache.move

    def move(m):
        moves.extend(m)
        real(m)

    cache.move = move
    return moves


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("k, nodes, batch", [(3, 4, 1), (3, 6, 4), (7, 7, 2), (2, 5, 1)])
def test_greedy_draft_trees_equal_target_greedy(tiny_dirs, arch, k, nodes, batch):
    """Draft trees (spec/draft_tree.py) with drafts that put the true token at rank 0-3 of a slot or nowhere: paths
    are accepted deep, off the chain of top tokens (whose K/V then move) and not at all; every token is transformers'
    greedy token."""
    prompts = _prompts(batch)
    refs = [hf_greedy(tiny_dirs[arch], p) for p in prompts]
    engine = _engine(tiny_dirs, arch, k, rows=batch, draft_tree={batch: nodes})
    force_tree_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})
    moves = _recorded_moves(engine)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.tau > 1.5 and max(o.draft_lens) == nodes
    assert moves


def _recorded_lookups(monkeypatch) -> list:
    """Record every (verified, accepted) depth the engine reports to a request's context lookup."""
    seen = []
    real = ContextLookup.observe

    def observe(self, verified, accepted):
        seen.append((verified, accepted))
        real(self, verified, accepted)

    monkeypatch.setattr(ContextLookup, "observe", observe)
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("k, nodes, lookup, batch", [(3, 4, 3, 1), (7, 5, 7, 4)])
def test_greedy_trees_with_context_lookup_branches_equal_target_greedy(tiny_dirs, monkeypatch, arch, k, nodes,
                                                                        lookup, batch):
    """Context lookup branches (spec/context_lookup.py) beside the drafter's paths, accepted whole, in part and not
    at all, sharing nodes with the drafter's or taking the places of its least likely ones: every token is
    transformers' greedy token."""
    prompts = _prompts(batch)
    refs = [hf_greedy(tiny_dirs[arch], p) for p in prompts]
    engine = _engine(tiny_dirs, arch, k, rows=batch, draft_tree={batch: nodes}, lookup_nodes=lookup)
    truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    force_tree_drafts(engine, truth)
    force_lookup_drafts(engine, truth)
    moves, lookups = _recorded_moves(engine), _recorded_lookups(monkeypatch)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.tau > 2.0 and max(o.draft_lens) == nodes  # the branch shares the tree's nodes, adds none
    assert moves and max(a for _, a in lookups) >= 2 and any(0 < a < v for v, a in lookups)


def test_greedy_with_context_lookup_equals_target_greedy(tiny_dirs, monkeypatch):
    """The real lookup on prompts that repeat themselves (it drafts on most steps): transformers' greedy tokens."""
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 6 + [40]]
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_tree={2: 3}, lookup_nodes=3)
    lookups = _recorded_lookups(monkeypatch)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_dirs["qwen3"], p)
    assert max(a for _, a in lookups) >= 1  # lookups were verified and accepted


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_with_predicted_outputs_equals_target_greedy_and_a_near_prediction_takes_fewer_steps(tiny_dirs, tree):
    """OpenAI's predicted outputs: a prediction is drafted where the answer follows it, a whole step deep, on an
    engine that drafts no lookups of its own, in chains and in trees; a step whose rows all follow their predictions
    drafts as deep as the drafter reaches (7), past the schedule's K (3). Whatever it predicts (the answer with an
    edit in it, nothing like it), every token is transformers' greedy token; the answer with an edit takes under half
    the steps it takes without."""
    prompts = _prompts(2)
    refs = [hf_greedy(tiny_dirs["qwen3"], p) for p in prompts]
    engine = _engine(tiny_dirs, "qwen3", 7, rows=2, draft_len_schedule={1: 3, 2: 3},
                     **({"draft_tree": {2: 4}} if tree else {}))
    absent = next(t for t in range(3, 90) if t not in refs[1])
    predictions = [refs[0][:10] + [(t + 1) % 90 for t in refs[0][10:13]] + refs[0][13:], [absent] * NEW]
    both = engine.generate(prompts, [SamplingParams(max_new_tokens=NEW, ignore_eos=True, prediction=p)
                                     for p in predictions])
    alone = engine.generate(prompts[:1], SamplingParams(max_new_tokens=NEW, ignore_eos=True, prediction=predictions[0]))
    plain = engine.generate(prompts[:1], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in both] == refs and alone[0].token_ids == plain[0].token_ids == refs[0]
    assert max(both[1].acceptance_lengths) <= 4  # (it follows no prediction: the schedule's K wherever it is)
    assert max(alone[0].acceptance_lengths) == 8  # a step accepted all 7 drafts and its bonus
    assert len(alone[0].acceptance_lengths) < len(plain[0].acceptance_lengths) / 2
    # two rows, each predicting its own answer: their steps are deep together; and no deeper than a row needs
    exact = engine.generate(prompts, [SamplingParams(max_new_tokens=NEW, ignore_eos=True, prediction=r) for r in refs])
    assert [o.token_ids for o in exact] == refs and all(max(o.acceptance_lengths) == 8 for o in exact)
    short = engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True, prediction=refs[0]))
    # (the prefill's token, then 3 to go: K=3, the schedule's step, its tree's 4 nodes where it drafts trees)
    assert short[0].token_ids == refs[0][:4] and short[0].draft_lens == ([4] if tree else [3])


def test_a_context_lookup_deeper_than_the_drafters_block_is_refused(tiny_dirs):
    with pytest.raises(ValueError, match="lookup_nodes"):
        _engine(tiny_dirs, "qwen3", 3, draft_tree={1: 3}, lookup_nodes=16)
    with pytest.raises(ValueError, match="lookup_nodes"):
        EngineConfig(lookup_nodes=-1)


@pytest.mark.parametrize("rule, drafts", [("match", 6), ("rejection", 3)])
def test_a_batch_with_a_row_of_the_rejection_rule_drafts_a_chain(tiny_dirs, rule, drafts):
    """Trees verify by the target's own choice at each node: greedy, or sampled under the "match" rule."""
    prompts = _prompts(2)
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_tree={2: 6})
    greedy, sampled = SamplingParams(max_new_tokens=NEW, ignore_eos=True), SamplingParams(
        max_new_tokens=NEW, ignore_eos=True, temperature=1.0, seed=1, acceptance=rule)
    outs = engine.generate(prompts, [greedy, sampled])
    assert outs[0].token_ids == hf_greedy(tiny_dirs["qwen3"], prompts[0])
    assert outs[0].draft_lens[:5] == [drafts] * 5  # while the sampled row runs (a tree may follow when it is done)


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_trees_of_more_nodes_than_the_drafters_block_equal_target_greedy(tiny_dirs, batch):
    """A tree may verify more rows than a drafter block holds (K=3: 4 slots of a block of 16, 30 nodes): the target
    cache keeps room for them past a row's last position, also where requests end at max_model_len."""
    prompts = _prompts(batch)
    refs = [hf_greedy(tiny_dirs["qwen3"], p) for p in prompts]
    nodes = 30
    engine = _engine(tiny_dirs, "qwen3", 3, rows=batch, draft_tree={batch: nodes},
                     max_model_len=max(len(p) for p in prompts) + NEW)
    assert nodes > engine.drafter.config.block_size
    force_tree_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert max(o.draft_lens) == nodes


def test_a_draft_tree_past_the_visibility_mask_is_refused(tiny_dirs):
    with pytest.raises(ValueError, match="draft_tree=.*at most 62 nodes"):
        _engine(tiny_dirs, "qwen3", 3, draft_tree={1: 63})
    with pytest.raises(ValueError, match="draft_tree_without_amx"):  # checked whichever table this CPU takes
        _engine(tiny_dirs, "qwen3", 3, draft_tree={1: 3}, draft_tree_without_amx={1: 63})


@pytest.mark.parametrize("tiles", [True, False], ids=["AMX tiles", "dot products"])
def test_a_cpu_without_amx_tiles_drafts_the_smaller_tree_and_stays_exact(tiny_dirs, monkeypatch, tiles):
    """draft_tree_without_amx replaces draft_tree where the target's CPU linears do not run on AMX tiles (each verify
    row then costs its dot products); the output is the target's greedy either way."""
    from dflash_trt.engine import llm_engine

    monkeypatch.setattr(llm_engine, "kernel_layout", lambda target: "tiles" if tiles else "rows")
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1, draft_tree={1: 6}, draft_tree_without_amx={1: 2})
    assert engine.draft_tree == ({1: 6} if tiles else {1: 2})
    prompt = _prompts(1)[0]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], prompt)
    assert max(out.draft_lens) == out.draft_lens[0] == (6 if tiles else 2)  # fewer fit a shallow block near the end
    without = _engine(tiny_dirs, "qwen3", 3, rows=1, draft_tree={1: 6})  # no such table: draft_tree everywhere
    assert without.draft_tree == {1: 6}


@pytest.mark.parametrize("tiles", [True, False], ids=["AMX tiles", "dot products"])
def test_a_cpu_without_amx_tiles_runs_its_own_draft_len_schedule_and_stays_exact(tiny_dirs, monkeypatch, tiles):
    """draft_len_schedule_without_amx replaces draft_len_schedule where the target's CPU linears do not run on AMX
    tiles (there a verify step's rows cost their dot products): two rows draft K=3 on tiles and nothing without
    them; the output is the target's greedy either way."""
    from dflash_trt.engine import llm_engine

    monkeypatch.setattr(llm_engine, "kernel_layout", lambda target: "tiles" if tiles else "rows")
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_len_schedule={1: 3, 2: 3},
                     draft_len_schedule_without_amx={1: 3})
    assert engine.scheduler.config.draft_len_schedule == ({1: 3, 2: 3} if tiles else {1: 3})
    prompts = _prompts(2)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_dirs["qwen3"], p)
    # both rows start together: with tiles their first steps draft K=3; without, two rows decode plainly throughout
    assert [o.draft_lens[:3] for o in outs] == ([[3, 3, 3]] * 2 if tiles else [[], []])
    without = _engine(tiny_dirs, "qwen3", 3, rows=2, draft_len_schedule={1: 3, 2: 3})  # no such table
    assert without.scheduler.config.draft_len_schedule == {1: 3, 2: 3}


def test_one_row_drafting_less_than_k_in_a_tree_without_amx_stays_exact(tiny_dirs, monkeypatch):
    """The CPU default's shape on CPUs without AMX: one row drafts a shallower tree than max_draft_len allows
    (draft_len_schedule_without_amx {1: 2} under K=3, a 2-node tree); the output is the target's greedy."""
    from dflash_trt.engine import llm_engine

    monkeypatch.setattr(llm_engine, "kernel_layout", lambda target: "rows")
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1, draft_len_schedule={1: 3}, draft_len_schedule_without_amx={1: 2},
                     draft_tree={1: 3}, draft_tree_without_amx={1: 2})
    assert engine.scheduler.config.draft_len_for(1) == 2 and engine.draft_tree == {1: 2}
    for p in _prompts(2):
        out = engine.generate([p], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
        assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], p)
        assert out.draft_lens and set(out.draft_lens) == {2}


def test_a_draft_len_schedule_past_k_is_refused_on_any_cpu(tiny_dirs):
    with pytest.raises(ValueError, match=r"draft_len_schedule_without_amx=\{1: 3, 2: 5\}: K above max_draft_len=3"):
        _engine(tiny_dirs, "qwen3", 3, draft_len_schedule={1: 3}, draft_len_schedule_without_amx={1: 3, 2: 5})


def test_amx_tiles_are_told_from_dot_product_kernels(tiny_dirs, avx2_ops, monkeypatch):
    """kernel_layout: a packed bf16 target whose projections the kernel reads in tile order (this CPU, with AMX), not
    an fp32 one (oneDNN only) nor one the kernel serves in AVX2 panels (an AVX2 build)."""
    from dflash_trt.layers import linear

    def packed(dtype):
        target = load_target(tiny_dirs["qwen3"], dtype)
        target.pack_for_inference()
        return target

    ops = cpu_ops.load()
    amx = ops is not None and ops.linear_layout(torch.zeros(64, 64, dtype=torch.bfloat16)) == "tiles"
    assert (linear.kernel_layout(packed(torch.bfloat16)) == "tiles") == amx
    assert linear.kernel_layout(packed(torch.float32)) is None
    monkeypatch.setattr(cpu_ops, "load", lambda: avx2_ops)
    assert linear.kernel_layout(packed(torch.bfloat16)) == "panels"


def test_the_engine_says_how_its_cpu_linears_run_and_which_tree_it_drafts(tiny_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="dflash_trt"):
        _engine(tiny_dirs, "qwen3", 3, rows=1, draft_tree={1: 4}, draft_tree_without_amx={1: 2},
                draft_len_schedule={1: 3, 2: 3}, draft_len_schedule_without_amx={1: 3})
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: "))
    # the tiny fp32 target's linears run on oneDNN; on such a CPU path the smaller tables apply; fp32 heads and
    # drafters take neither the int8 screen nor int8 tables
    assert "CPU linears torch/oneDNN" in line and "draft tree {1: 2}" in line and "K by batch size {1: 3}," in line
    assert "greedy head full" in line and "drafter tables -" in line


def test_the_engine_says_which_head_and_drafter_tables_its_cpu_runs(screenable_dirs, caplog):
    """bf16: the screen's row limit on this CPU and the drafter's int8 tables where asked for."""
    ops = cpu_ops.load()
    if not _head_screen():
        pytest.skip("needs the CPU kernels with a bf16 linear and an int8 dot product")
    with caplog.at_level(logging.INFO, logger="dflash_trt"):
        _engine(screenable_dirs, "qwen3", 3, rows=1, dtype="bfloat16", int8_drafter=True)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: "))
    assert f"greedy head int8 screen up to {ops.head_screen_rows()} rows" in line and "drafter tables int8" in line


@needs_bf16_kernels
@pytest.mark.parametrize("int8_drafter", [True, False], ids=["int8 drafter", "bf16 drafter"])
@pytest.mark.parametrize("k, batch, forced", [(3, 1, False), (7, 4, False), (3, 4, True), (15, 1, True)])
def test_bf16_greedy_speculative_equals_bf16_plain_decoding(tiny_dirs, k, batch, forced, int8_drafter):
    """In bf16 too: the CPU kernels compute every token of a step the same way whatever the step's shape (torch's
    path attended with a grouped bf16 matmul in one-token steps and SDPA in verify blocks, which round apart; the
    bitwise check is tests/models/test_llama.py, this is the end-to-end one). The oracle is the same runtime's
    plain decoding, one token per step. Forced drafts (from the plain output, 15% corrupted) make most verify
    blocks accept several tokens and roll back."""
    prompts = _prompts(batch)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    plain = _engine(tiny_dirs, "qwen3", k, rows=batch, dtype="bfloat16", speculative=False).generate(prompts, params)
    engine = _engine(tiny_dirs, "qwen3", k, rows=batch, dtype="bfloat16", int8_drafter=int8_drafter)
    assert engine.drafter.kernel_table.int8 == (int8_drafter and cpu_ops.load().has_int8_kernels())
    if forced:
        force_drafts(engine, {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}, error_rate=0.15)
    outs = engine.generate(prompts, params)
    for o, ref in zip(outs, plain):
        assert o.token_ids == ref.token_ids
        if forced:
            assert o.tau > 1.5


@needs_bf16_kernels
@pytest.mark.parametrize("tree", [0, 6], ids=["chains", "trees"])
def test_bf16_steps_verify_no_more_rows_than_the_kernel_computes_alike(tiny_dirs, monkeypatch, caplog, tree):
    """Past the kernel's rows (32 with AVX-512 BF16's dot products, 128 with AMX tiles) a linear runs on oneDNN,
    whose blocked products round apart from a one-token step's: on SmolLM2 8 requests at K=4 (40 rows a step), half
    of them sampled with seeds, gave 7 of 16 answers that parted from each one's alone, decoded plainly. Steps draft
    less instead, here with the kernel's reach set to 16 rows: K=3 for four requests, K=7 for two."""
    from dflash_trt.layers import linear

    for layout in linear.KERNEL_MAX_ROWS:
        monkeypatch.setitem(linear.KERNEL_MAX_ROWS, layout, 16)
    prompts = _prompts(4)
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, **({"temperature": 0.8, "seed": i} if i % 2 else {}))
              for i in range(4)]  # a sampled row takes the whole batch through the full head's logits
    plain_engine = _engine(tiny_dirs, "qwen3", 7, dtype="bfloat16", speculative=False)
    plain = [plain_engine.generate([p], q)[0] for p, q in zip(prompts, params)]
    with caplog.at_level(logging.INFO, logger="dflash_trt"):
        engine = _engine(tiny_dirs, "qwen3", 7, dtype="bfloat16", draft_tree={4: tree} if tree else {})
    if engine.exact_rows != 16:
        pytest.skip("this CPU's kernel serves every row count (oneDNN packs no bf16 weight here)")
    assert "a step verifies at most 16 rows" in caplog.text and "at 3, 4 requests it drafts fewer" in caplog.text
    truth = {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    if tree:
        force_tree_drafts(engine, truth)
    else:
        force_drafts(engine, truth, error_rate=0.15)
    rows = []
    for name, width in (("spec_step", lambda k: k + 1), ("tree_step", lambda k, nodes: nodes + 1)):
        step = getattr(engine.runner, name)
        monkeypatch.setattr(engine.runner, name, lambda seqs, *a, step=step, width=width:
                            rows.append(len(seqs) * width(*a)) or step(seqs, *a))
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert rows and max(rows) <= 16 and all(o.tau > 1.5 for o in outs)


@pytest.mark.parametrize("batch, asked, cut", [
    (2, (7, 0), (7, 0)), (4, (7, 0), (3, 0)), (4, (7, 6), (7, 3)),  # a tree keeps its depth, with fewer nodes
    (9, (7, 6), (0, 0)),  # no room for a draft beside nine anchors
    (17, (7, 0), (7, 0)),  # past the kernel's rows a plain step rounds apart too: a cut would buy nothing
])
def test_a_steps_drafts_are_cut_to_the_rows_the_kernel_computes_alike(tiny_dirs, batch, asked, cut):
    engine = _engine(tiny_dirs, "qwen3", 7)
    engine.exact_rows = 16
    assert engine._within_exact_rows(batch, *asked) == cut


@pytest.mark.parametrize("exact_rows, attention_tokens, batch, asked, cut", [
    # an AVX2 CPU: the linears compute any rows alike, the kernels attend whole steps of up to 256 tokens
    (sys.maxsize, 256, 1, (9, 24), (9, 24)), (sys.maxsize, 256, 10, (9, 24), (9, 24)),
    (sys.maxsize, 256, 16, (9, 24), (9, 15)),  # 400 rows: a row's 25 queries would attend through SDPA
    (sys.maxsize, 256, 32, (15, 0), (15, 0)),  # 512 rows of 16 queries each: the kernels attend them
    (32, 32, 1, (9, 24), (9, 24)),  # AVX-512 BF16: whole steps of up to 32 tokens
    (32, 0, 1, (9, 24), (9, 15)),  # a target whose kernels attend no whole step: 16 queries a row
])
def test_a_steps_drafts_are_cut_to_the_queries_the_kernels_attend_alike(tiny_dirs, exact_rows, attention_tokens,
                                                                        batch, asked, cut):
    """The kernels attend a row's queries alike up to KERNEL_MAX_QUERIES (16) of them, or whole steps up to the
    target's kernel_attention_tokens; past both, a row attends through SDPA, which rounds apart (a gpt-oss tree of
    17 nodes parted from plain decoding). Chains of up to 15 drafts are never cut for it."""
    engine = _engine(tiny_dirs, "qwen3", 7)
    engine.exact_rows, engine.attention_tokens = exact_rows, attention_tokens
    assert engine._within_exact_rows(batch, *asked) == cut


def test_adaptive_steps_weigh_the_k_the_cut_leaves(tiny_dirs, monkeypatch):
    """Adaptive mode was asked about the scheduled K=7 and shown the cut K=3's steps: it kept measuring K=7, which
    never ran, and never turned to plain steps where they were faster."""
    engine = _engine(tiny_dirs, "qwen3", 7, adaptive_draft_len=True)
    engine.exact_rows = 16
    chosen, seen = [], []  # a step each: the K adaptive mode chose, and the K whose step it was shown
    choose, observe = engine.adaptive.choose, engine.adaptive.observe

    def recorded_choice(b, k):
        chosen.append(choose(b, k))
        return chosen[-1]

    monkeypatch.setattr(engine.adaptive, "choose", recorded_choice)
    monkeypatch.setattr(engine.adaptive, "observe", lambda b, k, *a, **kw: seen.append(k) or observe(b, k, *a, **kw))
    engine.generate(_prompts(4), SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert 3 in seen and seen == chosen


@needs_bf16_kernels
@pytest.mark.parametrize("k, nodes, lookup, batch", [(3, 5, 0, 1), (4, 7, 0, 4), (7, 6, 7, 2)])
def test_bf16_draft_trees_equal_bf16_plain_decoding(tiny_dirs, k, nodes, lookup, batch):
    """Through the kernels' tree attention (each node's softmax over its ancestors' keys as a chain would sum it),
    also with context lookup branches."""
    prompts = _prompts(batch)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    plain = _engine(tiny_dirs, "qwen3", k, rows=batch, dtype="bfloat16", speculative=False).generate(prompts, params)
    engine = _engine(tiny_dirs, "qwen3", k, rows=batch, dtype="bfloat16", draft_tree={batch: nodes},
                     lookup_nodes=lookup)
    truth = {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    force_tree_drafts(engine, truth)
    if lookup:
        force_lookup_drafts(engine, truth)
    moves = _recorded_moves(engine)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.tau > 1.5 for o in outs) and moves


def _bf16_plain_and_speculative(tiny_dirs, params: list[SamplingParams], shape: str) -> tuple[list, list]:
    """The same bf16 weights decoding `params`' requests plainly (their tokens), and speculatively (the outputs) with
    drafts forced from the plain tokens: chains (20% corrupted), or 5-node trees with context lookups."""
    prompts = _prompts(len(params))
    plain = _engine(tiny_dirs, "qwen3", 3, rows=len(prompts), dtype="bfloat16", speculative=False).generate(
        prompts, params)
    tree = {"draft_tree": {len(prompts): 5}, "lookup_nodes": 3} if shape == "tree" else {}
    engine = _engine(tiny_dirs, "qwen3", 3, rows=len(prompts), dtype="bfloat16", **tree)
    truth = {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    if tree:
        force_tree_drafts(engine, truth)
        force_lookup_drafts(engine, truth)
    else:
        force_drafts(engine, truth, error_rate=0.2)
    outs = engine.generate(prompts, params)
    assert max(n for o in outs for n in o.draft_lens) == (5 if tree else 3)
    return [o.token_ids for o in plain], outs


@needs_bf16_kernels
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_seeded_bf16_match_sample_is_the_same_speculative_as_plain(tiny_dirs, shape):
    """Under the "match" rule the target samples every token with the seed's positional uniform, in verify steps
    as in one-token ones; in bf16 the same weights' plain decoding is the oracle."""
    params = [SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=s, ignore_eos=True) for s in (3, 4)]
    plain, spec = _bf16_plain_and_speculative(tiny_dirs, params, shape)
    assert [o.token_ids for o in spec] == plain
    assert all(o.tau > 1.5 for o in spec)  # most forced drafts accepted: the target sampled their tokens


@needs_bf16_kernels
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_bf16_greedy_under_penalties_and_logit_bias_is_the_same_speculative_as_plain(tiny_dirs, shape):
    """Repetition, presence and frequency penalties and a logit bias shape each verified position's logits as if
    the drafts before it were the output (in a tree, each node's path)."""
    shaped = dict(max_new_tokens=NEW, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                  frequency_penalty=0.3, logit_bias={40: 2.0, 7: -1.0})
    plain, spec = _bf16_plain_and_speculative(tiny_dirs, [SamplingParams(**shaped)] * 2, shape)
    assert [o.token_ids for o in spec] == plain
    assert all(o.tau > 1.5 for o in spec)


@pytest.fixture(scope="module")
def screenable_dirs(tmp_path_factory) -> dict:
    """A target whose vocabulary is whole 64-feature groups (128), which the head's int8 screen serves."""
    root = tmp_path_factory.mktemp("screenable")
    target = make_target(root / "target", "qwen3", seed=7, vocab=128)
    return {"qwen3": target, "qwen3_drafter": make_drafter(root / "drafter", target, block_size=8)}


def _head_screen() -> bool:
    ops = cpu_ops.load()
    return bf16_kernels_serve() and ops.has_int8_kernels()


@pytest.mark.skipif(not _head_screen(), reason="needs the CPU kernels with AVX512-BF16 and AVX512-VNNI, or AVX2")
@pytest.mark.parametrize("k, batch", [(0, 1), (0, 4), (3, 2), (7, 1), (7, 2), (7, 4)])
def test_bf16_greedy_tokens_are_the_same_through_the_heads_int8_screen(screenable_dirs, k, batch):
    """The screen (layers/greedy_head.py) serves steps of up to 8 rows (4 with AVX2; K=7 at batch 2 is 16, at 4 32:
    the full head runs); every token equals plain decoding's through the full head, forced drafts (15% corrupted)
    included."""
    prompts = _prompts(batch)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    full = _engine(screenable_dirs, "qwen3", None, rows=batch, dtype="bfloat16", speculative=False, screen_head=False)
    assert full.target.greedy_head is None
    ref = [o.token_ids for o in full.generate(prompts, params)]
    engine = _engine(screenable_dirs, "qwen3", k or None, rows=batch, dtype="bfloat16", speculative=k > 0)
    assert engine.target.greedy_head is not None
    if k:
        force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, ref))}, error_rate=0.15)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    if k:
        assert all(o.tau > 1.5 for o in outs)


def _ranked_vocab(answers: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Every token, ranked as a draft_vocab.json ranks them: by how often `answers` use it, then unused ids."""
    ranked = rank_tokens(answers)[0].tolist()
    return torch.tensor(ranked + [t for t in range(vocab_size) if t not in ranked])


def _every_cpu_option_engine(dirs, dtype, rows, answers, **cfg) -> LLMEngine:
    """The CPU engine as users run it: a draft tree (3 nodes, K=3), context lookups, adaptive K (forced to run
    speculative and plain steps by turns), and half the vocabulary to draft among (ranked by all answers but the
    last, cut by draft_vocab_size); drafts forced from `answers` (tests/forced_drafts.py)."""
    torch_dtype = EngineConfig(dtype=dtype).torch_dtype
    target = load_target(dirs["qwen3"], torch_dtype)
    drafter = load_drafter(dirs["qwen3_drafter"], target.config, torch_dtype)
    vocab_size = target.config.vocab_size
    drafter.draft_vocab = _ranked_vocab(answers[:-1], vocab_size)
    engine = LLMEngine(target, None, drafter, EngineConfig(
        max_batch_size=rows, max_draft_len=3, dtype=dtype, draft_tree={rows: 3}, lookup_nodes=3,
        adaptive_draft_len=True, draft_vocab_size=vocab_size // 2, **cfg))
    assert engine.runner.draft_vocab_size == vocab_size // 2
    truth = {i: p + a for i, (p, a) in enumerate(zip(_prompts(len(answers)), answers))}
    force_tree_drafts(engine, truth)
    force_lookup_drafts(engine, truth)
    engine.adaptive = _Alternate(2)
    return engine


@pytest.mark.skipif(not _head_screen(), reason="needs the CPU kernels with AVX512-BF16 and AVX512-VNNI, or AVX2")
def test_bf16_greedy_through_every_cpu_option_at_once_equals_bf16_plain_decoding(screenable_dirs):
    """bf16 with every CPU option users turn on at once: a draft tree with context lookups, plain steps between
    speculative ones, a draft vocabulary, the drafter's int8 tables and the head's int8 screen (which serves the
    plain steps and, once two rows are left and where it takes 8 rows (AVX512-VNNI; 4 on AVX2), the trees' 8-row
    verify steps). Every token is plain bf16 decoding's through the full head."""
    prompts = _prompts(4)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (NEW, 12, NEW, 12)]
    full = _engine(screenable_dirs, "qwen3", None, rows=4, dtype="bfloat16", speculative=False, screen_head=False)
    assert full.target.greedy_head is None
    ref = [o.token_ids for o in full.generate(prompts, params)]
    engine = _every_cpu_option_engine(screenable_dirs, "bfloat16", 4, ref, int8_drafter=True)
    assert engine.drafter.kernel_table.int8
    screened = []  # the screen's verdict per call: the rows it served, None where the full head ran
    head = engine.target.greedy_head
    real = head.argmax
    head.argmax = lambda hidden: (screened.append(None if (t := real(hidden)) is None else tuple(t.shape)), t)[1]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert all(o.tau > 1.5 for o in outs)
    assert {n for o in outs for n in o.draft_lens} == {3}  # trees (plain steps draft nothing)
    assert {(4,), (2,)} <= set(screened) and None in screened  # plain steps; 16-row trees: the full head
    assert ((2, 4) in screened) == (head.max_rows >= 8)  # 8-row trees


def test_greedy_through_every_cpu_option_at_once_in_fp32_equals_target_greedy(tiny_dirs):
    """The same combination in fp32 (no int8 screen or drafter tables there): transformers' greedy tokens."""
    prompts = _prompts(4)
    lengths = (NEW, 12, NEW, 12)
    refs = [hf_greedy(tiny_dirs["qwen3"], p)[:n] for p, n in zip(prompts, lengths)]
    engine = _every_cpu_option_engine(tiny_dirs, "float32", 4, refs)
    assert engine.target.greedy_head is None and engine.drafter.kernel_table is None
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
    assert [o.token_ids for o in outs] == refs
    assert all(o.tau > 1.5 for o in outs)
    assert {n for o in outs for n in o.draft_lens} == {3}


def test_stops_at_eos_like_the_target(tiny_dirs):
    prompts = _prompts(4)
    eos = 7
    engine = _engine(tiny_dirs, "qwen3", 7)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, stop_token_ids=[eos]))
    for p, o in zip(prompts, outs):
        ref = hf_greedy(tiny_dirs["qwen3"], p, eos=eos)
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        assert o.token_ids == ref
        assert o.finish_reason == ("stop" if o.token_ids[-1] == eos else "length")


def test_a_stop_string_longer_than_the_decoded_window_still_stops(tiny_dirs):
    """The stop check decodes only the output's tail; a stop string must end generation however long it is
    (here 100 characters of a one-character-per-token tokenizer)."""
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"],
                                 EngineConfig(max_batch_size=1, max_draft_len=3, max_model_len=256))
    p = _prompts(1)[0]
    full = engine.generate([p], SamplingParams(max_new_tokens=200, ignore_eos=True))[0]
    stop = full.text[30:130]
    assert len(stop) == 100
    cut = engine.generate([p], SamplingParams(max_new_tokens=200, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    assert cut.token_ids == full.token_ids[:cut.num_tokens]


def test_context_limit_is_honoured(tiny_dirs):
    p = _prompts(2)[1]  # 17 tokens
    out = _engine(tiny_dirs, "qwen3", 15, rows=1, max_model_len=30).generate([p], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    assert len(p) + out.num_tokens == 30 and out.finish_reason == "length"
    assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], p)[:13]


def test_a_max_model_len_past_the_targets_positions_is_capped_and_asked_for_ones_are_warned_of(tiny_dirs):
    from dflash_trt.engine.llm_engine import capped_note

    engine = _engine(tiny_dirs, "qwen3", 3, rows=1, max_model_len=4096)  # the tiny target has 512 positions
    assert engine.max_model_len == 512
    note = capped_note(4096, engine.max_position_embeddings)
    assert "--max-model-len 4096 is past the target's max_position_embeddings (512" in note
    assert capped_note(None, 512) is None and capped_note(512, 512) is None  # a default; one that fits


def test_prompt_that_fills_the_context_is_refused(tiny_dirs):
    with pytest.raises(ValueError, match="max_model_len=16"):
        _engine(tiny_dirs, "qwen3", 3, rows=1, max_model_len=16).generate([list(range(3, 19))])


def test_k_beyond_the_block_is_refused_naming_the_limit(tiny_dirs):
    with pytest.raises(ValueError, match="allows 1..15"):
        _engine(tiny_dirs, "qwen3", 16)


# (1, 3): the target's last layer, whose transformers hidden_states entry (z-lab's feature) is after the final norm
@pytest.mark.parametrize("layer_ids", [(0, 2), (1, 3)])
def test_zlab_dflash_generate_gives_the_same_tokens_and_acceptance_lengths(tmp_path, monkeypatch, layer_ids):
    ref = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 is the oracle")
    import time

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # its stats path calls torch.cuda.synchronize
    # A small vocabulary makes a random drafter right often enough to produce acceptances > 1.
    t = make_target(tmp_path / "t", vocab=12)
    d = make_drafter(tmp_path / "d", t, block_size=8, layers=2, target_layer_ids=layer_ids)
    hf = AutoModelForCausalLM.from_pretrained(t).eval()
    zd = ref.DFlashDraftModel.from_pretrained(d).eval()
    target = load_target(t)
    drafter = load_drafter(d, target.config)
    total_accepted = 0
    for k in (3, 7):
        engine = LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1, max_draft_len=k))
        for seed in range(3):
            prompt = _prompts(4, seed)[seed]
            prompt = [x % 12 for x in prompt]
            want = ref.dflash_generate(zd, hf, torch.tensor([prompt]), NEW, None, block_size=k + 1, return_stats=True)
            got = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
            assert got.token_ids == want.output_ids[0, len(prompt):].tolist()
            assert got.acceptance_lengths == want.acceptance_lengths
            total_accepted += sum(a - 1 for a in got.acceptance_lengths)
    assert total_accepted > 0


# --- sampling: the distribution of speculative samples is the target's -----------------------------



def _exact_joint(target_dir, prompt, temperature, top_k, top_p, new=4):
    """P(x_1..x_new | prompt) under the target, by enumeration; the transform is z-lab's (an oracle)."""
    ref = pytest.importorskip("dflash.model")
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    seqs = list(itertools.product(range(V), repeat=new))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = hf(ids).logits[:, len(prompt) - 1 : -1]
    probs = ref._sampling_probs(logits, temperature, top_p, top_k)
    picked = probs.gather(-1, ids[:, len(prompt):, None])[..., 0]
    return {s: float(p) for s, p in zip(seqs, picked.prod(-1))}


@pytest.mark.parametrize("rule", ["match", "rejection"])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.5, 0, 1.0), (1.2, 3, 0.9)])
@pytest.mark.parametrize("k", [3, 2], ids=["K=3", "K=2 and its bonus"])
def test_sampled_output_follows_the_target_distribution(small_vocab, rule, temperature, top_k, top_p, k):
    """Four tokens: the prefill's, then one step. At K=3 the step verifies three drafts and the bonus after them is
    cut (the row needs no more); at K=2 a step that accepts both drafts emits the bonus, the target's sample after
    them (a bonus that repeated the last draft passed every K=3 test)."""
    t, d = small_vocab
    prompt = [1, 3, 0, 2, 1]
    expected = _exact_joint(t, prompt, temperature, top_k, top_p)
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config), EngineConfig(max_batch_size=1500, max_draft_len=k))
    n = 4500
    params = [SamplingParams(max_new_tokens=4, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                             acceptance=rule, ignore_eos=True) for s in range(n)]
    outs = engine.generate([prompt] * n, params)
    assert sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs) > n / 10  # drafts accepted
    if k == 2:
        assert sum(o.acceptance_lengths[0] == 3 for o in outs) > n / 20  # both accepted, the bonus emitted
    assert_matches([tuple(o.token_ids) for o in outs], expected)


def test_sampled_chains_with_context_lookups_follow_the_target_distribution(small_vocab, monkeypatch):
    """The "match" rule on chains where a context lookup replaces the drafter's chain: the target samples each token
    and a draft carrying the sample is kept, whoever drafted it."""
    t, d = small_vocab
    prompt = [1, 3, 0, 2, 1]
    expected = _exact_joint(t, prompt, 1.5, 0, 1.0)
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config),
                       EngineConfig(max_batch_size=1500, max_draft_len=3, lookup_nodes=3))
    n = 4500
    params = [SamplingParams(max_new_tokens=4, temperature=1.5, seed=s, ignore_eos=True) for s in range(n)]
    lookups = _recorded_lookups(monkeypatch)
    outs = engine.generate([prompt] * n, params)
    assert sum(a for _, a in lookups) > n / 20  # lookups drafted and accepted
    assert_matches([tuple(o.token_ids) for o in outs], expected)


def test_sampled_answers_with_a_predicted_output_follow_the_target_distribution(small_vocab, monkeypatch):
    """The "match" rule with a prediction drafted (on an engine that drafts no lookups of its own): the target samples
    each token and a draft carrying the sample is kept, whatever the prediction."""
    t, d = small_vocab
    prompt = [1, 3, 0, 2, 1]
    expected = _exact_joint(t, prompt, 1.5, 0, 1.0)
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config), EngineConfig(max_batch_size=1500,
                                                                                  max_draft_len=3))
    n = 4500
    params = [SamplingParams(max_new_tokens=4, temperature=1.5, seed=s, ignore_eos=True, prediction=[2, 0, 1, 3])
              for s in range(n)]
    lookups = _recorded_lookups(monkeypatch)
    outs = engine.generate([prompt] * n, params)
    assert sum(a for _, a in lookups) > n / 20  # the prediction drafted and accepted
    assert_matches([tuple(o.token_ids) for o in outs], expected)


@pytest.mark.parametrize("lookup", [0, 3])
def test_sampled_draft_trees_follow_the_target_distribution(small_vocab, monkeypatch, lookup):
    """The "match" rule through draft trees: at each node the target samples, with the row's uniform for that depth,
    and a child carrying the sample continues the path; with context lookup branches beside the drafter's paths
    too."""
    t, d = small_vocab
    prompt = [1, 3, 0, 2, 1]
    expected = _exact_joint(t, prompt, 1.5, 0, 1.0)
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config),
                       EngineConfig(max_batch_size=1500, max_draft_len=3, draft_tree={1500: 5}, lookup_nodes=lookup))
    n = 4500
    params = [SamplingParams(max_new_tokens=4, temperature=1.5, seed=s, ignore_eos=True) for s in range(n)]
    lookups = _recorded_lookups(monkeypatch)
    outs = engine.generate([prompt] * n, params)
    assert all(max(o.draft_lens) == 5 for o in outs)  # trees, not chains
    assert lookup == 0 or sum(a for _, a in lookups) > n / 10  # lookups verified and accepted
    assert sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs) > n / 5  # drafts accepted
    assert_matches([tuple(o.token_ids) for o in outs], expected)


@pytest.mark.parametrize("tree", [{}, {8: 5}], ids=["chain", "tree"])
def test_a_seed_fixes_the_sample_whatever_the_batch(small_vocab, tree):
    t, d = small_vocab
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config),
                       EngineConfig(max_batch_size=8, max_draft_len=3, draft_tree=tree))
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = engine.generate([[1, 2, 3]], p)[0].token_ids
    batched = engine.generate([[0, 1], [1, 2, 3], [3, 3, 3, 3]], [SamplingParams(max_new_tokens=12, temperature=1.0, seed=1, ignore_eos=True), p,
                                                              SamplingParams(max_new_tokens=12, temperature=1.0, seed=2, ignore_eos=True)])[1].token_ids
    assert alone == batched


def hf_sample(target_dir, prompt, seed, temperature, new=NEW):
    """transformers' logits sampled by inverse CDF, the token at output position p with the p-th float32 draw of
    PCG64(SeedSequence(2 * seed)) for a seed >= 0 (layers/sampler.py PositionalUniforms' documented stream; the
    oracle)."""
    key = ("sample", str(target_dir), tuple(prompt), seed, temperature, new)
    if key not in _refs:
        hf = hf_model(target_dir)
        u = np.random.Generator(np.random.PCG64(np.random.SeedSequence(2 * seed))).random(new, dtype=np.float32)
        ids = list(prompt)
        with torch.no_grad():
            for p in range(new):
                cdf = torch.softmax(hf(torch.tensor([ids])).logits[0, -1].float() / temperature, -1).cumsum(-1)
                ids.append(min(int(torch.searchsorted(cdf, float(u[p]) * cdf[-1], right=True)), len(cdf) - 1))
        _refs[key] = ids[len(prompt):]
    return _refs[key]


@pytest.mark.parametrize("variant", ["plain", "K=3", "K=7", "tree", "lookup", "plain steps between"])
def test_a_seeded_match_sample_is_the_targets_own_sample_whatever_each_step_drafts(tiny_dirs, variant):
    """Under the "match" rule a seeded request's tokens are the target's plain samples with the seed's positional
    uniforms: the same with or without speculation, at any K, through trees, lookups and plain steps chosen by
    timing, beside other requests. Drafts are forced to the oracle's tokens (with errors), so most are accepted."""
    prompts, seeds = _prompts(3), [11, 42, 2**40 + 3]
    refs = [hf_sample(tiny_dirs["qwen3"], p, s, 1.0) for p, s in zip(prompts, seeds)]
    k = {"K=7": 7, "plain": 0}.get(variant, 3)
    cfg = {"tree": {"draft_tree": {4: 5}}, "lookup": {"lookup_nodes": 3},
           "plain steps between": {"adaptive_draft_len": True}}.get(variant, {})
    engine = _engine(tiny_dirs, "qwen3", max(k, 1), rows=3, **cfg)
    if variant == "plain":
        engine = LLMEngine(engine.target, None, None, EngineConfig(max_batch_size=3, speculative=False))
    elif variant == "tree":
        force_tree_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})
    else:
        force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.2)
    if variant == "plain steps between":
        engine.adaptive = _Alternate(2)
    params = [SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    outs = engine.generate(prompts, params)
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert variant == "plain" or o.tau > 1.5  # the forced drafts were accepted: the target sampled the same


def test_a_prompts_copies_sent_together_prefill_once_and_each_answers_as_if_alone(tiny_dirs, monkeypatch):
    """Requests whose prompts hold the same tokens up to a chunk's end (a request's n choices, a batch of one prompt,
    a prompt and its own first chunk) share that chunk's forward; each still answers as the target does: greedy
    ones with transformers' greedy text, a seeded one with its sample, and logprobs those of the prompt alone."""
    prompt = _prompts(2)[1]  # 17 tokens: chunks [0, 16) and [16, 17) at 16 tokens a step
    engine = _engine(tiny_dirs, "qwen3", 3, rows=4, max_prefill_tokens=16)
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True),
              SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=2, prompt_logprobs=2),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True)]
    prompts = [prompt] * 3 + [prompt[:16]]
    alone = _engine(tiny_dirs, "qwen3", 3, rows=4, max_prefill_tokens=16).generate([prompt], params[2])[0]
    widths = record_forward_widths(engine.runner.target, monkeypatch)
    outs = engine.generate(prompts, params)
    assert widths.count(16) == 2  # one forward per chunk (a verify block is 4 wide, a prefill chunk 16)
    assert outs[0].token_ids == outs[2].token_ids == hf_greedy(tiny_dirs["qwen3"], prompt)
    assert outs[1].token_ids == hf_sample(tiny_dirs["qwen3"], prompt, 7, 1.0)
    assert outs[3].token_ids == hf_greedy(tiny_dirs["qwen3"], prompt[:16])
    assert outs[2].prompt_logprobs == alone.prompt_logprobs
    assert outs[2].logprobs[0] == alone.logprobs[0]  # the first token's, from the shared prefill
    torch.testing.assert_close(torch.tensor([x.logprob for x in outs[2].logprobs]),
                               torch.tensor([x.logprob for x in alone.logprobs]), atol=1e-5, rtol=0)


def test_the_next_turn_of_a_chat_skips_the_chunks_its_row_holds_and_answers_as_the_target_does(tiny_dirs,
                                                                                                 monkeypatch):
    """A freed row keeps its prompt's K/V: a later prompt that starts with that prompt's whole chunks (the next turn
    of a chat: the history, the answer, a new message) is prefilled from past them, and answers with transformers'
    greedy text, or its seeded sample."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=3, max_prefill_tokens=16)
    g = torch.Generator().manual_seed(9)
    first = torch.randint(3, 90, (40,), generator=g).tolist()  # chunks [0, 16), [16, 32), [32, 40)
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    answer = engine.generate([first], greedy)[0].token_ids
    assert answer == hf_greedy(tiny_dirs["qwen3"], first)
    widths = record_forward_widths(engine.runner.target, monkeypatch)
    second = first + answer + torch.randint(3, 90, (5,), generator=g).tolist()  # 85 tokens
    (out,) = engine.generate([second], greedy)
    assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], second)
    assert widths.count(16) == 4  # [32, 48) .. [80, 85): the first two chunks were the first prompt's
    third = second[:64] + torch.randint(3, 90, (6,), generator=g).tolist()
    widths.clear()
    # three answers: the first takes row 0 over, the others a copy of it in rows 1 and 2, and they share [64, 70)
    sampled = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=3, ignore_eos=True)
    outs = engine.generate([third] * 3, [greedy, greedy, sampled])
    assert outs[0].token_ids == outs[1].token_ids == hf_greedy(tiny_dirs["qwen3"], third)
    assert outs[2].token_ids == hf_sample(tiny_dirs["qwen3"], third, 3, 1.0)
    assert widths.count(16) == 1 and [o.num_cached_tokens for o in outs] == [64] * 3
    for cache in (engine.runner.target_cache, engine.runner.proposer.cache):  # the drafter's context copied too
        for kv in (cache.k, cache.v):
            assert torch.equal(kv[:, 1:3, :, :64], kv[:, :1, :, :64].expand(-1, 2, -1, -1, -1))


def test_a_prompt_that_starts_with_a_running_requests_chunks_copies_them_and_answers_as_the_target_does(
        tiny_dirs, monkeypatch):
    """Users' requests that start with one long system prompt: one that arrives while another runs copies that
    request's whole prompt chunks (its target K/V and drafter context) from its row, is prefilled from past them, and
    answers with transformers' greedy text, or its seeded sample."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=3, max_prefill_tokens=16)
    g = torch.Generator().manual_seed(13)
    system = torch.randint(3, 90, (36,), generator=g).tolist()  # whole chunks [0, 16) and [16, 32)
    prompts = [system + torch.randint(3, 90, (n,), generator=g).tolist() for n in (4, 9, 7)]
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = engine.add_request(prompts[0], greedy)
    while first.drafter_context < 32:  # prefilled, and drafted from
        engine.step()
    widths = record_forward_widths(engine.runner.target, monkeypatch)
    second = engine.add_request(prompts[1], greedy)
    third = engine.add_request(prompts[2], SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=5,
                                                          ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for cache in (engine.runner.target_cache, engine.runner.proposer.cache):  # a row's prompt positions stay put
        for kv in (cache.k, cache.v):
            for s in (second, third):
                assert torch.equal(kv[:, s.slot, :, :32], kv[:, first.slot, :, :32])
    assert first.output_ids == hf_greedy(tiny_dirs["qwen3"], prompts[0])
    assert second.output_ids == hf_greedy(tiny_dirs["qwen3"], prompts[1])
    assert third.output_ids == hf_sample(tiny_dirs["qwen3"], prompts[2], 5, 1.0)
    # prefill chunks [32, 45) and [32, 39) alone, bucketed to 16 wide (the other forwards: verify blocks)
    assert widths.count(16) == 2 and (second.num_reused, third.num_reused) == (32, 32)


def test_a_prompt_that_copies_chunks_its_holders_drafter_has_not_taken_in_drafts_from_their_features(tiny_dirs,
                                                                                                    monkeypatch):
    """Mid-prefill (or under a load that drafts nothing) a row's drafter context lags its K/V: a request that copies
    the row's chunks takes the target features of those positions along, and its drafter takes them in as the
    holder's does; both answer with transformers' greedy text."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, max_prefill_tokens=16)
    g = torch.Generator().manual_seed(17)
    system = torch.randint(3, 90, (36,), generator=g).tolist()
    prompts = [system + torch.randint(3, 90, (n,), generator=g).tolist() for n in (4, 9)]
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = engine.add_request(prompts[0], greedy)
    engine.step()  # first: [0, 16), not yet drafted from
    widths = record_forward_widths(engine.runner.target, monkeypatch)
    second = engine.add_request(prompts[1], greedy)
    while engine.has_unfinished():
        engine.step()
    assert (first.output_ids, second.output_ids) == tuple(hf_greedy(tiny_dirs["qwen3"], p) for p in prompts)
    # second copied [0, 16), shared first's [16, 32), computed [32, 45): [16, 32) is first's forward
    assert widths.count(16) == 3 and second.num_reused == 16
    cache = engine.runner.proposer.cache  # each row's drafter took in [0, 32) from the same features
    for kv in (cache.k, cache.v):
        torch.testing.assert_close(kv[:, second.slot, :, :32], kv[:, first.slot, :, :32])


def test_on_a_grid_finer_than_the_budget_chunks_share_steps_and_reuse_and_answer_as_the_target_does(tiny_dirs,
                                                                                                      monkeypatch):
    """8-token chunks, 32 tokens a step: a prompt's chunks run in one step (a forward each), its twin sent with it
    copies every one of them, and the next turn of the chat takes over the whole 8-token chunks its row holds; each
    answers with transformers' greedy text, or its seeded sample."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, max_prefill_tokens=32, prefill_chunk=8)
    g = torch.Generator().manual_seed(21)
    first = torch.randint(3, 90, (21,), generator=g).tolist()  # chunks [0, 8), [8, 16), [16, 21)
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    widths = record_forward_widths(engine.runner.target, monkeypatch)
    a = engine.add_request(first, greedy)
    b = engine.add_request(first, SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=4, ignore_eos=True))
    engine.step()
    assert widths == [16] * 3 and a.is_prefilled and b.is_prefilled  # each chunk bucketed to 16 wide, once for both
    while engine.has_unfinished():
        engine.step()
    assert a.output_ids == hf_greedy(tiny_dirs["qwen3"], first)
    assert b.output_ids == hf_sample(tiny_dirs["qwen3"], first, 4, 1.0)
    second = first + a.output_ids + torch.randint(3, 90, (11,), generator=g).tolist()
    widths.clear()
    (out,) = engine.generate([second], greedy)
    assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], second)
    assert out.num_cached_tokens == 16 and widths.count(16) == -(-(len(second) - 16) // 8)


def test_a_prompt_a_chunk_behind_its_twin_answers_as_the_target_does_with_its_prompts_logprobs(tiny_dirs):
    """4-token chunks, 8 tokens a step: b arrives as its twin a computes its second chunk; asking for its prompt's
    logprobs, b takes no row's chunks over and computes its first chunk itself, so it must not copy a's second one in
    that step (the copy would land first, and b sample its first token twice)."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=3, max_prefill_tokens=8, prefill_chunk=4)
    g = torch.Generator().manual_seed(3)
    other, prompt = (torch.randint(3, 90, (n,), generator=g).tolist() for n in (4, 8))
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    with_logprobs = SamplingParams(max_new_tokens=NEW, ignore_eos=True, prompt_logprobs=1)
    engine.add_request(other, greedy)
    a = engine.add_request(prompt, greedy)
    engine.step()  # other's chunk and a's [0, 4)
    b = engine.add_request(prompt, with_logprobs)
    while engine.has_unfinished():
        engine.step()
    alone = _engine(tiny_dirs, "qwen3", 3, rows=1).generate([prompt], with_logprobs)[0]
    assert a.output_ids == b.output_ids == hf_greedy(tiny_dirs["qwen3"], prompt)
    assert len(b.prompt_logprobs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor([x.logprob for x in b.prompt_logprobs]),
                               torch.tensor([x.logprob for x in alone.prompt_logprobs]), atol=1e-5, rtol=0)


def test_without_prefix_reuse_a_chats_next_turn_is_prefilled_from_the_start(tiny_dirs, monkeypatch):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, max_prefill_tokens=16, prefix_reuse=False)
    first = torch.randint(3, 90, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    answer = engine.generate([first], greedy)[0].token_ids
    widths = record_forward_widths(engine.runner.target, monkeypatch)
    second = first + answer + [5, 6, 7]
    (out,) = engine.generate([second], greedy)
    assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], second)
    assert widths.count(16) == 6 and out.num_cached_tokens == 0  # [0, 16) .. [80, 83)


class _Alternate:
    """A stand-in for AdaptiveDraftLen that runs the schedule's K once every `period` steps, K=0 in between."""

    def __init__(self, period: int = 2):
        self.n, self.period = 0, period
        self.observed: list[tuple[int, bool]] = []  # (K, catch_up) per step
        self.step_s: list[float | None] = []

    def choose(self, batch_size, k):
        self.n += 1
        return k if (self.n - 1) % self.period == 0 else 0

    def observe(self, batch_size, k, step_s, tokens, catch_up=False):
        self.observed.append((k, catch_up))
        self.step_s.append(step_s)


@pytest.mark.parametrize("period", [2, 4])
def test_greedy_is_lossless_when_steps_switch_between_speculative_and_plain(tiny_dirs, period):
    """Plain steps in between queue their features (one chunk per step) for the next speculative step."""
    prompts = _prompts(4)
    refs = [hf_greedy(tiny_dirs["qwen3"], p) for p in prompts]
    engine = _engine(tiny_dirs, "qwen3", 3, adaptive_draft_len=True)
    engine.adaptive = _Alternate(period)
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.1)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.tau > 2.0  # the drafter's context survived the plain steps in between


@pytest.mark.parametrize("period", [1, 4])
def test_speculative_steps_that_take_in_a_prompt_or_plain_steps_features_are_flagged_catch_up(tiny_dirs, period):
    """Steady speculative steps inject the K + 1 or fewer features their predecessor committed; the first step after
    the prompt, and every step after three plain steps of fully accepted blocks (4 + 3 features), inject more."""
    prompt = _prompts(1)
    assert len(prompt[0]) > 4
    ref = hf_greedy(tiny_dirs["qwen3"], prompt[0])
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1, adaptive_draft_len=True)
    engine.adaptive = recorder = _Alternate(period)
    force_drafts(engine, {0: prompt[0] + ref}, error_rate=0.0)
    assert engine.generate(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0].token_ids == ref
    flags = [catch_up for k, catch_up in recorder.observed if k > 0]
    assert len(flags) > 2 and flags[0]
    assert all(flags[1:]) if period == 4 else not any(flags[1:])
    assert not any(catch_up for k, catch_up in recorder.observed if k == 0)


def test_a_decode_steps_time_is_the_engines_whole_cycle_but_never_an_idle_wait(tiny_dirs):
    # A server's per-step work outside the forwards (streaming, detokenizing) is paid once per step, however many
    # tokens the step commits: the adaptive mode must see it. Waiting for requests is no step's cost.
    import time

    engine = _engine(tiny_dirs, "qwen3", 3, rows=1, adaptive_draft_len=True)
    engine.adaptive = recorder = _Alternate(2)
    prompt = _prompts(1)[0]
    first_steps = []  # each request's first decode step follows its prefill step
    for _ in range(2):  # two requests, an idle second between them
        first_steps.append(len(recorder.step_s))
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            time.sleep(0.05)  # a server's per-step work outside step()
        time.sleep(1.0)
    assert len(recorder.step_s) >= 8
    for i, s in enumerate(recorder.step_s):
        if i in first_steps:
            assert s is None
        else:
            assert 0.05 <= s < 0.9, (i, s)  # the work between steps counted, the idle second not


def test_sampling_follows_the_target_distribution_when_steps_switch(small_vocab):
    t, d = small_vocab
    prompt = [1, 3, 0, 2, 1]
    expected = _exact_joint(t, prompt, 1.2, 3, 0.9)
    target = load_target(t)
    engine = LLMEngine(target, None, load_drafter(d, target.config),
                       EngineConfig(max_batch_size=1500, max_draft_len=3, adaptive_draft_len=True))
    engine.adaptive = _Alternate()
    params = [SamplingParams(max_new_tokens=4, temperature=1.2, top_k=3, top_p=0.9, seed=s, ignore_eos=True)
              for s in range(4500)]
    outs = engine.generate([prompt] * 4500, params)
    assert_matches([tuple(o.token_ids) for o in outs], expected)


def _step_costs_by_k(engine) -> None:
    """Steps cost 1 + 0.1 K (a K=7 step 1.7 plain ones) whatever the machine's load: the policy is what is tested."""
    observe = engine.adaptive.observe
    engine.adaptive.observe = lambda batch, k, step_s, tokens, catch_up=False: observe(batch, k, 1.0 + 0.1 * k, tokens,
                                                                                     catch_up)


def test_adaptive_draft_len_turns_a_useless_drafter_off_and_keeps_a_good_one_on(tiny_dirs):
    prompts = _prompts(4)
    refs = [hf_greedy(tiny_dirs["qwen3"], p) for p in prompts]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    useless = _engine(tiny_dirs, "qwen3", 7, adaptive_draft_len=True)  # random drafter: tau ~1 at 8x the tokens
    _step_costs_by_k(useless)
    outs = useless.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    assert sum(len(o.acceptance_lengths) for o in outs) < 0.5 * 4 * NEW  # mostly plain steps
    good = _engine(tiny_dirs, "qwen3", 7, adaptive_draft_len=True)
    _step_costs_by_k(good)
    force_drafts(good, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.0)
    outs = good.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    assert all(o.tau > 4.0 for o in outs)  # speculation stayed on


def test_greedy_is_lossless_with_a_draft_vocabulary_missing_half_the_tokens(tiny_dirs):
    """A draft vocabulary of half the tokens, ranked as draft_vocab.json ranks them (by how often three of the four
    answers use them, then unused ids): the drafter's logits cover it alone and its drafts map back to the target's
    ids; the fourth answer's tokens outside it are never drafted, the target's own token carries them. Drafts forced
    to rank the true token first in the vocabulary (55% of slots, tests/forced_drafts.py) are accepted deep, and
    every token is transformers' greedy token."""
    prompts = _prompts(4)
    refs = [hf_greedy(tiny_dirs["qwen3"], p) for p in prompts]
    target = load_target(tiny_dirs["qwen3"])
    drafter = load_drafter(tiny_dirs["qwen3_drafter"], target.config)
    vocab_size = target.config.vocab_size
    drafter.draft_vocab = _ranked_vocab(refs[:3], vocab_size)[: vocab_size // 2]
    assert sum(t not in drafter.draft_vocab for t in refs[3]) > 5  # truths the drafter cannot draft
    engine = LLMEngine(target, None, drafter, EngineConfig(max_batch_size=4, max_draft_len=7))
    assert engine.runner.draft_vocab_size == vocab_size // 2
    force_tree_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})  # chains: each slot's top
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.tau > 1.5


@pytest.mark.parametrize("rule", ["match", "rejection"])
def test_sampling_follows_the_target_distribution_with_a_draft_vocabulary(small_vocab, rule):
    # Drafts come only from tokens {2, 0}; the rejection rule is given the proposal renormalised over them.
    t, d = small_vocab
    prompt = [1, 3, 0, 2, 1]
    expected = _exact_joint(t, prompt, 1.2, 3, 0.9)
    target = load_target(t)
    drafter = load_drafter(d, target.config)
    drafter.draft_vocab = torch.tensor([2, 0])
    engine = LLMEngine(target, None, drafter, EngineConfig(max_batch_size=1500, max_draft_len=3))
    n = 4500
    params = [SamplingParams(max_new_tokens=4, temperature=1.2, top_k=3, top_p=0.9, seed=s, acceptance=rule,
                             ignore_eos=True) for s in range(n)]
    outs = engine.generate([prompt] * n, params)
    assert sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs) > n / 10  # drafts accepted
    assert_matches([tuple(o.token_ids) for o in outs], expected)


@pytest.mark.parametrize("k, batch", [(3, 1), (7, 2)])
def test_greedy_chains_with_context_lookups_equal_target_greedy(tiny_dirs, monkeypatch, k, batch):
    """Chain steps draft a row's context lookup instead of the drafter's chain where it expects more accepted
    tokens (forced lookups, likelier than the tiny drafter's chains), the drafter's tokens past it: transformers'
    greedy tokens, lookups accepted whole and in part."""
    prompts = _prompts(batch)
    refs = [hf_greedy(tiny_dirs["qwen3"], p) for p in prompts]
    engine = _engine(tiny_dirs, "qwen3", k, rows=batch, lookup_nodes=k)
    force_lookup_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))})
    lookups = _recorded_lookups(monkeypatch)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.tau > 1.5 and set(o.draft_lens) <= set(range(1, k + 1))  # chains
    assert max(a for _, a in lookups) >= 2 and any(0 < a < v for v, a in lookups)


def test_a_chain_row_of_the_rejection_rule_keeps_the_drafters_drafts(tiny_dirs, monkeypatch):
    """The rejection rule accepts by the drafter's own distribution: its rows never draft a lookup; a greedy row
    beside it does."""
    prompts = _prompts(2)
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, lookup_nodes=3)
    force_lookup_drafts(engine, {i: p + hf_greedy(tiny_dirs["qwen3"], p) for i, p in enumerate(prompts)})
    seen = []
    real = ContextLookup.observe
    monkeypatch.setattr(ContextLookup, "observe", lambda self, v, a: (seen.append(self), real(self, v, a)))
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=1.0, seed=1, acceptance="rejection")
    outs = engine.generate(prompts, [greedy, sampled])
    assert outs[0].token_ids == hf_greedy(tiny_dirs["qwen3"], prompts[0])
    assert seen and len({id(x) for x in seen}) == 1  # one request's lookups only: the greedy row's


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_at_the_context_end_and_rows_that_finish_mid_block_beside_others(tiny_dirs, tree):
    """Drafts the target accepts whole (K=15) run into max_model_len: the last steps' drafts are clipped to the room
    left, and prompt + max_new_tokens == max_model_len ends exactly there. In the same batch: max_new_tokens=1, a stop
    token that is the first generated token, and one inside a block; the other rows go on with the target's greedy
    tokens, and a request aborted mid-run leaves its row to a queued one."""
    prompts = _prompts(4)
    longest = max(len(p) for p in prompts)
    mml = longest + 25
    refs = [hf_greedy(tiny_dirs["qwen3"], p, new=mml - len(p)) for p in prompts]
    cfg = {"draft_tree": {4: 15}} if tree else {}
    engine = _engine(tiny_dirs, "qwen3", 15, rows=3, max_model_len=mml, **cfg)
    last = max(range(4), key=lambda i: len(prompts[i]))  # its prompt + max_new_tokens is max_model_len
    truth = {row: prompts[i] + refs[i] for row, i in enumerate((last, 1, 2))}  # rows in the order of arrival
    force_tree_drafts(engine, truth) if tree else force_drafts(engine, truth, error_rate=0.0)
    stop_inside = refs[1][6]
    params = {last: SamplingParams(max_new_tokens=mml - longest, ignore_eos=True),
              1: SamplingParams(max_new_tokens=mml, stop_token_ids=[stop_inside]),
              2: SamplingParams(max_new_tokens=1, ignore_eos=True),
              0: SamplingParams(max_new_tokens=9, stop_token_ids=[refs[0][0]])}
    assert len(params) == 4
    seqs = {i: engine.add_request(prompts[i], params[i]) for i in (last, 1, 2, 0)}
    while engine.has_unfinished():
        engine.step()
    assert seqs[last].output_ids == refs[last] and len(refs[last]) == mml - longest
    assert seqs[last].num_tokens == mml and seqs[last].finish_reason == "length"
    assert seqs[1].output_ids == refs[1][: refs[1].index(stop_inside) + 1] and seqs[1].finish_reason == "stop"
    assert seqs[2].output_ids == refs[2][:1] and seqs[2].finish_reason == "length"
    assert seqs[0].output_ids == refs[0][:1] and seqs[0].finish_reason == "stop"
    assert max(a for s in seqs.values() for a in s.stats.acceptance_lengths) > 4  # long blocks were accepted
    assert tree or min(seqs[last].stats.draft_lens) < 15  # and the room left clipped the drafts
    assert engine.scheduler.slots.num_used == 0
    # an abort mid-run: the queued request takes its row; the row is freed once (SlotAllocator asserts)
    a, b, c, d = (engine.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in prompts)
    engine.step()
    engine.step()
    assert engine.abort(b.request_id)
    while engine.has_unfinished():
        engine.step()
    assert b.finish_reason == "abort" and not engine.abort(b.request_id)
    for s, p in zip((a, c, d), (prompts[0], prompts[2], prompts[3])):
        assert s.output_ids == hf_greedy(tiny_dirs["qwen3"], p, new=20)
    assert engine.scheduler.slots.num_used == 0


@pytest.mark.parametrize("temperature", [1e-38, 1e-44, 1e-6])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(tiny_dirs, temperature):
    # logits / 1e-38 overflow fp32 to inf, whose softmax is NaN: sampled, such a request wrote garbage
    p = _prompts(2)[1]
    out = _engine(tiny_dirs, "qwen3", 3, rows=1).generate(
        [p], SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=temperature, seed=0))[0]
    assert out.token_ids == hf_greedy(tiny_dirs["qwen3"], p)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


def test_a_long_prompt_joining_short_rows_drafts_from_its_whole_context_without_padding_them(tiny_dirs):
    """A 150-token prompt joins three rows in steady decoding: its stretch of prompt features goes into the drafter's
    cache alone (padded beside it, the three rows would carry 150 entries each), and its drafts are the ones it gets
    served alone; every answer is transformers' greedy one."""
    g = torch.Generator().manual_seed(11)
    short = _prompts(3)
    long = torch.randint(3, 90, (150,), generator=g).tolist()
    alone = _engine(tiny_dirs, "qwen3", 3, rows=1).generate([long], SamplingParams(max_new_tokens=NEW, ignore_eos=True))

    engine = _engine(tiny_dirs, "qwen3", 3, rows=4)
    batches = []
    real = engine.runner.proposer.propose

    def propose(rows, features, *args, **kw):
        batches.append(tuple(features.shape[:2]))
        return real(rows, features, *args, **kw)

    engine.runner.proposer.propose = propose
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in short]
    for _ in range(4):
        engine.step()
    seqs.append(engine.add_request(long, params))
    while engine.has_unfinished():
        engine.step()
    outs = [engine.make_output(s) for s in seqs]
    for p, o in zip([*short, long], outs):
        assert o.token_ids == hf_greedy(tiny_dirs["qwen3"], p)
    assert outs[-1].acceptance_lengths == alone[0].acceptance_lengths
    assert max(n for b, n in batches if b == 4) <= 4  # K + 1: no row padded to the long one's 150


def test_rows_that_all_go_alone_into_the_drafters_cache_still_draft_from_their_context(tiny_dirs):
    """Four prompts prefilled together (20-150 tokens) each go into the drafter's cache alone before the first step,
    which then drafts with no context features left to inject; drafts match each prompt served alone."""
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (20, 25, 30, 150)]
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    engine = _engine(tiny_dirs, "qwen3", 3, rows=4)
    widths = []
    real = engine.runner.proposer.propose
    engine.runner.proposer.propose = lambda rows, features, *a, **kw: (widths.append(features.shape[1]),
                                                                       real(rows, features, *a, **kw))[1]
    outs = engine.generate(prompts, params)
    assert widths[0] == 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(tiny_dirs["qwen3"], p)
        (alone,) = _engine(tiny_dirs, "qwen3", 3, rows=1).generate([p], params)
        assert o.acceptance_lengths == alone.acceptance_lengths


# --- sliding-window targets: the window hides keys in verify steps and trees as in plain decoding ----------------

@pytest.fixture(scope="module")
def sliding_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sliding")
    mistral = make_target(root / "mistral", "mistral", seed=13, sliding_window=6)
    qwen3 = make_target(root / "qwen3", "qwen3", seed=14, use_sliding_window=True, sliding_window=6,
                        max_window_layers=1)
    return {"mistral": mistral, "qwen3": qwen3,
            "mistral_drafter": make_drafter(root / "md", mistral, block_size=8, target_layer_ids=(1, 3)),
            "qwen3_drafter": make_drafter(root / "qd", qwen3, block_size=8, target_layer_ids=(1, 3))}


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
@pytest.mark.parametrize("k, tree", [(3, 0), (3, 5), (7, 10)], ids=["chain", "tree", "tree-deeper-than-the-window"])
def test_greedy_speculation_over_a_sliding_window_target_equals_its_greedy(sliding_dirs, arch, k, tree):
    """Windows of 6 keys, answers of 40 tokens: verify blocks and trees cross the window every step; a tree's nodes
    past depth 5 lose their shallowest ancestors from the window too."""
    prompts = _prompts(2)
    refs = [hf_greedy(sliding_dirs[arch], p) for p in prompts]
    engine = _engine(sliding_dirs, arch, k, rows=2, **({"draft_tree": {2: tree}} if tree else {}))
    truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    force_tree_drafts(engine, truth) if tree else force_drafts(engine, truth, error_rate=0.1)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for o, ref in zip(outs, refs):
        assert o.token_ids == ref
        assert o.tau > 1.5


@pytest.mark.parametrize("tree", [False, True])
def test_a_seeded_match_sample_over_a_sliding_window_target_is_its_plain_sample(sliding_dirs, tree):
    prompts, seeds = _prompts(2), [5, 6]
    refs = [hf_sample(sliding_dirs["mistral"], p, s, 1.0) for p, s in zip(prompts, seeds)]
    engine = _engine(sliding_dirs, "mistral", 3, rows=2, **({"draft_tree": {2: 5}} if tree else {}))
    truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    force_tree_drafts(engine, truth) if tree else force_drafts(engine, truth, error_rate=0.2)
    params = [SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    for o, ref in zip(engine.generate(prompts, params), refs):
        assert o.token_ids == ref
        assert o.tau > 1.5


def test_bf16_speculation_over_a_sliding_window_target_equals_bf16_plain_decoding(sliding_dirs):
    prompts = _prompts(2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    plain = _engine(sliding_dirs, "mistral", 3, rows=2, dtype="bfloat16", speculative=False).generate(prompts, params)
    spec = _engine(sliding_dirs, "mistral", 3, rows=2, dtype="bfloat16", draft_tree={2: 5})
    truth = {i: p + o.token_ids for i, (p, o) in enumerate(zip(prompts, plain))}
    force_tree_drafts(spec, truth)
    for o, ref in zip(spec.generate(prompts, params), plain):
        assert o.token_ids == ref.token_ids
