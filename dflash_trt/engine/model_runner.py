"""ModelRunner: owns the target, the drafter and both caches, and runs one step for a batch of rows.

A speculative step (arXiv 2602.06036 §3) for rows b with anchor a_b at position L_b:
  draft:  inject pending target features into the drafter cache, one drafter forward over
          [a_b, MASK x K] -> draft tokens d_b (spec/proposer.py)
  verify: one target forward over [a_b, d_b] at positions L_b..L_b+K, capturing target_layer_ids
  accept: per row rule (spec/verifier.py) -> a accepted drafts + bonus
  commit: the row's target length becomes L_b + a + 1 (rejected K/V stay, masked, and are
          overwritten next step); features of the a + 1 committed tokens become pending.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable

import torch

from dflash_trt.device_copy import host_to_device, to_device
from dflash_trt.engine.logprobs import token_logprobs
from dflash_trt.engine.sequence import Sequence
from dflash_trt.engine.step_clock import StepClock
from dflash_trt.kernels.verify_block import GREEDY, MODE_OF_ACCEPTANCE, verify_block
from dflash_trt.layers.argmax import argmax_last
from dflash_trt.layers.attention import AttentionMetadata, HostRows, round_up
from dflash_trt.layers.logits_processors import TokenSets, process_logits
from dflash_trt.layers.sampler import known_flags, sample_from, sampling_probs
from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.spec.draft_tree import accept_tree, common_prefix, tree_depth
from dflash_trt.spec.proposer import DFlashProposer, DraftSampling
from dflash_trt.spec.verifier import VerifyResult, accept_greedy


# oneDNN builds a primitive for every new linear shape (~6 ms each on this CPU, 20x a 64-row bf16 GEMM;
# benchmarks/bench_shapes.py), and a prompt brings a new row count to every projection of the model. Prompt
# chunks and long feature batches are padded to a multiple of this many tokens so that few shapes recur.
TOKEN_BUCKET = 16


# Prompt positions whose logprobs one head call computes (Qwen3's vocabulary: 156 MB of fp32 logits)
PROMPT_LOGPROB_SLICE = 256


def _prefixes(tokens: list[int]) -> list[list[int]]:
    """[], tokens[:1], ..., tokens: what each position of a chain's block has drafted before it."""
    return [tokens[:j] for j in range(len(tokens) + 1)]


