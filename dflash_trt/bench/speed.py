"""`bench speed`: single-stream autoregressive against DFlash on categorized prompts, in one process.

Every prompt runs at batch 1 through the same runtime with speculation off (AR) and at each K, in the same
round (rounds interleave the systems, so drift in machine speed hits all of them alike), greedy or sampled. Per
category: tau (tokens committed per verify step, counting the bonus token), the acceptance histogram,
tokens/s of each system, the end-to-end speedup (DFlash tokens/s over AR tokens/s, wall clock including prefill)
and how many outputs are identical to AR's (in bf16 a K-token verify and a one-token forward can round
differently on near-ties; the count is reported, never hidden). Sampled, every system draws prompt i with seed
`seed + i`; under the "match" rule a seeded request's tokens are the target's own samples whatever was drafted
(layers/sampler.py PositionalUniforms), so they too are compared with AR's; under "rejection" they are only equal in
distribution and no count is reported. Optionally z-lab's reference `dflash_generate` runs on the same weights as a
peer (greedy only).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from dflash_trt.bench.datasets import BenchPrompt, by_category
from dflash_trt.engine.llm_engine import LLMEngine
from dflash_trt.sampling_params import AcceptanceRule, SamplingParams


@dataclass
class SpeedConfig:
    draft_lens: list[int]
    rounds: int = 2
    warmup: bool = True
    # Draft vocabularies to compare at every K (EngineConfig.draft_vocab_size: None = the drafter's own, 0 = the
    # whole vocabulary). With more than one, systems are named "K=3 vocab=all" / "K=3 vocab=0" / "K=3 vocab=8192".
    draft_vocab_sizes: list[int | None] = field(default_factory=lambda: [None])
    # Draft tree sizes to compare at every K (EngineConfig.draft_tree at one row; 0: a chain). Systems with a tree are
    # named "K=3 tree=5".
    tree_nodes: list[int] = field(default_factory=lambda: [0])
    # Context lookups to compare at every K and tree (EngineConfig.lookup_nodes; 0: none). Systems with one are
    # named "K=7 tree=6 lookup=7".
    lookup_nodes: list[int] = field(default_factory=lambda: [0])
    # Whether the speculative systems run plain steps where those measure faster (EngineConfig.adaptive_draft_len;
    # None: as the engine does). Systems that may are named "... adaptive": their tau and histogram count their
    # speculative steps only, their tok/s every step.
    adaptive: bool | None = None
    # Decoding of every request: temperature 0 is greedy; above it prompt i is sampled with seed `seed + i`.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    acceptance: AcceptanceRule = "match"

    def params(self, index: int, max_tokens: int) -> SamplingParams:
        """Prompt `index`'s decoding, the same for every system."""
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed + index, acceptance=self.acceptance)

    @property
    def compares_tokens(self) -> bool:
        """Whether a system's tokens should equal AR's: greedy, or seeded samples under the "match" rule."""
        return self.temperature == 0 or self.acceptance == "match"


@dataclass
class _Tally:
    tokens: int = 0
    steps: int = 0
    committed: int = 0
    identical: int = 0
    prompts: int = 0
    histogram: list[int] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)  # per round

    def add_hist(self, hist: list[int]) -> None:
        if len(self.histogram) < len(hist):
            self.histogram += [0] * (len(hist) - len(self.histogram))
        for i, c in enumerate(hist):
            self.histogram[i] += c


def sibling_engines(engine: LLMEngine, draft_lens: list[int], draft_vocab_sizes: list[int | None] = (None,),
                    tree_nodes: list[int] = (0,), lookup_nodes: list[int] = (0,), adaptive: bool = False,
                    ) -> tuple[LLMEngine, dict[str, LLMEngine]]:
    """An autoregressive engine and one engine per (K, draft vocabulary, draft tree, context lookup), all sharing
    `engine`'s weights and tokenizer, keyed by system name; adaptive: whether those run adaptive plain steps."""
    # each system's K and tree as named, whatever the CPU (the *_without_amx tables would pick others)
    cfg = dataclasses.replace(engine.config, max_batch_size=1, draft_len_schedule={}, draft_tree={},
                              draft_len_schedule_without_amx=None, draft_tree_without_amx=None,
                              adaptive_draft_len=adaptive)
    ar = LLMEngine(engine.target, engine.tokenizer, None, dataclasses.replace(cfg, speculative=False))
    if engine.drafter is None and draft_lens:
        raise ValueError("bench speed needs a drafter for K > 0 (an engine with a drafter, or --drafter DIR)")
    if len(set(draft_vocab_sizes)) != len(draft_vocab_sizes):
        raise ValueError(f"draft vocabulary sizes repeat: {list(draft_vocab_sizes)}")
    if len(set(tree_nodes)) != len(tree_nodes):
        raise ValueError(f"draft tree sizes repeat: {list(tree_nodes)}")
    if len(set(lookup_nodes)) != len(lookup_nodes):
        raise ValueError(f"lookup branch sizes repeat: {list(lookup_nodes)}")
    specs = {}
    for k in draft_lens:
        for v in draft_vocab_sizes:
            for n in tree_nodes:
                for lookup in lookup_nodes:
                    name = f"K={k}" if len(draft_vocab_sizes) == 1 else f"K={k} vocab={'all' if v is None else v}"
                    name += (f" tree={n}" if n else "") + (f" lookup={lookup}" if lookup else "")
                    name += " adaptive" if adaptive else ""
                    specs[name] = LLMEngine(engine.target, engine.tokenizer, engine.drafter, dataclasses.replace(
                        cfg, speculative=True, max_draft_len=k, draft_vocab_size=v, draft_tree={1: n} if n else {},
                        lookup_nodes=lookup))
    return ar, specs


