"""The lossless contract where sampled rows share a batch with other rules, and where a request shapes the target's
logits: every sampled row follows the target's own distribution under its settings, every greedy row is the target's
greedy continuation.

Oracles: the exact joint distribution of 4 new tokens over a 4-token vocabulary (256 outcomes), enumerated from
transformers' logits, against the engine's samples by Pearson's chi-square at significance 1e-4 (tests/stats.py);
greedy rows against transformers' generate (tests/engine/test_lossless.py hf_greedy). Seeds are fixed: each test is
deterministic.

Statistical power, at 600-1,200 samples per group:
- the settings put a top-k or top-p boundary within about 0.5-1% of probability of the kept mass after some likely
  prefixes (far beyond float32's rounding, so the correct engine stays on its side): in the mixed batch a
  temperature 10% off, under the penalties a penalty off by 0.1, moves a token across it, which puts 5-30% of the
  probability on outcomes of probability 0 (chi2_statistic returns inf at the first) or takes it from them;
- inside the support the joints pool to 15-65 degrees of freedom, whose 1e-4 critical values are 45-115; an engine
  off by a chi-square divergence D moves the statistic's mean by n * D, and n * D >= 100 is caught with probability
  above 0.98. Smooth errors smaller than that are not: where no boundary is near, a temperature 10% high changes this
  tiny model's per-token probabilities by 1-2% (its logits span ~1), n * D ~ 5.
test_the_chi_square_check_tells_slightly_different_settings_apart runs the check on the samples themselves.
"""

import itertools

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dflash_trt import SamplingParams
from dflash_trt.engine import model_runner
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.kernels.verify_block import GREEDY, MATCH, REJECTION
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from tests.conftest import make_drafter, make_target
from tests.engine.conftest import V
from tests.engine.test_lossless import _exact_joint, hf_greedy
from tests.stats import assert_matches, chi2_critical, chi2_statistic

NEW = 4  # V ** NEW = 256 outcomes, enumerated exactly
_runs: dict = {}  # engine runs that more than one test reads, by (target, what was run)


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    """A 4-token target of two layers (half the per-row prompt cost of small_vocab's four) and its drafter."""
    root = tmp_path_factory.mktemp("sampling_mixed")
    t = make_target(root / "t", vocab=V, seed=11, layers=2)
    return t, make_drafter(root / "d", t, block_size=8, target_layer_ids=(0, 1), seed=12)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny model's forwards are too small to split between threads: one runs them fastest, whatever else
    shares the machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(dirs, rows, draft_vocab=None, **cfg) -> LLMEngine:
    t, d = dirs
    target = load_target(t)
    drafter = load_drafter(d, target.config)
    if draft_vocab is not None:
        drafter.draft_vocab = torch.tensor(draft_vocab)
    return LLMEngine(target, None, drafter, EngineConfig(max_batch_size=rows, max_draft_len=3, **cfg))


def _accepted(outs) -> int:
    """Draft tokens the verify steps kept (each step's acceptance length counts its bonus token too)."""
    return sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs)


# --- rows of the three rules in one batch ------------------------------------------------------------------------

REJECTION_PROMPT, MATCH_PROMPT = [1, 2], [1, 3, 0, 2, 1]
REJECTION_ROWS = dict(temperature=1.2, top_k=3, top_p=0.76, acceptance="rejection")
MATCH_ROWS = dict(temperature=0.7, top_p=0.76)
GREEDY_PROMPTS = [[1, 3, 2, 2, 1], [2, 1, 3, 3], [2, 3, 3, 2, 1, 1, 3]]  # no token 0: hf_greedy pads with it
DRAFT_VOCAB = [2, 0, 1]  # token 3 is never drafted
CYCLE = ["rejection", "match", "rejection", "match", "greedy"]
MIXED_ROWS = 2500  # 1,000 rows of each sampled rule, 500 greedy


