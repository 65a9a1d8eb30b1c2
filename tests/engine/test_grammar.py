"""Structured output keeps the contract: the answer is the target's own choice among the tokens its grammar allows, at
every position, speculative or not. Greedy: token for token against transformers' model masked by an independent
oracle (Python's `regex` partial matching over the character tokenizer, or llguidance's own matcher for JSON
schemas); sampling: in distribution, against the exact masked joint."""

import json

import llguidance
import llguidance.hf
import pytest
import regex
import torch
from transformers import AutoModelForCausalLM

from dflash_trt import SamplingParams, StructuredOutput
from dflash_trt.engine.grammar import GrammarError
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.models.tokenizer import load_tokenizer
from tests.conftest import EOS, make_drafter, make_target
from tests.forced_drafts import force_drafts, force_lookup_drafts, force_tree_drafts
from tests.stats import assert_matches

NEW = 40
# a prompt per pattern; each allows several tokens at most positions, and ends where the model's eos is all it allows
PATTERNS = [r"[a-e]{2}( [a-e]+)*\.", r"(yes|no|maybe)!", r"x[0-9]+(,[0-9]+)*;"]
_hf: dict = {}


def _prompts(tok) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in ("Say: abc ", "Answer? ", "List 1,2 ")]


def _engine(dirs, arch: str, k: int, rows: int, **cfg) -> LLMEngine:
    config = EngineConfig(max_batch_size=rows, max_draft_len=k, **cfg)
    target = load_target(dirs[arch], config.torch_dtype)
    drafter = load_drafter(dirs[f"{arch}_drafter"], target.config, config.torch_dtype)
    return LLMEngine(target, load_tokenizer(dirs[arch], target.config.vocab_size), drafter, config)


def regex_allowed(tok, pattern: str, text: str) -> list[int]:
    """The oracle's mask: the character tokens after which the text can still become a match, and eos where it is
    one (Python's `regex`, not the grammar engine the runtime uses)."""
    ok = [i for i in range(3, len(tok)) if regex.fullmatch(pattern, text + tok.decode([i]), partial=True)]
    return ok + [EOS] * bool(regex.fullmatch(pattern, text))


def hf_masked_greedy(target_dir, prompt: list[int], allowed_after, new: int = NEW,
                     bias: dict[int, float] | None = None) -> list[int]:
    """transformers' greedy answer with every token but those allowed_after(output so far) masked out (bias: added
    to the logits first, as a request's logit_bias)."""
    key = str(target_dir)
    if key not in _hf:
        _hf[key] = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    out: list[int] = []
    with torch.no_grad():
        while len(out) < new and (not out or out[-1] != EOS):
            logits = _hf[key](torch.tensor([prompt + out])).logits[0, -1]
            for token, add in (bias or {}).items():
                logits[token] += add
            allowed = allowed_after(out)
            out.append(allowed[int(logits[allowed].argmax())])
    return out


@pytest.fixture(scope="module")
def regex_refs(tiny_dirs):
    """Each arch's oracle answer to each prompt under its pattern."""
    refs = {}
    for arch in ("qwen3", "llama"):
        tok = load_tokenizer(tiny_dirs[arch], 100)
        refs[arch] = [hf_masked_greedy(tiny_dirs[arch], p, lambda out, pat=pat: regex_allowed(tok, pat,
                                                                                                tok.decode(out)))
                      for p, pat in zip(_prompts(tok), PATTERNS)]
    return refs