class ModelRunner:
    def __init__(
        self,
        target: torch.nn.Module,
        drafter: DFlashDrafter | None,
        num_rows: int,
        max_model_len: int,
        pack_weights: bool = True,
        draft_vocab: torch.Tensor | None = None,
        screen_head: bool = True,
        int8_drafter: bool | None = False,
        lookup_nodes: int = 0,
        max_tree_nodes: int = 0,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.device = target.embed_tokens.weight.device
        self.max_model_len = max_model_len
        block = drafter.config.block_size if drafter is not None else 1
        self.lookup_nodes = lookup_nodes
        # room past a row's last position for a step's verify rows: a drafter block, or a larger draft tree's nodes
        self.target_cache = target.make_cache(num_rows, max_model_len + max(block, max_tree_nodes + 1) + 1,
                                              queries=max(block, max_tree_nodes + 1))
        self.proposer = None
        self.capture: tuple[int, ...] = ()
        if drafter is not None:
            self.proposer = DFlashProposer(
                drafter, target.embed_tokens.weight, target.lm_head_forward, num_rows, max_model_len,
                target.lm_head_weight, draft_vocab, pack_weights,
            )
            self.capture = tuple(drafter.config.target_layer_ids)
        if pack_weights:
            target.pack_for_inference(screen_head)
            if drafter is not None:
                drafter.pack_for_inference(int8_drafter)

    @property
    def draft_vocab_size(self) -> int | None:
        """Tokens the drafter drafts among; None: the whole vocabulary."""
        vocab = self.proposer.draft_vocab if self.proposer is not None else None
        return None if vocab is None else vocab.numel()

    @property
    def max_draft_len(self) -> int:
        return self.proposer.max_draft_len if self.proposer is not None else 0

    def _rows(self, seqs: list[Sequence]) -> torch.Tensor:
        return to_device([s.slot for s in seqs], torch.long, self.device)

    @staticmethod
    def _host(seqs: list[Sequence], starts: list[int], limit: int | None = None,
              lens: list[int] | None = None) -> HostRows:
        return HostRows([s.slot for s in seqs], starts, limit, lens)

    @staticmethod
    def _settings(seqs: list[Sequence]) -> tuple[list[float], list[int], list[float]]:
        """Each row's temperature, top-k and top-p."""
        p = [s.params for s in seqs]
        return [x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p]

    def _params(self, seqs: list[Sequence]):
        t, k, p = self._settings(seqs)
        dev = self.device
        return (
            to_device(t, torch.float32, dev),
            to_device(k, torch.long, dev),
            to_device(p, torch.float32, dev),
        )

    def _sampling_probs(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, *self._params(seqs), **known_flags(*self._settings(seqs), logits.shape[-1]))

    def _next_tokens(self, seqs: list[Sequence], hidden: torch.Tensor) -> list[int]:
        # hidden: [B, H] final hidden states -> one token per row, by each row's own params and uniforms
        greedy = self._greedy_choices(seqs, hidden, lambda i: [[]])
        if greedy is not None:
            return greedy.tolist()
        logits = self._shaped(seqs, self.target.compute_logits(hidden)[:, None], lambda i: [[]])
        probs = self._sampling_probs(seqs, logits)[:, 0]
        return sample_from(probs, self._uniforms(seqs, 1)[:, 0]).tolist()

    def _uniforms(self, seqs: list[Sequence], n: int) -> torch.Tensor:
        """[B, n] uniforms for each row's next n output positions. A "match" (or greedy) row's come from its
        positional stream (layers/sampler.py PositionalUniforms), so its tokens do not depend on how many each step
        drafted; a "rejection" row's are fresh draws, as that rule's acceptance tests need (its tokens depend on the
        drafts anyway)."""
        return host_to_device(torch.stack([
            torch.rand(n, generator=s.generator) if s.params.samples_drafts
            else s.uniforms.at(len(s.output_ids), n)
            for s in seqs
        ]), self.device)

    @torch.inference_mode()
    def prefill(
        self, seqs: list[Sequence], starts: list[int] | None = None, ends: list[int] | None = None,
        copies: list[list[Sequence]] | None = None,
    ) -> list[int | None]:
        """Run prompt chunks [start, end) (right-padded into one batch) at their absolute positions.

        Returns each row's first token when its chunk ends the prompt, else None (chunked prefill:
        an earlier chunk's K/V are already cached and the chunk attends to them).

        copies[i]: requests whose prompts hold row i's tokens up to its chunk's end and whose next chunk is the same
        [start, end) (so their K/V before `start` equal row i's; the scheduler orders a request's chunks so that
        those before it have run): they take row i's K/V and features instead of a forward of their own, and each
        samples its first token as it would have alone. The result lists each row's first token, then its copies'.
        """
        start_time = time.perf_counter()
        starts = starts or [0] * len(seqs)
        ends = ends or [len(s.prompt_ids) for s in seqs]
        copies = copies or [[] for _ in seqs]
        lens = [e - b for b, e in zip(starts, ends)]
        n = round_up(max(lens), TOKEN_BUCKET)
        ids = to_device([s.prompt_ids[b:e] + [0] * (n - e + b) for s, b, e in zip(seqs, starts, ends)], torch.long,
                        self.device)
        first = to_device(starts, torch.long, self.device)
        # Padding beyond a row's chunk writes K/V past its length: masked, then overwritten. The clamp
        # keeps it inside the cache (the last position is never a live one: the cache has spare room).
        positions = (first[:, None] + torch.arange(n, device=self.device)).clamp_max(self.target_cache.max_len - 1)
        meta = AttentionMetadata.causal_step(self._rows(seqs), positions,
                                             self._host(seqs, starts, self.target_cache.max_len, lens))
        hidden, features = self.target(ids, meta, self.target_cache, self.capture)
        for i, s in enumerate(seqs):  # the chunk's K/V (their K/V before `start` already equal it)
            if copies[i]:
                self.target_cache.copy_rows(s.slot, self._rows(copies[i]), starts[i], ends[i])
        # each request after its row: a row's copies sit with it
        owners = [(i, s) for i, s in enumerate(seqs) for s in [s, *copies[i]]]
        for i, s in owners:
            if s.params.prompt_logprobs is not None:
                # positions start .. end - 1 choose the prompt's tokens start + 1 .. end (the last one's: the output's)
                scored = s.prompt_ids[starts[i] + 1: ends[i] + 1]
                for a in range(0, len(scored), PROMPT_LOGPROB_SLICE):  # fp32 logits of a whole chunk: GBs on a GPU
                    b = min(a + PROMPT_LOGPROB_SLICE, len(scored))
                    s.prompt_logprobs += token_logprobs(self.target.compute_logits(hidden[i, a:b]), scored[a:b],
                                                        s.params.prompt_logprobs)
        tokens: list[int | None] = [None] * len(owners)
        for j, (i, s) in enumerate(owners):
            # Only requests that finish their prompt sample, so a seeded one draws the same numbers however it is
            # chunked; one at a time, as each would alone (a head over several rows may sum in another order).
            if ends[i] == len(s.prompt_ids):
                last_hidden = hidden[i, lens[i] - 1][None]
                (tokens[j],) = self._next_tokens([s], last_hidden)
                self._note_logprobs([s], last_hidden[:, None], [[tokens[j]]], [[0]])
        elapsed = time.perf_counter() - start_time
        for i, s in owners:
            s.stats.prefill_time += elapsed
            if features is not None:
                s.pending_features.append(features[i, : lens[i]])
        return tokens

    def copy_prompt(self, src: int, dst: int, end: int) -> None:
        """Row src's target K/V and drafter context at positions [0, end) to row dst."""
        rows = to_device([dst], torch.long, self.device)
        self.target_cache.copy_rows(src, rows, 0, end)
        if self.proposer is not None:
            self.proposer.cache.copy_rows(src, rows, 0, end)

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence]) -> list[list[int]]:
        """One autoregressive token per row (the baseline, and the fallback when K would be 0)."""
        start = time.perf_counter()
        ids = to_device([[s.last_token] for s in seqs], torch.long, self.device)
        starts = [s.num_cached for s in seqs]
        positions = to_device(starts, torch.long, self.device)[:, None]
        meta = AttentionMetadata.causal_step(self._rows(seqs), positions, self._host(seqs, starts))
        hidden, features = self.target(ids, meta, self.target_cache, self.capture)
        tokens = self._next_tokens(seqs, hidden[:, 0])
        self._note_logprobs(seqs, hidden, [[t] for t in tokens], [[0]] * len(seqs))
        elapsed = time.perf_counter() - start
        for i, s in enumerate(seqs):
            s.stats.verify_time += elapsed
            if features is not None:
                s.pending_features.append(features[i])
        return [[t] for t in tokens]

    @torch.inference_mode()
    def spec_step(self, seqs: list[Sequence], num_draft: int) -> list[list[int]]:
        """Draft num_draft tokens per row, verify them in one target forward, return each row's emitted tokens."""
        assert self.proposer is not None, "spec_step needs a drafter"
        dev = self.device
        rows, anchor_pos, anchors, host = self._anchors(seqs)

        clock = StepClock(dev)
        features, context = self._pending_batch(seqs, rows, anchor_pos, host)
        sampling = self._draft_sampling(seqs)
        lookups = self._chain_lookups(seqs, num_draft) if self._looks_up(seqs) else {}
        # the drafter's log-probabilities only where a lookup competes with its chain
        proposal = self.proposer.propose(rows, features, context, anchors, anchor_pos, num_draft, sampling,
                                         with_logprobs=bool(lookups), host=host, grammars=self._draft_grammars(seqs))
        lookups = self._swap_in_lookups(proposal, lookups) if lookups else {}
        self._context_written(seqs)
        clock.drafted()

        block = torch.cat([anchors[:, None], proposal.draft_tokens], dim=1)  # [B, K + 1]
        positions = anchor_pos[:, None] + torch.arange(num_draft + 1, device=dev)
        meta = AttentionMetadata.causal_step(rows, positions, host)
        hidden, target_features = self.target(block, meta, self.target_cache, self.capture)
        # position j's penalties and grammar count the drafts before it as output; read once for every row that asks
        # (on a GPU each read waits for the step's kernels)
        drafts = functools.cache(proposal.draft_tokens.tolist)
        greedy = self._greedy_choices(seqs, hidden, lambda i: _prefixes(drafts()[i]))
        if greedy is not None:
            # The GREEDY rule needs only the target's argmax: taken alone it skips the fp32 logits (on a GPU [B, K + 1,
            # V], 311 MB at 32 rows of Qwen3's vocabulary), the op's dispatch and the uniforms and modes a mixed batch
            # needs (~0.5 ms a step on the CPU); verify_block serves the batches that sample or shape their logits.
            result = accept_greedy(proposal.draft_tokens, greedy)
        else:
            logits = self._shaped(seqs, self.target.compute_logits(hidden), lambda i: _prefixes(drafts()[i]))
            result = self._verify(seqs, proposal, sampling, logits)
        emitted = result.emitted(proposal.draft_tokens)
        self._note_logprobs(seqs, hidden, emitted, [range(len(e)) for e in emitted])
        for i, drafted in lookups.items():
            seqs[i].context_lookup().observe(drafted, min(drafted, len(emitted[i]) - 1))
        self._committed(seqs, [target_features[i, : len(e)] for i, e in enumerate(emitted)], *clock.split())
        return emitted

    @staticmethod
    def _draft_grammars(seqs: list[Sequence]) -> dict[int, object]:
        """The rows whose grammar their drafts keep to: greedy and "match" ones, whose drafts are the drafter's top
        tokens (any choice of drafts keeps those rules lossless; the "rejection" rule's are samples of its own q)."""
        return {i: s.grammar for i, s in enumerate(seqs) if s.grammar is not None and not s.params.samples_drafts}

    def _chain_lookups(self, seqs: list[Sequence], num_draft: int) -> dict[int, list[tuple[int, float]]]:
        """A chain step's context lookups (spec/context_lookup.py): {row: its scored draft} for the greedy and
        "match" rows that have one (the "rejection" rule needs the drafter's distribution)."""
        rows = [i for i, s in enumerate(seqs) if not s.params.samples_drafts]
        branches = self._lookup_branches([seqs[i] for i in rows], num_draft)
        return {i: branch for i, branch in zip(rows, branches) if branch}

    @staticmethod
    def _swap_in_lookups(proposal, lookups: dict[int, list[tuple[int, float]]]) -> dict[int, int]:
        """A row whose lookup expects more accepted tokens than the drafter's chain (the sums of their prefixes'
        probabilities) drafts the lookup instead, the drafter's tokens filling the slots past it.
        -> {row: lookup tokens drafted}."""
        drafter_expected = proposal.draft_logprobs.cumsum(dim=1).exp().sum(dim=1).tolist()
        swapped = {}
        for i, branch in lookups.items():
            if sum(math.exp(score) for _, score in branch) > drafter_expected[i]:
                proposal.draft_tokens[i, : len(branch)] = to_device([t for t, _ in branch], torch.long,
                                                                    proposal.draft_tokens.device)
                swapped[i] = len(branch)
        return swapped

    @torch.inference_mode()
    def tree_step(self, seqs: list[Sequence], depth: int, nodes: int) -> tuple[list[list[int]], int]:
        """Greedy rows and rows sampled under the "match" rule: draft a tree of `nodes` nodes up to `depth` slots deep
        per row (spec/draft_tree.py), verify it in one target forward -> (each row's emitted tokens: the accepted path's
        drafts and the target's next; the nodes drafted, fewer where a shallow tree holds fewer paths)."""
        assert self.proposer is not None, "tree_step needs a drafter"
        rows, anchor_pos, anchors, host = self._anchors(seqs)

        clock = StepClock(self.device)
        features, context = self._pending_batch(seqs, rows, anchor_pos, host)
        branches = self._lookup_branches(seqs, depth) if self._looks_up(seqs) else None
        tree = self.proposer.propose_tree(rows, features, context, anchors, anchor_pos, depth, nodes, branches,
                                          host=host, grammars=self._draft_grammars(seqs))
        self._context_written(seqs)
        clock.drafted()

        meta = AttentionMetadata.tree_step(rows, anchor_pos, tree.depths, tree.ancestors, host)
        hidden, target_features = self.target(tree.tokens, meta, self.target_cache, self.capture)
        choices = self._tree_choices(seqs, hidden, tree, depth).tolist()  # [B][N + 1]: the token after each node
        paths = accept_tree(tree, choices)
        tokens = tree.node_tokens
        emitted = [[tokens[i][j] for j in path[1:]] + [choices[i][path[-1]]] for i, path in enumerate(paths)]
        self._note_logprobs(seqs, hidden, emitted, paths)  # the token after node j was chosen at node j
        # How deep each lookup was verified and accepted, counted alike where the drafter proposed the same nodes.
        for i, branch in enumerate(branches or ()):
            drafted = [t for t, _ in branch]
            verified = tree_depth(tokens[i], tree.parents[i], drafted)
            seqs[i].context_lookup().observe(verified, common_prefix(drafted[:verified], emitted[i][:-1]))
        # The accepted nodes' K/V move to the positions of their depths (node j was written at anchor + j), where
        # the next step's queries look for them; the rest is left behind, masked, as a chain's rejected drafts are.
        moves = [(slot, start, p) for slot, start, p in zip(host.slots, host.starts, paths) if p != list(range(len(p)))]
        if moves:
            self.target_cache.move(moves)
        # the accepted nodes' features; a path off the first nodes indexed by a device tensor (a list index is copied
        # from pageable memory: a GPU sync)
        features = [target_features[i, : len(p)] if p == list(range(len(p)))
                    else target_features[i].index_select(0, to_device(p, torch.long, self.device))
                    for i, p in enumerate(paths)]
        self._committed(seqs, features, *clock.split())
        return emitted, tree.num_nodes

    def _looks_up(self, seqs: list[Sequence]) -> bool:
        """Whether a step's rows draft context lookups: the engine's lookup_nodes, or a row's predicted output."""
        return bool(self.lookup_nodes) or any(s.params.prediction for s in seqs)

    def _lookup_branches(self, seqs: list[Sequence], depth: int) -> list[list[tuple[int, float]]]:
        """Each row's context lookup draft after its last committed token, with its scores (spec/context_lookup.py),
        lookup_nodes deep in a step of `depth` drafts; a whole step deep where the request predicts its output (a
        prediction is accepted far deeper than a lookup into the context: a file rewritten with a few changes)."""
        depths = [depth if s.params.prediction else min(depth, self.lookup_nodes) for s in seqs]
        # (a row that drafts none builds no index: a batch mate's prediction costs it nothing)
        return [s.context_lookup().scored_draft(d) if d else [] for s, d in zip(seqs, depths)]

    def _tree_choices(self, seqs: list[Sequence], hidden: torch.Tensor, tree, depth: int) -> torch.Tensor:
        """The target's token after every node [B, N + 1]: its argmax for greedy rows; for sampled rows its sample,
        drawn with the row's uniform for the output position at the node's depth, so each token the path emits is the
        target's own sample given the tokens before it (and penalized as if that path were the output)."""
        greedy = self._greedy_choices(seqs, hidden, lambda i: self._node_paths(tree, i))
        if greedy is not None:
            return greedy
        u = torch.zeros(len(seqs), depth + 1, device=self.device)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:  # none where every row is greedy and some shape their logits
            u[to_device(sampled, torch.long, self.device)] = self._uniforms([seqs[i] for i in sampled], depth + 1)
        logits = self._shaped(seqs, self.target.compute_logits(hidden), lambda i: self._node_paths(tree, i))
        probs = self._sampling_probs(seqs, logits)  # greedy rows: one-hot
        return sample_from(probs, u.gather(1, tree.depths))

    def _greedy_choices(self, seqs: list[Sequence], hidden: torch.Tensor,
                        extras_of: Callable[[int], list[list[int]]]) -> torch.Tensor | None:
        """The target's greedy token at every position [B, T] (hidden [B, T, H]; [B] of [B, H]) where each row is
        greedy on its logits as they are, or under a grammar alone: the head's int8 screen serves them all, and a
        grammar row's token is taken again from its masked logits only at the positions whose argmax the grammar
        refuses (the masked argmax is the argmax wherever that is allowed). None where a row samples or shapes its
        logits otherwise. extras_of as _shaped's."""
        if not all(s.plain_greedy or s.greedy_in_grammar for s in seqs):
            return None
        choices = self.target.greedy_tokens(hidden)
        if hidden.dim() == 2:  # one position a row
            return self._within_grammars(seqs, hidden[:, None], choices[:, None], extras_of)[:, 0]
        return self._within_grammars(seqs, hidden, choices, extras_of)

    def _within_grammars(self, seqs: list[Sequence], hidden: torch.Tensor, choices: torch.Tensor,
                         extras_of: Callable[[int], list[list[int]]]) -> torch.Tensor:
        """choices [B, T] with each grammar row's refused argmaxes taken again, in place."""
        rows = [i for i, s in enumerate(seqs) if s.greedy_in_grammar]
        host = choices.tolist() if rows else []
        for i in rows:
            grammar, extras = seqs[i].grammar, extras_of(i)
            refused = [j for j, extra in enumerate(extras) if not grammar.allows(extra, host[i][j])]
            if refused:
                at = to_device(refused, torch.long, self.device)
                logits = self.target.compute_logits(hidden[i].index_select(0, at))
                blocked = grammar.blocked([extras[j] for j in refused], self.device)
                choices[i, at] = argmax_last(logits.masked_fill(blocked, -torch.inf))
        return choices

    @staticmethod
    def _node_paths(tree, row: int) -> list[list[int]]:
        """Per node of a tree row: the drafted tokens from the root to it (the node's own included)."""
        tokens, paths = tree.node_tokens[row], [[]]
        for k, parent in enumerate(tree.parents[row][1:], start=1):
            paths.append(paths[parent] + [tokens[k]])
        return paths

    @staticmethod
    def _shaped(seqs: list[Sequence], logits: torch.Tensor,
                extras_of: Callable[[int], list[list[int]]]) -> torch.Tensor:
        """logits [B, T, V] with each row's settings applied at its positions (layers/logits_processors.py);
        extras_of(i)[j]: the tokens row i's position j counts as output beyond its committed ones, asked for the rows
        that shape their logits only (a step without any pays nothing)."""
        for i, s in enumerate(seqs):
            if s.shapes_logits:
                extras = extras_of(i)
                n = len(extras)
                if s.token_sets is None:
                    s.token_sets = TokenSets.of(s.params, s.stop_ids, logits.shape[-1], logits.device)
                refused = None if s.grammar is None else s.grammar.blocked(extras, logits.device)
                logits[i, :n] = process_logits(logits[i, :n], s.params, s.prompt_ids, s.output_ids, extras,
                                               sets=s.token_sets, refused=refused)
        return logits

    def _note_logprobs(self, seqs: list[Sequence], hidden: torch.Tensor, emitted: list[list[int]],
                       positions: list) -> None:
        """For the rows that ask for logprobs: the target's log-probabilities of the tokens each emitted
        (engine/logprobs.py), for Sequence.append to commit. hidden [B, T, H]; row i's token j was chosen by the
        target at hidden[i, positions[i][j]]. Only these rows pay for the full head's logits."""
        for i, s in enumerate(seqs):
            if s.params.logprobs is not None:
                logits = self.target.compute_logits(hidden[i, to_device(list(positions[i]), torch.long, self.device)])
                s.new_logprobs = token_logprobs(logits, emitted[i], s.params.logprobs)

    def _anchors(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HostRows]:
        """Each row's cache row, anchor position (its committed length) and anchor (its last token, which the
        target has not seen yet); the rows and anchor positions on the host."""
        dev = self.device
        starts = [s.num_cached for s in seqs]
        return (self._rows(seqs), to_device(starts, torch.long, dev),
                to_device([s.last_token for s in seqs], torch.long, dev), self._host(seqs, starts))

    @staticmethod
    def _committed(seqs: list[Sequence], features: list[torch.Tensor], draft_s: float, verify_s: float) -> None:
        """After a speculative step: each row's committed tokens' target features become its pending ones; every
        row is charged the step's time."""
        for s, f in zip(seqs, features):
            s.pending_features = [f]
            s.stats.draft_time += draft_s
            s.stats.verify_time += verify_s

    def _pending_batch(self, seqs: list[Sequence], rows: torch.Tensor, anchor_pos: torch.Tensor,
                       host: HostRows) -> tuple[torch.Tensor, AttentionMetadata | None]:
        """Pad each row's pending features to one [B, N, F] batch; row b's real entries end at its anchor. -> the
        batch and where it goes in the drafter's cache (None where every row's went in alone).

        Padding entries are written at positions past the anchor (clamped into the cache), where the
        block's own K/V overwrite them or the block mask hides them. A row whose stretch (a prompt just prefilled, a
        run of plain steps) would pad the batch to more than twice its entries is injected into the drafter's cache
        alone first: padded beside it, every row would run the drafter's projections over the whole stretch (on a GPU,
        32 rows beside an 8k prompt hold 10 GB of features).
        """
        counts = [s.num_pending_features for s in seqs]
        template = next(s.pending_features[0] for s in seqs if s.pending_features)
        steady = self.max_draft_len + 1
        if len(seqs) > 1 and len(seqs) * max(counts) > 2 * sum(counts):
            for i, s in enumerate(seqs):
                if counts[i] > steady:
                    features = torch.cat(s.pending_features)[None]
                    positions = anchor_pos[i] - counts[i] + torch.arange(counts[i], device=anchor_pos.device)
                    alone = HostRows([s.slot], [host.starts[i] - counts[i]])
                    meta = AttentionMetadata.causal_step(rows[i:i + 1], positions[None], alone)
                    self.proposer.drafter.project_context(features, meta, self.proposer.cache)
                    s.pending_features, counts[i] = [], 0
        n = max(counts)
        if n > steady:  # a prompt's or a plain stretch's features: any length, so bucket it
            n = round_up(n, TOKEN_BUCKET)
        features = template.new_zeros(len(seqs), n, template.shape[-1])  # n = 0 where every row went alone
        for i, s in enumerate(seqs):
            if counts[i]:
                torch.cat(s.pending_features, out=features[i, : counts[i]])
        if not n:
            return features, None
        first = anchor_pos - to_device(counts, torch.long, anchor_pos.device)
        limit = self.proposer.cache.max_len
        positions = (first[:, None] + torch.arange(n, device=anchor_pos.device)).clamp_max(limit - 1)
        context = HostRows(host.slots, [a - c for a, c in zip(host.starts, counts)], limit)
        return features, AttentionMetadata.causal_step(rows, positions, context)

    @staticmethod
    def _context_written(seqs: list[Sequence]) -> None:
        """After a step's drafter pass: each row's drafter cache holds its context up to its anchor."""
        for s in seqs:
            s.drafter_context = s.num_cached

    def _draft_sampling(self, seqs: list[Sequence]) -> DraftSampling | None:
        idx = [i for i, s in enumerate(seqs) if s.params.samples_drafts]
        if not idx:
            return None
        sub = [seqs[i] for i in idx]
        t, k, p = self._params(sub)
        return DraftSampling(to_device(idx, torch.long, self.device), t, k, p, [s.generator for s in sub],
                             self._settings(sub))

    def _verify(self, seqs, proposal, sampling: DraftSampling | None, logits: torch.Tensor) -> VerifyResult:
        """All rows in one `dflash::verify_block`; each sampled row takes K + 1 uniforms (`_uniforms`)."""
        drafts = proposal.draft_tokens  # [B, K]
        b, k = drafts.shape
        modes = [GREEDY if s.params.greedy else MODE_OF_ACCEPTANCE[s.params.acceptance] for s in seqs]
        u = torch.zeros(b, k + 1, device=self.device)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            u[to_device(sampled, torch.long, self.device)] = self._uniforms([seqs[i] for i in sampled], k + 1)
        draft_probs = None  # [B, K, V], rows of the rejection rule only
        if sampling is not None:
            draft_probs = proposal.draft_probs.new_zeros(b, k, proposal.draft_probs.shape[-1])
            draft_probs[sampling.rows] = proposal.draft_probs
        modes_t = to_device(modes, torch.int32, self.device)
        num_accepted, bonus = verify_block(drafts, logits, draft_probs, u, modes_t, *self._params(seqs))
        return VerifyResult(num_accepted, bonus)