def _mixed_batch(dirs) -> tuple[list, list, list, list]:
    """MIXED_ROWS requests, rows cycling CYCLE, in one engine of 1,250 rows -> (kinds, prompts, outputs, each
    dflash::verify_block call's row modes and draft probabilities) (run once)."""
    key = (str(dirs[0]), "mixed")
    if key not in _runs:
        kinds = [CYCLE[s % len(CYCLE)] for s in range(MIXED_ROWS)]
        prompts = [REJECTION_PROMPT if k == "rejection" else MATCH_PROMPT if k == "match"
                   else GREEDY_PROMPTS[s // len(CYCLE) % len(GREEDY_PROMPTS)] for s, k in enumerate(kinds)]
        settings = {"rejection": REJECTION_ROWS, "match": MATCH_ROWS, "greedy": {}}
        params = [SamplingParams(max_new_tokens=NEW, seed=s, ignore_eos=True, **settings[k])
                  for s, k in enumerate(kinds)]
        engine = _engine(dirs, rows=1250, draft_vocab=DRAFT_VOCAB)
        calls, real = [], model_runner.verify_block

        def verify_block(drafts, logits, draft_probs, uniforms, modes, *rest):
            calls.append((modes.tolist(), None if draft_probs is None else draft_probs.clone()))
            return real(drafts, logits, draft_probs, uniforms, modes, *rest)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(model_runner, "verify_block", verify_block)
            outs = engine.generate(prompts, params)
        _runs[key] = kinds, prompts, outs, calls
    return _runs[key]


def _group(outs, kinds, kind) -> list:
    return [o for o, k in zip(outs, kinds) if k == kind]


def _rows_joint(target_dir, prompt, rows: dict) -> dict:
    """_exact_joint under a group's settings (REJECTION_ROWS, MATCH_ROWS)."""
    return _exact_joint(target_dir, prompt, rows["temperature"], rows.get("top_k", 0), rows.get("top_p", 1.0), new=NEW)


def test_rejection_match_and_greedy_rows_in_one_batch_each_follow_their_own_rule(two_layers):
    """One batch whose rows cycle rejection, match, rejection, match, greedy: the "rejection" rule at temperature 1.2
    with top-k 3 and top-p 0.76, the "match" rule at temperature 0.7 with top-p 0.76 (another prompt), greedy rows
    (three more prompts). A draft vocabulary {2, 0, 1} restricts the drafter, so the rejection rows' proposal is
    scattered back over the whole vocabulary, zero at token 3. Each sampled group follows its own exact joint
    distribution, each greedy row is transformers' greedy continuation: no row takes another's rule, settings, draft
    probabilities or uniforms."""
    t, _ = two_layers
    kinds, prompts, outs, calls = _mixed_batch(two_layers)
    rejection, match = _group(outs, kinds, "rejection"), _group(outs, kinds, "match")
    assert _accepted(rejection) > 100 and _accepted(match) > 100  # the verify steps kept drafts of both rules
    assert_matches([tuple(o.token_ids) for o in rejection], _rows_joint(t, REJECTION_PROMPT, REJECTION_ROWS))
    assert_matches([tuple(o.token_ids) for o in match], _rows_joint(t, MATCH_PROMPT, MATCH_ROWS))
    for prompt, o, kind in zip(prompts, outs, kinds):
        if kind == "greedy":
            assert o.token_ids == hf_greedy(t, prompt, new=NEW)

    # the steps really mixed the rules; the rejection rows' proposals are distributions over the draft vocabulary
    assert any(set(modes) == {GREEDY, MATCH, REJECTION} for modes, _ in calls)
    for modes, draft_probs in calls:
        rows = torch.tensor(modes) == REJECTION
        if draft_probs is None:  # a step after the last rejection row finished
            assert not rows.any()
            continue
        assert torch.allclose(draft_probs[rows].sum(-1), torch.tensor(1.0))
        assert (draft_probs[rows][..., 3] == 0).all() and (draft_probs[~rows] == 0).all()


# --- penalties, logit_bias, allowed_token_ids: the target's distribution is the shaped one -----------------------

PENALIZED_PROMPT = [1, 3, 0, 2, 1]
PENALIZED = dict(temperature=1.2, top_k=3, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.4,
                 presence_penalty=0.3, logit_bias={0: 0.7, 3: -0.4})
PENALIZED_ROWS = 1200


def _penalized_joint(target_dir, prompt, params: SamplingParams, new=NEW) -> dict:
    """P(x_1..x_new | prompt) under the request's logit shaping, by enumeration: transformers' logits at each
    position, plus logit_bias, transformers' RepetitionPenaltyLogitsProcessor over the prompt and the tokens before
    it, minus frequency_penalty times each token's count in the output so far and presence_penalty once for each token
    it holds (OpenAI's and vLLM's definitions), allowed_token_ids, then transformers' temperature, top-k and top-p
    warpers, in transformers' order."""
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    seqs = list(itertools.product(range(V), repeat=new))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logits = hf(ids).logits[:, len(prompt) - 1: -1].float()
    warpers = [TemperatureLogitsWarper(params.temperature)]
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    joint = torch.ones(len(seqs), dtype=torch.float64)
    for j in range(new):
        before, output = ids[:, : len(prompt) + j], ids[:, len(prompt): len(prompt) + j]
        scores = logits[:, j].clone()
        for token, bias in (params.logit_bias or {}).items():
            scores[:, token] += bias
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(before, scores)
        counts = torch.zeros(len(seqs), V).scatter_add_(1, output, torch.ones(output.shape))
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
        if params.allowed_token_ids is not None:
            blocked = torch.ones(V, dtype=torch.bool)
            blocked[params.allowed_token_ids] = False
            scores = scores.masked_fill(blocked, -torch.inf)
        for warp in warpers:
            scores = warp(before, scores)
        joint *= torch.softmax(scores, -1).gather(1, ids[:, len(prompt) + j, None])[:, 0].double()
    return {s: float(p) for s, p in zip(seqs, joint)}


def _penalized_samples(dirs, rule: str, tree: bool) -> list:
    """PENALIZED_ROWS seeded requests under PENALIZED and `rule`, drafting chains or 5-node trees (run once)."""
    key = (str(dirs[0]), rule, tree)
    if key not in _runs:
        engine = _engine(dirs, rows=PENALIZED_ROWS, **({"draft_tree": {PENALIZED_ROWS: 5}} if tree else {}))
        params = [SamplingParams(max_new_tokens=NEW, seed=s, acceptance=rule, ignore_eos=True, **PENALIZED)
                  for s in range(PENALIZED_ROWS)]
        outs = engine.generate([PENALIZED_PROMPT] * PENALIZED_ROWS, params)
        assert _accepted(outs) > PENALIZED_ROWS / 10  # drafts were accepted, the penalties counting them as output
        assert all(max(o.draft_lens) == 5 for o in outs) if tree else all(max(o.draft_lens) <= 3 for o in outs)
        _runs[key] = [tuple(o.token_ids) for o in outs]
    return _runs[key]


@pytest.mark.parametrize("rule, tree", [("match", False), ("match", True), ("rejection", False)],
                         ids=["match chain", "match tree", "rejection chain"])
def test_penalized_samples_follow_the_penalized_target_distribution(two_layers, rule, tree):
    """Repetition, frequency and presence penalties and logit_bias with temperature, top-k 3 and top-p 0.9: every
    verified position's logits are shaped with the drafts before it (in a tree, the node's path) counted as output, so
    the samples follow the joint distribution of decoding one token at a time under the same settings; under the
    "rejection" rule the drafter's unshaped proposal is corrected to it."""
    t, _ = two_layers
    expected = _penalized_joint(t, PENALIZED_PROMPT, SamplingParams(**PENALIZED))
    assert_matches(_penalized_samples(two_layers, rule, tree), expected)


def test_samples_under_allowed_token_ids_follow_the_masked_target_distribution(two_layers):
    """allowed_token_ids {0, 1, 3} with the penalties and top-k 2 under the "match" rule: token 2 is never chosen, and
    top-k keeps the two likeliest of the allowed tokens after the penalties (masking after top-k would leave one
    wherever token 2 is among the two likeliest)."""
    t, _ = two_layers
    n = 600  # 16 possible outcomes: df 15, critical value 45
    settings = {**PENALIZED, "top_k": 2, "top_p": 1.0, "allowed_token_ids": [0, 1, 3]}
    params = [SamplingParams(max_new_tokens=NEW, seed=s, ignore_eos=True, **settings) for s in range(n)]
    outs = _engine(two_layers, rows=n).generate([PENALIZED_PROMPT] * n, params)
    assert _accepted(outs) > n / 10
    expected = _penalized_joint(t, PENALIZED_PROMPT, SamplingParams(**settings))
    assert_matches([tuple(o.token_ids) for o in outs], expected)


# --- a negative control: the check has the power to tell these samples from slightly different settings -----------

@pytest.mark.parametrize("samples, change", [
    ("penalized match chain", {"frequency_penalty": 0.3}),
    ("penalized match chain", {"presence_penalty": 0.2}),
    ("penalized match chain", {"repetition_penalty": 1.2}),
    ("penalized match chain", {"logit_bias": {0: 0.5, 3: -0.4}}),
    ("mixed batch, match rows", {"temperature": 0.77}),
    ("mixed batch, match rows", {"temperature": 0.63}),
    ("mixed batch, rejection rows", {"temperature": 1.08}),
], ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_the_chi_square_check_tells_slightly_different_settings_apart(two_layers, samples, change):
    """The samples that pass their checks above fail the same check against the joint distribution of one setting
    changed a little (a penalty by 0.1 or 0.2, the temperature by 10%): the checks have the power to see such an
    error in the engine."""
    t, _ = two_layers
    if samples == "penalized match chain":
        drawn = _penalized_samples(two_layers, "match", False)
        expected = _penalized_joint(t, PENALIZED_PROMPT, SamplingParams(**{**PENALIZED, **change}))
    else:
        kinds, _, outs, _ = _mixed_batch(two_layers)
        kind, prompt, rows = (("match", MATCH_PROMPT, MATCH_ROWS) if samples.endswith("match rows")
                              else ("rejection", REJECTION_PROMPT, REJECTION_ROWS))
        drawn = [tuple(o.token_ids) for o in _group(outs, kinds, kind)]
        expected = _rows_joint(t, prompt, {**rows, **change})
    stat, df = chi2_statistic(drawn, expected)
    assert stat > chi2_critical(df), f"chi2={stat:.1f} within the critical value {chi2_critical(df):.1f} (df={df})"