def _check_answers(engine, outs, refs) -> None:
    for out, ref, pattern in zip(outs, refs, PATTERNS):
        assert out.token_ids == ref
        if out.finish_reason == "stop":
            assert regex.fullmatch(pattern, out.text)
    assert any(o.finish_reason == "stop" for o in outs)  # a grammar's end reached: eos is then all it allows


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("shape, cfg", [
    ("chain K=3", dict(k=3)), ("chain K=7", dict(k=7)), ("chain K=3 with lookups", dict(k=3, lookup_nodes=3)),
    ("tree of 5", dict(k=3, draft_tree={3: 5})),
    ("tree of 6 with lookups", dict(k=7, draft_tree={3: 6}, lookup_nodes=7)),
])
@pytest.mark.parametrize("forced", [False, True], ids=["drafter", "forced drafts"])
def test_greedy_answers_under_a_regex_are_the_targets_masked_greedy(tiny_dirs, regex_refs, arch, shape, cfg, forced):
    """Forced drafts carry the oracle's answer with a tenth of them wrong (many of those refused by the grammar, so
    the positions behind them are never reached); the random drafter's are mostly refused or rejected."""
    cfg = dict(cfg)
    engine = _engine(tiny_dirs, arch, cfg.pop("k"), rows=3, **cfg)
    prompts, refs = _prompts(engine.tokenizer), regex_refs[arch]
    if forced:
        truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
        if "draft_tree" in cfg:
            force_tree_drafts(engine, truth)
        else:
            force_drafts(engine, truth, error_rate=0.1)
        if cfg.get("lookup_nodes"):
            force_lookup_drafts(engine, truth)
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=NEW, structured=StructuredOutput(regex=p))
                                     for p in PATTERNS])
    _check_answers(engine, outs, refs)
    if forced:
        assert all(o.tau > 1.5 for o in outs if len(o.token_ids) > 10)


@pytest.mark.parametrize("tree", [{}, {4: 5}], ids=["chain", "tree"])
def test_greedy_answers_under_a_regex_beside_a_sampled_row_are_the_targets_masked_greedy(tiny_dirs, regex_refs, tree):
    """A sampled row takes the batch through the full head's masked logits (not the greedy rows' argmax, taken
    again only where the grammar refuses it)."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=4, draft_tree=tree)
    prompts = _prompts(engine.tokenizer)
    truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, regex_refs["qwen3"]))}
    force_drafts(engine, truth | {3: [5, 6, 7] + [10] * NEW}, error_rate=0.1)
    params = [SamplingParams(max_new_tokens=NEW, structured=StructuredOutput(regex=p)) for p in PATTERNS]
    outs = engine.generate(prompts + [[5, 6, 7]], params + [SamplingParams(max_new_tokens=NEW, temperature=1.0,
                                                                            seed=3, ignore_eos=True)])
    _check_answers(engine, outs[:3], regex_refs["qwen3"])


def test_a_grammar_rows_chain_drafts_only_what_its_grammar_allows(tiny_dirs, regex_refs):
    """The random drafter's chains would be refused at almost every slot; drafted among what the grammar allows after
    the drafts before, each chain continues the answer within its pattern (the oracle's partial match), up to an eos
    past which the grammar allows nothing."""
    engine = _engine(tiny_dirs, "qwen3", 7, rows=3)
    runner, tok, seen = engine.runner, engine.tokenizer, []
    real_step, real_propose = runner.spec_step, runner.proposer.propose

    def spec_step(seqs, k):
        seen.append([(s.params.structured.regex, list(s.output_ids)) for s in seqs])
        return real_step(seqs, k)

    def propose(*args, **options):
        out = real_propose(*args, **options)
        seen[-1] = [(*row, drafts) for row, drafts in zip(seen[-1], out.draft_tokens.tolist())]
        return out

    runner.spec_step, runner.proposer.propose = spec_step, propose
    outs = engine.generate(_prompts(tok), [SamplingParams(max_new_tokens=NEW, structured=StructuredOutput(regex=p))
                                           for p in PATTERNS])
    _check_answers(engine, outs, regex_refs["qwen3"])
    chains = [(pattern, done, d[: d.index(EOS)] if EOS in d else d) for step in seen for pattern, done, d in step]
    assert len(chains) > 10 and sum(len(chain) for _, _, chain in chains) > 30
    for pattern, done, chain in chains:
        assert regex.fullmatch(pattern, tok.decode(done + chain), partial=True)


def test_a_grammar_rows_tree_drafts_its_first_slot_within_its_grammar(tiny_dirs, regex_refs):
    """A tree's first slot holds the likeliest tokens the grammar allows next (its deeper slots are masked along the
    chain of top tokens): every depth-1 node continues the answer within its pattern."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=3, draft_tree={3: 3})
    runner, tok, seen = engine.runner, engine.tokenizer, []
    real_step, real_propose = runner.tree_step, runner.proposer.propose_tree

    def tree_step(seqs, depth, nodes):
        seen.append([(s.params.structured.regex, list(s.output_ids)) for s in seqs])
        return real_step(seqs, depth, nodes)

    def propose_tree(*args, **options):
        tree = real_propose(*args, **options)
        seen[-1] = [(*row, [t for t, d in zip(tokens, depths) if d == 1])
                    for row, tokens, depths in zip(seen[-1], tree.node_tokens, tree.depths.tolist())]
        return tree

    runner.tree_step, runner.proposer.propose_tree = tree_step, propose_tree
    outs = engine.generate(_prompts(tok), [SamplingParams(max_new_tokens=NEW, structured=StructuredOutput(regex=p))
                                           for p in PATTERNS])
    _check_answers(engine, outs, regex_refs["qwen3"])
    firsts = [(pattern, done, t) for step in seen for pattern, done, slot in step for t in slot]
    assert len(firsts) > 20
    for pattern, done, t in firsts:
        assert regex.fullmatch(pattern, tok.decode(done + [t]), partial=True) or (t == EOS and regex.fullmatch(
            pattern, tok.decode(done)))


