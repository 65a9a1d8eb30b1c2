"""LLMEngine: tokenizer + model runner + the generation loop over a batch of requests."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trt.engine.model_runner import ModelRunner
from dflash_trt.engine.sequence import Sequence
from dflash_trt.models.dflash import DFlashDrafter, load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    max_batch_size: int = 8
    max_model_len: int = 2048  # prompt + generated tokens per request
    max_draft_len: int | None = None  # K; None: the drafter's block_size - 1
    speculative: bool = True  # False: plain autoregressive decoding in the same runtime
    dtype: str = "float32"
    device: str = "cpu"
    pack_weights: bool = True  # oneDNN-prepacked projections on the CPU (bit-identical, about 2x faster GEMVs)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str
    finish_reason: str
    acceptance_lengths: list[int] = field(default_factory=list)
    tau: float = 0.0
    acceptance_histogram: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which prefill produces) over the decode wall time."""
        n = self.num_tokens - 1
        return n / self.decode_time if n > 0 and self.decode_time > 0 else 0.0


class LLMEngine:
    def __init__(self, target: torch.nn.Module, tokenizer, drafter: DFlashDrafter | None, config: EngineConfig) -> None:
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter if config.speculative else None
        if config.speculative and drafter is None:
            raise ValueError("speculative decoding needs a drafter: pass one, or disable speculation (--no-spec)")
        max_pos = target.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len, max_pos)
        self.runner = ModelRunner(target, self.drafter, config.max_batch_size, self.max_model_len, config.pack_weights)
        k = config.max_draft_len
        if self.drafter is not None:
            limit = self.runner.max_draft_len
            k = limit if k is None else k
            if not 1 <= k <= limit:
                raise ValueError(
                    f"max_draft_len={k} is out of range: draft_block_size={limit + 1} (checkpoint) allows 1..{limit}"
                )
        self.max_draft_len = k if self.drafter is not None else 0
        logger.info(
            "engine: %s, dtype %s, rows %d, max_model_len %d, K %d, target_layer_ids %s",
            "speculative" if self.drafter is not None else "autoregressive", config.dtype,
            config.max_batch_size, self.max_model_len, self.max_draft_len,
            list(self.runner.capture),
        )

    @classmethod
    def from_dirs(cls, target_dir: str | Path, drafter_dir: str | Path | None, config: EngineConfig) -> "LLMEngine":
        from transformers import AutoTokenizer

        target = load_target(target_dir, config.torch_dtype, config.device)
        drafter = None
        if config.speculative:
            if drafter_dir is None:
                raise ValueError("speculative decoding needs --drafter DIR (or pass --no-spec)")
            drafter = load_drafter(drafter_dir, target.config, config.torch_dtype, config.device)
        if not any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise FileNotFoundError(f"{target_dir}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        return cls(target, tokenizer, drafter, config)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.target.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.tokenizer(prompt)["input_ids"]

    def make_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate"
            )
        seq = Sequence(prompt_ids, params, self.eos_token_ids)
        seq.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            seq.generator.manual_seed(params.seed)
        else:
            seq.generator.seed()
        if params.stop and self.tokenizer is not None:
            stops = list(params.stop)
            seq.stop_check = lambda ids: any(x in self.tokenizer.decode(ids[-64:]) for x in stops)
        return seq

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for token-id prompts, max_batch_size rows at a time; outputs in prompt order."""
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, plist)]
        for i in range(0, len(seqs), self.config.max_batch_size):
            self._run_batch(seqs[i : i + self.config.max_batch_size])
        return [self._output(s) for s in seqs]

    def _run_batch(self, seqs: list[Sequence]) -> None:
        for slot, s in enumerate(seqs):
            s.slot = slot
        firsts = self.runner.prefill(seqs)
        decode_start = time.perf_counter()
        for s, t in zip(seqs, firsts):
            s.append([t], self.max_model_len)
            if s.is_finished:
                s.stats.decode_time = 0.0
        active = [s for s in seqs if not s.is_finished]
        while active:
            k = self._draft_len(active)
            emitted = self.runner.spec_step(active, k) if k > 0 else self.runner.decode_step(active)
            now = time.perf_counter()
            for s, toks in zip(active, emitted):
                n = s.append(toks, self.max_model_len)
                if k > 0:
                    s.stats.acceptance_lengths.append(n)
                if s.is_finished:
                    s.stats.decode_time = now - decode_start
            active = [s for s in active if not s.is_finished]

    def _draft_len(self, seqs: list[Sequence]) -> int:
        """K for this step: the configured K, capped by what any row still needs and by the context."""
        if self.drafter is None:
            return 0
        need = max(s.remaining for s in seqs)
        room = min(self.max_model_len - 1 - s.num_cached for s in seqs)
        return max(0, min(self.max_draft_len, need, room))

    def _output(self, s: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        for stop in s.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return RequestOutput(
            prompt_token_ids=s.prompt_ids,
            token_ids=list(s.output_ids),
            text=text,
            finish_reason=s.finish_reason or "length",
            acceptance_lengths=list(s.stats.acceptance_lengths),
            tau=s.stats.tau,
            acceptance_histogram=s.stats.histogram(self.max_draft_len + 1) if self.drafter is not None else [],
            draft_time=s.stats.draft_time,
            verify_time=s.stats.verify_time,
            prefill_time=s.stats.prefill_time,
            decode_time=s.stats.decode_time,
        )