def zlab_runner(target_dir: str, drafter_dir: str, dtype, eos_ids: list[int]
                ) -> Callable[[list[int], int, int], tuple[list[int], list[int]]]:
    """z-lab's reference loop on the same checkpoints: f(prompt ids, max_new_tokens, K) -> (generated ids,
    tokens committed per verify step)."""
    import time as _time

    import dflash.model as zlab
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    zd = zlab.DFlashDraftModel.from_pretrained(drafter_dir, dtype=dtype).eval()

    def run(ids: list[int], max_new: int, k: int) -> tuple[list[int], list[int]]:
        # Its statistics timer calls torch.cuda.synchronize(); on a CPU-only machine time without it.
        timer = zlab._cuda_time
        if not torch.cuda.is_available():
            zlab._cuda_time = _time.perf_counter
        try:
            out = zlab.dflash_generate(zd, hf, torch.tensor([ids]), max_new, eos_ids, block_size=k + 1, return_stats=True)
        finally:
            zlab._cuda_time = timer
        gen = out.output_ids[0, len(ids):].tolist()
        for i, t in enumerate(gen):  # z-lab returns the buffer up to its stop; keep ours' convention (stop id kept)
            if t in eos_ids:
                gen = gen[: i + 1]
                break
        return gen, list(out.acceptance_lengths)

    return run