def test_plain_decoding_under_a_regex_is_the_targets_masked_greedy(tiny_dirs, regex_refs):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=3, speculative=False)
    outs = engine.generate(_prompts(engine.tokenizer), [
        SamplingParams(max_new_tokens=NEW, structured=StructuredOutput(regex=p)) for p in PATTERNS])
    _check_answers(engine, outs, regex_refs["qwen3"])


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def braces_dirs(tmp_path_factory):
    """A target whose 100 tokens reach "}" (the tiny targets' 96 end at "|") and its drafter."""
    root = tmp_path_factory.mktemp("grammar_braces")
    t = make_target(root / "qwen3", vocab=100, seed=23)
    return {"qwen3": t, "qwen3_drafter": make_drafter(root / "d", t, block_size=8, seed=24)}


def test_greedy_answers_under_a_json_schema_are_the_targets_masked_greedy_and_valid(braces_dirs):
    """The oracle's masks come from llguidance's matcher driven by the oracle's own loop (not the runtime's)."""
    engine = _engine(braces_dirs, "qwen3", 7, rows=2)
    tok = engine.tokenizer
    table = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Chars(tok)), n_vocab=100, eos_token=EOS)

    def allowed_after(out):
        m = llguidance.LLMatcher(table, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
        assert m.consume_tokens(out)
        bits = m.compute_bitmask()
        return [i for i in range(100) if bits[i // 8] >> (i % 8) & 1]

    prompts = [tok.encode(t, add_special_tokens=False) for t in ('{"id": 7, ', "JSON please: ")]
    refs = [hf_masked_greedy(braces_dirs["qwen3"], p, allowed_after, new=60) for p in prompts]
    truth = {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}
    force_drafts(engine, truth, error_rate=0.1)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=60, structured=StructuredOutput(json=SCHEMA)))
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref and out.finish_reason == "stop"
        value = json.loads(out.text)
        assert set(value) == {"id", "tag", "ok"} and 0 <= value["id"] <= 999
        assert value["tag"] in ("red", "green", "blue")
        assert isinstance(value["ok"], bool) and out.tau > 1.5


class _Chars:
    """The character tokenizer as llguidance's TokenizerWrapper reads a tokenizer: each id's bytes."""

    def __init__(self, tok) -> None:
        self.eos_token_id, self.bos_token_id, self.special_token_ids = EOS, 1, [0, 1, 2]
        self.tokens = [b"<unk>", b"<s>", b"</s>"] + [tok.decode([i]).encode() for i in range(3, len(tok))]
        self._tok = tok

    def __call__(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)


def test_a_choice_answer_is_one_of_the_choices_as_the_masked_target_picks_it(tiny_dirs):
    engine = _engine(tiny_dirs, "llama", 3, rows=1)
    tok = engine.tokenizer
    choices = ["a+b", "a-b (x)", "[ok]", "b"]
    pattern = "|".join(regex.escape(c) for c in choices)
    prompt = tok.encode("Pick: ", add_special_tokens=False)
    ref = hf_masked_greedy(tiny_dirs["llama"], prompt, lambda out: regex_allowed(tok, pattern, tok.decode(out)))
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=20, structured=StructuredOutput(choice=choices)))
    assert out.token_ids == ref and out.text in choices


