"""Training responses on an accelerator: one static batch straight through the target's forward.

The serving engine schedules, detokenizes and checks stops per request and per step, which is what serving needs and
what kept it at ~1.8k tok/s for 256 rows on an H200 (benchmarks/README.md, the first GPU leg). Training data needs
none of it: every row of a batch prefills at once (right-padded: a row's padding K/V sit past its own positions, and
each decode step overwrites the next one before any query can see it) and then decodes one token per row per step
until every row has stopped. Same model code and KV cache as the runtime; the batched prefill is not the engine's
(one forward per prompt chunk), so in bf16 a response can differ from the engine's on a near-tie.

`BatchGenerator(engine)` answers like the engine where `generate_responses` uses it: `encode` and `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt.engine.llm_engine import LLMEngine
from dflash_trt.layers.argmax import argmax_last
from dflash_trt.layers.attention import AttentionMetadata, HostRows
from dflash_trt.layers.sampler import sampling_probs
from dflash_trt.sampling_params import SamplingParams


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]  # the response, its stop token included (as the engine's outputs)


class BatchGenerator:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.target = engine.target
        self.encode = engine.encode

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generated]:
        """Greedy rows (temperature 0) and sampled rows (temperature alone: no top-k / top-p) in one batch. Sampled
        rows draw from one generator seeded by the batch's seeds: a batch regenerated whole is reproduced."""
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        for p in params:
            if p.top_k or p.top_p < 1 or p.ignore_eos or p.stop:
                raise ValueError("BatchGenerator samples by temperature alone and stops at stop tokens: "
                                 f"top_k={p.top_k}, top_p={p.top_p}, ignore_eos={p.ignore_eos}, stop={p.stop}")
        for ids in prompts:
            self.engine.check_prompt_ids(ids)
        target = self.target
        dev = target.embed_tokens.weight.device
        n = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        longest, max_new = int(lens.max()), max(p.max_new_tokens for p in params)
        ids = torch.zeros(n, longest, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        temps = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
        seed = hash(tuple(p.seed or 0 for p in params)) & (2**63 - 1)
        gen = torch.Generator(device=dev).manual_seed(seed) if any(p.temperature > 0 for p in params) else None
        stops = [set(p.stop_token_ids or self.engine.eos_token_ids) for p in params]
        limits = [p.max_new_tokens for p in params]

        cache = target.make_cache(n, longest + max_new)
        rows = torch.arange(n, device=dev)
        # each row's prompt length: a hybrid target keeps its recurrent state after the row's last prompt token
        host = HostRows(list(range(n)), [0] * n, lens=[len(p) for p in prompts])
        meta = AttentionMetadata.causal_step(rows, torch.arange(longest, device=dev).expand(n, longest), host)
        hidden, _ = target(ids.to(dev), meta, cache)
        token = self._pick(hidden[rows, lens - 1], temps, gen)
        positions = lens.clone()
        out: list[list[int]] = [[] for _ in range(n)]
        live = list(range(n))
        while True:
            picked = token.tolist()
            for i in live:
                out[i].append(picked[i])
            live = [i for i in live if picked[i] not in stops[i] and len(out[i]) < limits[i]]
            if not live:
                break
            # Every row steps (finished ones too: their tokens are dropped); a static batch keeps its shapes.
            meta = AttentionMetadata.causal_step(rows, positions[:, None])
            hidden, _ = target(token[:, None], meta, cache)
            token = self._pick(hidden[:, 0], temps, gen)
            positions += 1
        return [Generated(t) for t in out]

    def _pick(self, hidden: torch.Tensor, temps: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        logits = self.target.compute_logits(hidden)
        if gen is None:
            return argmax_last(logits)
        # the engine's distributions: a greedy row's is one-hot at its argmax, so it draws that token
        no_top_k, no_top_p = torch.zeros_like(temps, dtype=torch.long), torch.ones_like(temps)
        probs = sampling_probs(logits[:, None], temps, no_top_k, no_top_p)[:, 0]
        return torch.multinomial(probs, 1, generator=gen)[:, 0]