def run_speed(engine: LLMEngine, prompts: list[BenchPrompt], cfg: SpeedConfig, *, chat: bool = True,
              zlab: Callable[[list[int], int, int], tuple[list[int], list[int]]] | None = None, progress=None) -> dict:
    """Measure every category; returns the JSON-ready result (see module doc). Ctrl-C after a whole round returns
    the rounds done (the result's "interrupted" says how many); before one, the KeyboardInterrupt goes on."""
    if zlab is not None and cfg.temperature > 0:
        raise ValueError("z-lab's dflash_generate runs greedy only: drop the peer or the temperature")
    adaptive = engine.config.adaptive_draft_len if cfg.adaptive is None else cfg.adaptive
    ar, specs = sibling_engines(engine, cfg.draft_lens, cfg.draft_vocab_sizes, cfg.tree_nodes,
                                  cfg.lookup_nodes, adaptive)
    groups = by_category(prompts)
    ids = {p.id: ar.encode(p.text, chat=chat) for p in prompts}
    index = {p.id: i for i, p in enumerate(prompts)}
    for p in prompts:  # before any system runs: a prompt the context cannot hold would fail the run midway
        if len(ids[p.id]) >= ar.max_model_len:
            raise ValueError(f"prompt {p.id} ({p.category}) has {len(ids[p.id])} tokens; the engine's context "
                             f"(max_model_len {ar.max_model_len}) leaves no room to generate: shorter prompts "
                             "(another --dataset or --category), or an engine built with a longer max_seq_len")

    def timed(e: LLMEngine, p: BenchPrompt):
        t = time.perf_counter()
        out = e.generate([ids[p.id]], cfg.params(index[p.id], p.max_tokens))[0]
        elapsed = time.perf_counter() - t
        # every prompt prefilled whole: a prompt run again (the warm-up's, or one prompt over several rounds) would
        # take over its earlier run's chunks, and its wall clock leave out the prefill the others include
        e.scheduler.forget_resident()
        return elapsed, out

    if cfg.warmup:
        first = prompts[0]
        for e in [ar, *specs.values()]:
            timed(e, first)
        if zlab is not None:
            zlab(ids[first.id], 8, cfg.draft_lens[0])

    systems = ["ar", *specs] + ([f"zlab K={cfg.draft_lens[0]}"] if zlab else [])
    vocab_sizes = {name: e.runner.draft_vocab_size for name, e in specs.items()}  # None: the whole vocabulary
    tallies = {c: {s: _Tally(wall=[0.0] * cfg.rounds) for s in systems} for c in groups}
    finished: list[int] = []  # rounds run through
    try:
        _rounds(cfg, groups, tallies, timed, ar, specs, zlab, ids, progress, finished)
        interrupted = None
    except KeyboardInterrupt:
        done = len(finished)
        if done == 0:
            raise
        for t in tallies.values():
            for tally in t.values():
                del tally.wall[done:]
        interrupted = {"rounds_done": done, "rounds": cfg.rounds}
    result = _report(tallies, systems, cfg.compares_tokens) | {"draft_vocab_size": vocab_sizes,
                                                                 "adaptive_draft_len": adaptive}
    if interrupted:
        result["interrupted"] = interrupted
    return result | {"sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                                  "seed": cfg.seed, "acceptance": cfg.acceptance} if cfg.temperature > 0 else None}


def _rounds(cfg: SpeedConfig, groups: dict, tallies: dict, timed, ar: LLMEngine, specs: dict, zlab, ids: dict,
            progress, finished: list[int]) -> None:
    for r in range(cfg.rounds):
        for cat, plist in groups.items():
            t = tallies[cat]
            for p in plist:
                wall, base = timed(ar, p)
                t["ar"].wall[r] += wall
                if r == 0:
                    t["ar"].tokens += base.num_tokens
                    t["ar"].prompts += 1
                for name, e in specs.items():
                    wall, out = timed(e, p)
                    s = t[name]
                    s.wall[r] += wall
                    if r == 0:
                        s.tokens += out.num_tokens
                        s.prompts += 1
                        s.steps += len(out.acceptance_lengths)
                        s.committed += sum(out.acceptance_lengths)
                        s.identical += out.token_ids == base.token_ids
                        s.add_hist(out.acceptance_histogram)
                if zlab is not None:
                    k0 = cfg.draft_lens[0]
                    t0 = time.perf_counter()
                    gen, lengths = zlab(ids[p.id], p.max_tokens, k0)
                    s = t[f"zlab K={k0}"]
                    s.wall[r] += time.perf_counter() - t0
                    if r == 0:
                        s.tokens += len(gen)
                        s.prompts += 1
                        s.identical += gen == base.token_ids
                        s.steps += len(lengths)
                        s.committed += sum(lengths)
                        s.add_hist([sum(1 for n in lengths if n == i + 1) for i in range(k0 + 1)])
                if progress is not None:
                    progress()
        finished.append(r)


def _summ(t: _Tally, ar: _Tally, compares_tokens: bool) -> dict:
    wall = statistics.median(t.wall)
    row = {"tokens": t.tokens, "wall_s": round(wall, 4), "tok_s": round(t.tokens / wall, 2) if wall else 0.0}
    if t is not ar:  # a tokens/s ratio: bf16 near-tie divergence can change how many tokens each side generates
        ar_tok_s = ar.tokens / statistics.median(ar.wall)
        row["speedup"] = round(t.tokens / wall / ar_tok_s, 3) if wall else 0.0
        if compares_tokens:
            row["identical_outputs"] = f"{t.identical}/{t.prompts}"
    if t.steps:
        row["tau"] = round(t.committed / t.steps, 3)
        row["acceptance_histogram"] = t.histogram
    return row


def _merge(ts: list[_Tally]) -> _Tally:
    out = _Tally(wall=[sum(w) for w in zip(*(t.wall for t in ts))])
    for t in ts:
        out.tokens += t.tokens
        out.steps += t.steps
        out.committed += t.committed
        out.identical += t.identical
        out.prompts += t.prompts
        out.add_hist(t.histogram)
    return out


def _report(tallies: dict[str, dict[str, _Tally]], systems: list[str], compares_tokens: bool) -> dict:
    categories = {}
    for cat, t in tallies.items():
        categories[cat] = {s: _summ(t[s], t["ar"], compares_tokens) for s in systems}
    total = {s: _merge([t[s] for t in tallies.values()]) for s in systems}
    overall = {s: _summ(total[s], total["ar"], compares_tokens) for s in systems}
    return {"systems": systems, "categories": categories, "overall": overall}


def format_table(result: dict) -> str:
    """One row per category and system, then ALL; every column as wide as its widest cell (system names grow
    with each compared option)."""
    rows = [("category", "system", "tau", "tok/s", "speedup", "identical")]
    for cat, by_system in [*result["categories"].items(), ("ALL", result["overall"])]:
        for s, r in by_system.items():
            rows.append((cat, s, f"{r['tau']:.2f}" if "tau" in r else "-", f"{r['tok_s']:.1f}",
                         f"{r['speedup']:.2f}x" if "speedup" in r else "-", r.get("identical_outputs", "-")))
    widths = [max(map(len, column)) for column in zip(*rows)]
    sampling = result.get("sampling")
    header = (f"sampled: temperature {sampling['temperature']}, top_p {sampling['top_p']}, top_k {sampling['top_k']}, "
              f"prompt i with seed {sampling['seed']} + i, {sampling['acceptance']} rule\n" if sampling else "")
    return header + "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in rows)