@pytest.mark.parametrize("spec, says", [
    (StructuredOutput(regex="[a-"), "regex"), (StructuredOutput(grammar="start: x"), "grammar"),
    (StructuredOutput(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json"),
])
def test_a_grammar_that_does_not_compile_is_refused_with_its_reason_before_queueing(tiny_dirs, spec, says):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1)
    with pytest.raises(GrammarError, match=f"the {says} does not compile: .+"):
        engine.add_request([5, 6], SamplingParams(structured=spec))
    assert not engine.has_unfinished()


def test_an_answer_the_grammar_needs_a_character_the_vocabulary_lacks_for_ends_at_eos_where_it_gets_stuck(tiny_dirs):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1)  # its 96 tokens end at "|"
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, structured=StructuredOutput(regex=r"ab\}")))
    assert out.text == "ab" and out.token_ids[-1] == EOS and out.finish_reason == "stop"


def test_a_grammar_that_fails_while_decoding_ends_its_request_alone_with_the_reason(tiny_dirs):
    """llguidance takes this grammar, then hits its parser's limit a few tokens in: that request ends in an error that
    says so, and the request beside it answers as it would alone (a raise in the step failed both)."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    alone = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    failing = SamplingParams(max_new_tokens=NEW, structured=StructuredOutput(grammar='start: "a"+ start'))
    outs = engine.generate([[8, 9], [5, 6, 7]], [failing, SamplingParams(max_new_tokens=NEW, ignore_eos=True)])
    assert outs[0].finish_reason == "error" and "Too many items" in outs[0].error
    assert set(outs[0].text) == {"a"} and "\n" not in outs[0].error  # its first line, not llguidance's state dump
    assert outs[1].token_ids == alone.token_ids and outs[1].error is None


def test_a_parser_limit_only_a_draft_runs_into_leaves_the_request_as_plain_decoding_finds_it(tiny_dirs):
    """Three a's take llguidance's parser past its limit (and a rollback from there fails, sticky); the target that
    answers "b" never writes them, and decoding plainly never meets the limit."""
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1)
    tok = engine.tokenizer
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    spec = StructuredOutput(grammar='start: "b" | x\nx: "a"+ x')
    grammar, fresh = engine.grammars.grammar(spec), engine.grammars.grammar(spec)
    grammar.blocked([[], [a], [a, a], [a, a, a]], "cpu")
    assert grammar.allows([a, a, a], b) is False and not grammar.failed
    assert torch.equal(grammar.allowed_after([]), fresh.allowed_after([]))
    grammar.commit(b)
    assert not grammar.failed and grammar.allowed_after([]).nonzero().flatten().tolist() == [EOS]


def test_an_answer_ends_where_its_grammar_does_even_where_eos_is_no_stop_token(tiny_dirs):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1)
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=NEW, stop_token_ids=[40],
                                                         structured=StructuredOutput(choice=["ab", "ba"])))
    assert out.text in ("ab", "ba") and out.token_ids[-1] == EOS and out.finish_reason == "stop"


def test_a_schema_that_fails_at_its_first_token_is_refused_before_queueing(tiny_dirs, tmp_path_factory):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1)
    with pytest.raises(GrammarError, match="the json allows no answer"):
        engine.add_request([5, 6], SamplingParams(structured=StructuredOutput(json={"$ref": "#"})))
    # after reasoning too, where its first token is the reasoning's
    with pytest.raises(GrammarError, match="the json allows no answer"):
        engine.add_request([5, 6], SamplingParams(structured=StructuredOutput(json={"$ref": "#"}, reasoning="qwen3")))
    with pytest.raises(GrammarError, match=r"gpt_oss reasoning needs harmony's special tokens; the tokenizer lacks "
                                           r"\['<\|channel\|>', '<\|message\|>', '<\|end\|>', '<\|start\|>'\]"):
        engine.add_request([5, 6], SamplingParams(structured=StructuredOutput(regex="a", reasoning="gpt_oss")))
    # a call's: its function's schema, named; harmony's <|constrain|> too
    with pytest.raises(GrammarError, match="the parameters' schema of 'g' allows no answer"):
        engine.add_request([5, 6], SamplingParams(structured=StructuredOutput(
            calls={"f": {"type": "object"}, "g": {"$ref": "#"}}, reasoning="gpt_oss")))
    harmony = _thinking_dirs(tmp_path_factory.getbasetemp(), HARMONY, True)
    with pytest.raises(GrammarError, match=r"the tokenizer lacks \['<\|constrain\|>'\]"):
        _engine(harmony, "qwen3", 3, rows=1).add_request([5, 6], SamplingParams(structured=StructuredOutput(
            calls={"f": {"type": "object"}}, reasoning="gpt_oss")))
    assert not engine.has_unfinished()


def test_gbnf_is_read_as_lark(tiny_dirs):
    engine = _engine(tiny_dirs, "qwen3", 3, rows=1)
    gbnf = 'root ::= "x" digit digit\ndigit ::= [0-9]'
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, structured=StructuredOutput(grammar=gbnf)))
    assert regex.fullmatch("x[0-9][0-9]", out.text) and out.finish_reason == "stop"


# --- reasoning first: the grammar holds what follows a thinking model's reasoning ------------------------------------

THINK_TAGS = ("<think>", "</think>")
HARMONY = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>")
# the oracle's whole answer, the tags written as placeholders where they are special tokens (no text)
REASONED = {
    ("qwen3", False): r"(?s:(?:<think>(?:(?!</think>).)*</think>)?)",
    ("qwen3", True): r"(?:\x01[^\x01\x02]*\x02)?",
    ("deepseek_r1", False): r"(?s:(?:(?!</think>).)*</think>)",
    ("deepseek_r1", True): r"\x01?[^\x01\x02]*\x02",
    ("gpt_oss", True): r"(?:\x01analysis\x02[^\x01-\x05]*\x03\x04assistant)*\x01final\x02",
}
_thinking: dict = {}


def _thinking_dirs(root, tags: tuple[str, ...], special: bool, vocab: int = 100) -> dict:
    """A target whose tokenizer adds tags as tokens past its characters, ids vocab - len(tags) on: as Qwen3's and
    DeepSeek-R1's add <think> and </think> (llguidance reads them as special tokens; the runtime's reader of a
    character tokenizer reads them as text unless special), and gpt-oss's harmony has its special tokens."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tests.conftest import save_char_tokenizer

    key = (tags, special, vocab)
    if key not in _thinking:
        t = make_target(root / f"t{len(_thinking)}", vocab=vocab, seed=31)
        save_char_tokenizer(t, vocab - len(tags))
        tok = AutoTokenizer.from_pretrained(t)
        tok.add_tokens([AddedToken(tag, special=special) for tag in tags], special_tokens=special)
        tok.save_pretrained(t)
        _thinking[key] = {"qwen3": t, "qwen3_drafter": make_drafter(root / f"d{len(_thinking)}", t, block_size=8,
                                                                     seed=32)}
    return _thinking[key]


@pytest.mark.parametrize("fmt, special", list(REASONED), ids=[f"{f}{' special' * s}" for f, s in REASONED])
def test_greedy_answers_that_reason_first_are_the_targets_masked_greedy(tmp_path_factory, fmt, special):
    """A bias on the token that ends the reasoning makes the random target end it now and then: answers that reason
    and go on to the pattern (gpt-oss's: another analysis message), answers without reasoning (qwen3's without a
    block, gpt-oss's final at once) and ones still reasoning at the end. The oracle: Python's `regex` partial matching
    of the whole answer (REASONED, then the pattern)."""
    tags = HARMONY if fmt == "gpt_oss" else THINK_TAGS
    dirs = _thinking_dirs(tmp_path_factory.getbasetemp(), tags, special)
    engine = _engine(dirs, "qwen3", 7, rows=4)
    tok, ids = engine.tokenizer, range(100 - len(tags), 100)
    marks = {i: chr(1 + j) if special else tag for j, (i, tag) in enumerate(zip(ids, tags))}
    ends = tok.convert_tokens_to_ids(tags[2 if fmt == "gpt_oss" else 1])  # </think>, harmony's <|end|>
    whole = REASONED[fmt, special] + f"(?:{PATTERNS[0]})"

    def text(out: list[int]) -> str:
        return "".join(marks.get(i) or tok.decode([i]) for i in out)

    def allowed_after(out: list[int]) -> list[int]:
        said = text(out)
        return ([i for i in range(3, 100) if regex.fullmatch(whole, said + text([i]), partial=True)]
                + [EOS] * bool(regex.fullmatch(whole, said)))

    prompts = [tok.encode(t, add_special_tokens=False) for t in ("Say: abc ", "Answer? ", "List 1,2 ", "Hi ")]
    bias = {ends: 1.5}
    refs = [hf_masked_greedy(dirs["qwen3"], prompt, allowed_after, bias=bias) for prompt in prompts]
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.1)
    spec = StructuredOutput(regex=PATTERNS[0], reasoning=fmt)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, logit_bias=bias, structured=spec))
    assert [o.token_ids for o in outs] == refs
    # (a reasoning ended past its first tokens, and an answer that ended under the pattern)
    assert any(ends in r[2:] for r in refs) and any(r[-1] == EOS for r in refs)


CALL_TAGS = (*HARMONY, "<|constrain|>", "<|call|>")  # (<|call|> no eos here: the grammar writes it)
# the oracle's arguments (no whitespace: any_whitespace off) by function
ARGUMENTS = {"f": ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["n"], "additionalProperties": False}, r'\{"n":(?:[0-9]|[1-9][0-9])\}'),
             "g.h": ({"type": "object", "properties": {"s": {"enum": ["ab", "ba"]}}, "required": ["s"],
                      "additionalProperties": False}, r'\{"s":"(?:ab|ba)"\}')}


@pytest.mark.parametrize("functions", [["f"], ["f", "g.h"]], ids=["named", "either"])
def test_greedy_harmony_calls_are_the_targets_masked_greedy(tmp_path_factory, functions):
    """gpt-oss's own form of a call: analysis messages, then a commentary message to one of the functions with
    <|constrain|>json, its arguments held to the function's schema, then <|call|>. The oracle: Python's `regex`
    partial matching of the whole answer, harmony's special tokens as placeholders."""
    dirs = _thinking_dirs(tmp_path_factory.getbasetemp(), CALL_TAGS, True, vocab=98 + len(CALL_TAGS))
    engine = _engine(dirs, "qwen3", 7, rows=4)
    tok, vocab = engine.tokenizer, 98 + len(CALL_TAGS)
    marks = {i: chr(1 + j) for j, i in enumerate(range(98, vocab))}
    headers = "|".join(regex.escape(f) + rf' ?\x06json\x02{ARGUMENTS[f][1]}' for f in functions)
    whole = rf"(?:\x01analysis\x02[^\x01-\x07]*\x03\x04assistant)*\x01commentary to=functions\.(?:{headers})\x07"

    def text(out: list[int]) -> str:
        return "".join(marks.get(i) or tok.decode([i]) for i in out)

    def allowed_after(out: list[int]) -> list[int]:
        said = text(out)
        return ([i for i in range(3, vocab) if regex.fullmatch(whole, said + text([i]), partial=True)]
                + [EOS] * bool(regex.fullmatch(whole, said)))

    prompts = [tok.encode(t, add_special_tokens=False) for t in ("Hi ", "Tell me ", "Name? ", "x ")]
    bias = {tok.convert_tokens_to_ids("<|end|>"): 0.3}
    refs = [hf_masked_greedy(dirs["qwen3"], prompt, allowed_after, new=70, bias=bias) for prompt in prompts]
    force_drafts(engine, {i: p + r for i, (p, r) in enumerate(zip(prompts, refs))}, error_rate=0.1)
    # (a schema as its JSON text too, as json= takes one)
    schemas = {f: json.dumps(ARGUMENTS[f][0]) if f == "f" else ARGUMENTS[f][0] for f in functions}
    spec = StructuredOutput(calls=schemas, any_whitespace=False, reasoning="gpt_oss")
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=70, logit_bias=bias, structured=spec))
    assert [o.token_ids for o in outs] == refs
    # (answers that reasoned before their call, and calls written whole, to each function asked for)
    said = [text(r) for r in refs if r[-1] == EOS]
    assert any(t.startswith("\x01analysis") for t in said)
    assert {regex.search(r"functions\.([\w.]+?) ?\x06", t)[1] for t in said} == set(functions)


# --- sampling: speculative samples under a grammar follow the masked target's distribution --------------------------

V = 8  # ids 3..7: ' ', '!', '"', '#', '$'
SMALL_PATTERN = r'(![ "]|#")[!"# ]*'
CHARS = {3: " ", 4: "!", 5: '"', 6: "#", 7: "$"}


@pytest.fixture(scope="module")
def small_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar_small")
    t = make_target(root / "t", vocab=V, seed=21)
    return t, make_drafter(root / "d", t, block_size=8, target_layer_ids=(1, 3), seed=22)


def _small_allowed(text: str) -> list[int]:
    ok = [i for i, c in CHARS.items() if regex.fullmatch(SMALL_PATTERN, text + c, partial=True)]
    return ok + [EOS] * bool(regex.fullmatch(SMALL_PATTERN, text))


def _exact_masked_joint(target_dir, prompt, temperature, new=4) -> dict:
    """P(answer) under the target with each position masked to the oracle's allowed tokens, by enumeration (answers
    end at eos or after `new` tokens); the softmax at temperature is z-lab's."""
    ref = pytest.importorskip("dflash.model")
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    joint: dict = {}

    def walk(out: tuple, p: float) -> None:
        if len(out) == new or (out and out[-1] == EOS):
            joint[out] = p
            return
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(out)])).logits[0, -1:]
        masked = torch.full_like(logits, -torch.inf)
        allowed = _small_allowed("".join(CHARS[t] for t in out))
        masked[0, allowed] = logits[0, allowed]
        probs = ref._sampling_probs(masked[None], temperature, 1.0, 0)[0, 0]
        for t in allowed:
            walk(out + (t,), p * float(probs[t]))

    walk((), 1.0)
    return joint


@pytest.mark.parametrize("rule, tree", [("match", {}), ("rejection", {}), ("match", {1500: 5})],
                         ids=["match", "rejection", "match in trees"])
def test_sampled_answers_under_a_grammar_follow_the_masked_targets_distribution(small_dirs, rule, tree):
    t, d = small_dirs
    prompt = [1, 4, 3, 6, 5]
    expected = _exact_masked_joint(t, prompt, 1.5)
    target = load_target(t)
    engine = LLMEngine(target, load_tokenizer(t, V), load_drafter(d, target.config),
                       EngineConfig(max_batch_size=1500, max_draft_len=3, draft_tree=tree))
    n = 3000
    spec = StructuredOutput(regex=SMALL_PATTERN)
    outs = engine.generate([prompt] * n, [SamplingParams(max_new_tokens=4, temperature=1.5, seed=s, acceptance=rule,
                                                         structured=spec) for s in range(n)])
    assert sum(sum(o.acceptance_lengths) - len(o.acceptance_lengths) for o in outs) > n / 10  # drafts accepted
    assert len(expected) > 20 and sum(expected.values()) == pytest.approx(1.0, abs=1e-5)
    assert_matches([tuple(o.token_ids) for o in outs], expected)
