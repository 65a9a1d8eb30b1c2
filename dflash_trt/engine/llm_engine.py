"""LLMEngine: tokenizer + scheduler + model runner; add_request / step / abort, and generate() on top."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_trt.draft_schedule import check_table, expand
from dflash_trt.engine.adaptive_draft import AdaptiveDraftLen
from dflash_trt.engine.detokenizer import IncrementalDetokenizer, client_text, find_stop, stop_search_start
from dflash_trt.engine.grammar import GrammarCompiler
from dflash_trt.engine.logprobs import TokenLogprob
from dflash_trt.engine.model_runner import ModelRunner
from dflash_trt.engine.prompt_encoder import PromptEncoder
from dflash_trt.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from dflash_trt.engine.sequence import Sequence
from dflash_trt.layers.attention import KERNEL_MAX_QUERIES
from dflash_trt.layers.linear import kernel_layout, row_invariant_rows
from dflash_trt.layers.sampler import PositionalUniforms
from dflash_trt.models.dflash import DFlashDrafter, load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.models.tokenizer import load_tokenizer
from dflash_trt.sampling_params import SamplingParams, is_int
from dflash_trt.spec.draft_tree import check_tree_nodes
from dflash_trt.spec.draft_vocab import cut_draft_vocab

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
    # Greedy tokens of a bf16 head through its int8 screen on the CPU (layers/greedy_head.py: the same tokens,
    # about half the head's bytes read); False: the full head every step.
    screen_head: bool = True
    # The drafter's C step with int8 projections (cpu_ops.Int8Weight): half the bytes a step streams; drafts may
    # differ slightly from bf16's (the target's verify keeps the output exact). None: where it is faster (AVX512-VNNI;
    # on AVX2 it ties at a block's 8 rows and accepts a little less); True: wherever an int8 kernel runs.
    int8_drafter: bool | None = None
    draft_len_schedule: dict[int, int] = field(default_factory=dict)  # batch size -> K (default: max_draft_len)
    # The draft_len_schedule where the target's CPU linears have no AMX tiles (None: draft_len_schedule): there a
    # verify step's rows cost their dot products, so drafting stops paying at fewer rows.
    draft_len_schedule_without_amx: dict[int, int] | None = None
    # batch-size threshold -> draft tree nodes (spec/draft_tree.py; the draft_len_schedule's rule, 0 or absent: a
    # chain): steps whose rows are greedy or sampled by the "match" rule verify that many drafts chosen from each
    # slot's top tokens, K slots deep.
    draft_tree: dict[int, int] = field(default_factory=dict)
    # The draft_tree table where the target's CPU linears have no AMX tiles (None: draft_tree): there each extra
    # verify row costs its dot products (benchmarks/README.md, "AVX2 laptops and CPUs without AMX").
    draft_tree_without_amx: dict[int, int] | None = None
    # Speculative steps also weigh up to this many tokens copied from the row's own context where its last tokens
    # occurred before (spec/context_lookup.py): in a tree its prefixes take the nodes where likelier than the drafter's
    # paths (the node count stays draft_tree's); a chain drafts it instead of the drafter's where it expects more
    # accepted tokens (greedy and "match" rows). 0: none.
    lookup_nodes: int = 0
    adaptive_draft_len: bool = False  # run K=0 where plain steps measure faster (engine/adaptive_draft.py)
    load_window: int = 8  # the schedule's K follows the most requests running over this many steps (scheduler.py)
    # Draft among the drafter's N most frequent tokens (spec/draft_vocab.py). None: all the tokens its
    # draft_vocab.json lists (the whole vocabulary when it ships none); 0: the whole vocabulary.
    draft_vocab_size: int | None = None
    max_queue_len: int = 256  # requests waiting for a row; more are refused (HTTP 503)
    max_prefill_tokens: int = 512  # prompt tokens per step, over all prefill chunks
    # Tokens a prompt chunk holds, the grid prompt reuse works in (scheduler.py). None: what the target runs in one
    # call of this CPU's layer kernel, 256 tokens with AMX tiles, else 32 (FINE_PREFILL_GRID; about as fast a token as
    # 512-token chunks, benchmarks/README.md "A finer prefill grid"), up to max_prefill_tokens; else max_prefill_tokens.
    prefill_chunk: int | None = None
    prefix_reuse: bool = True  # rows give the prompt chunks they hold to later requests (scheduler.py, reuse_rows)

    def __post_init__(self) -> None:
        # types first, naming the field: a float row count failed deep in torch after every weight had loaded, and
        # speculative='no' drafted
        for name in ("max_batch_size", "max_model_len", "lookup_nodes", "load_window", "max_queue_len",
                     "max_prefill_tokens", *(n for n in ("max_draft_len", "draft_vocab_size", "prefill_chunk")
                                             if getattr(self, n) is not None)):
            if not is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("speculative", "pack_weights", "screen_head", "adaptive_draft_len", "prefix_reuse",
                     *(("int8_drafter",) if self.int8_drafter is not None else ())):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_draft_len is not None and self.max_draft_len < 0:  # (before the tables a K is applied to)
            raise ValueError(f"max_draft_len must be >= 0, got {self.max_draft_len}")
        check_table(self.draft_tree, "draft_tree", "nodes")
        check_table(self.draft_len_schedule, "draft_len_schedule", "K")
        check_table(self.draft_len_schedule_without_amx or {}, "draft_len_schedule_without_amx", "K")
        check_table(self.draft_tree_without_amx or {}, "draft_tree_without_amx", "nodes")
        if self.lookup_nodes < 0:
            raise ValueError(f"lookup_nodes must be >= 0, got {self.lookup_nodes}")
        if self.prefill_chunk is not None and not 1 <= self.prefill_chunk <= self.max_prefill_tokens:
            raise ValueError(f"prefill_chunk must be in 1..max_prefill_tokens ({self.max_prefill_tokens}), got "
                             f"{self.prefill_chunk}")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device={self.device!r} is not a torch device ({e})") from e
        kind, index = device.type, device.index
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: the runtime runs on 'cpu' or 'cuda'")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}, but torch sees no CUDA device (torch.cuda.is_available() is "
                             "False); run on 'cpu' (--device cpu)")
        if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
            raise ValueError(f"device={self.device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids only
    text: str
    finish_reason: str
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id (not eos) that ended the answer
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)  # drafts of each speculative step: K, or a tree's nodes
    tau: float | None = None  # None where no speculative step ran
    acceptance_histogram: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens another request's cache row held (vLLM's name)
    decode_time: float = 0.0
    time_to_first_token: float | None = None  # seconds from arrival (queueing included); None: no token came
    latency: float | None = None  # seconds from arrival to the last token; None: it did not finish with one
    logprobs: list[TokenLogprob] | None = None  # one per generated id, where the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt id after the first, where asked for
    error: str | None = None  # why it ended, where finish_reason is "error"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def total_draft_tokens(self) -> int:
        return sum(self.draft_lens)

    @property
    def total_accepted_draft_tokens(self) -> int:
        """Draft tokens kept: each step commits its accepted drafts plus one bonus token."""
        return sum(max(0, n - 1) for n in self.acceptance_lengths)

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first (which prefill produces) over the decode wall time."""
        n = self.num_tokens - 1
        return n / self.decode_time if n > 0 and self.decode_time > 0 else 0.0


# How the target's CPU linears run, for the engine's start-up line (layers/linear.py kernel_layout).
_LINEAR_PATHS = {"tiles": "AMX tiles", "panels": "the kernel's AVX2 panels",
                 "rows": "the kernel's dot products (no AMX)", None: "torch/oneDNN"}


def capped_note(asked: int | None, positions: int) -> str | None:
    """The warning for a --max-model-len asked for past the target's `positions` (None where none was asked, or it
    fits): the engine caps it, which should not pass unseen."""
    if asked is None or asked <= positions:
        return None
    return (f"warning: --max-model-len {asked} is past the target's max_position_embeddings ({positions}, its "
            f"config.json): requests get at most {positions} tokens")


# The default prefill grid where the target's linears do not run on AMX tiles: a chunk of this many tokens costs
# little more than its share of a long prompt's forward, and a chat's next turn takes over its history in chunks this
# fine (AVX2 panels, which run 256 tokens a call: lone prompts of 60-800 tokens 1.5-3.5% slower than on a 256-token
# grid, the next turn's first token 1.45x sooner after a 300-token turn and 2.8x after a 150-token one;
# benchmarks/README.md, "A finer prefill grid on AVX2")
FINE_PREFILL_GRID = 32


def _prefill_chunk(config: EngineConfig, target, layout: str | None) -> int:
    """The prefill grid config asks for, or by default what the target runs in one call of its CPU layer kernel,
    FINE_PREFILL_GRID at most off AMX tiles (`layout`), within the budget."""
    if config.prefill_chunk is not None:
        return config.prefill_chunk
    one_call = getattr(target, "one_call_max_tokens", 0)
    if layout != "tiles":
        one_call = min(one_call, FINE_PREFILL_GRID)
    return min(one_call, config.max_prefill_tokens) if one_call else config.max_prefill_tokens


def _holds_stop(tokenizer, ids: list[int], stops: list[str], tail: int, min_tokens: int = 0) -> bool:
    """Whether the text of ids holds a stop string that ends past the text of their first min_tokens: decoded once
    for all of them (a request may send thousands), as a client gets it (a stop string holding U+FFFD would
    otherwise match half a character). Only the last `tail` ids are decoded (the answer's text up to them was
    checked as they came), from a character's first token: a window that starts inside a character decodes its
    bytes there as U+FFFD, which a stop string holding one matched (back 3 tokens at most: a character is 4 bytes at
    most and a token one at least)."""
    start = max(len(ids) - tail, 0)
    text = client_text(tokenizer, ids[start:])
    for before in range(start - 1, max(start - 4, -1), -1):
        if not text.startswith("\ufffd"):
            break
        start, text = before, client_text(tokenizer, ids[before:])
    return find_stop(text, stops, stop_search_start(tokenizer, ids[start:], min_tokens - start))[0] >= 0


def _prompt_list(prompts) -> list[str | list[int]]:
    """The prompts as a list of prompts: a string or a sequence of token ids alone is one prompt (iterating it would
    make a prompt of each character or id); ids as Python ints (numpy's integers taken); TypeError naming
    the first prompt that is neither text nor ids."""
    if isinstance(prompts, str) or (_is_ids(prompts) and len(prompts) > 0):
        prompts = [prompts]
    if not _is_sequence(prompts):
        raise TypeError("prompts must be a string, a list of token ids or a list of those, got "
                        f"{type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or _is_ids(p)):
            raise TypeError(f"prompts[{i}] must be a string or a list of token ids, got {p!r:.60}")
        out.append(p if isinstance(p, str) else [int(t) for t in p])
    return out


def _is_sequence(value) -> bool:
    return isinstance(value, (list, tuple))


def _is_ids(value) -> bool:
    """A list or tuple of token ids (ints, numpy's too; no bools or floats)."""
    return _is_sequence(value) and all(map(is_int, value))


@dataclass
class StreamChunk:
    """What one step added to a streamed answer: its new text (held back while it may start a stop string or a
    character), the tokens generated so far, and, on the last chunk, the request's whole output."""

    text: str
    num_tokens: int
    output: RequestOutput | None = None


class LLMEngine:
    """The target, its drafter and a scheduler of requests: `generate` answers prompts with continuous batching,
    `stream` one prompt as its steps make the text; `add_request` / `step` drive the engine by hand (EngineLoop
    does, for the servers). Threads may share an engine: its steps and its tokenizer take turns."""

    def __init__(self, target: torch.nn.Module, tokenizer, drafter: DFlashDrafter | None, config: EngineConfig) -> None:
        self.config = config
        # a step holds the runner's buffers and the KV cache: two threads stepping at once wrote over each other's
        # rows (garbled text, once a heap corruption); the tokenizer raises when called from two threads at once
        self._step_lock = threading.Lock()
        self._encode_lock = threading.Lock()
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter if config.speculative else None
        if config.speculative and drafter is None:
            raise ValueError("speculative decoding needs a drafter: pass one, or disable speculation (--no-spec)")
        max_pos = target.config.max_position_embeddings
        if config.max_model_len > max_pos:  # routine for a default; the CLIs warn where it was asked for (capped_note)
            logger.info("max_model_len %d is past the target's max_position_embeddings (%d): capped",
                        config.max_model_len, max_pos)
        self.max_position_embeddings = max_pos
        self.max_model_len = min(config.max_model_len, max_pos)
        self.prompt_encoder = PromptEncoder(tokenizer, self.max_model_len)
        self.grammars = GrammarCompiler(tokenizer, target.config.vocab_size, self.eos_token_ids)
        # both tables, whichever this CPU takes: the target cache keeps room for the larger
        trees = {key: getattr(config, key) or {} for key in ("draft_tree", "draft_tree_without_amx")}
        most_nodes = 0
        if self.drafter is not None:
            for key, tree in trees.items():
                check_tree_nodes(max(tree.values(), default=0), f"{key}={tree}")
            most_nodes = max((n for tree in trees.values() for n in tree.values()), default=0)
        self.runner = ModelRunner(target, self.drafter, config.max_batch_size, self.max_model_len, config.pack_weights,
                                  self._draft_vocab(config), config.screen_head, config.int8_drafter,
                                  config.lookup_nodes if self.drafter is not None else 0, most_nodes)
        k = config.max_draft_len
        if self.drafter is not None:
            limit = self.runner.max_draft_len
            k = limit if k is None else k
            if not 1 <= k <= limit:
                raise ValueError(
                    f"max_draft_len={k} is out of range: draft_block_size={limit + 1} (checkpoint) allows 1..{limit}"
                )
        self.max_draft_len = k if self.drafter is not None else 0
        # Verify rows cost about nothing on a GPU or on AMX tiles; elsewhere the smaller tables, where there are any.
        layout = kernel_layout(target) if config.device == "cpu" else None
        cheap_rows = config.device != "cpu" or layout == "tiles"

        def this_cpu(table: dict[int, int], without_amx: dict[int, int] | None) -> dict[int, int]:
            return table if cheap_rows or without_amx is None else without_amx

        schedule = this_cpu(config.draft_len_schedule, config.draft_len_schedule_without_amx)
        self.draft_tree = this_cpu(config.draft_tree, config.draft_tree_without_amx)
        for key in ("draft_len_schedule", "draft_len_schedule_without_amx"):  # both, whichever this CPU takes
            table = getattr(config, key) or {}
            if self.drafter is not None and max(table.values(), default=0) > self.max_draft_len:
                raise ValueError(f"{key}={table}: K above max_draft_len={self.max_draft_len}")
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_batch_size, max_model_len=self.max_model_len, max_draft_len=self.max_draft_len,
            draft_len_schedule=dict(schedule) if self.drafter is not None else {},
            max_queue_len=config.max_queue_len, max_prefill_tokens=config.max_prefill_tokens,
            prefill_chunk=_prefill_chunk(config, target, layout), load_window=config.load_window,
            reuse_rows=config.prefix_reuse,
            # a hybrid target's rows give their prompts on only as far as they hold the recurrent state after them
            holds_prefix=getattr(self.runner.target_cache, "holds_prefix", None),
        ))
        if self.drafter is not None and config.lookup_nodes > self.runner.max_draft_len:
            raise ValueError(f"lookup_nodes={config.lookup_nodes}: a context lookup branch is at most "
                             f"{self.runner.max_draft_len} tokens deep (the drafter's block_size - 1)")
        self.adaptive = AdaptiveDraftLen() if config.adaptive_draft_len and self.drafter is not None else None
        self._busy_since: float | None = None  # the end of the last step that left decoding requests behind
        on_cpu = self.drafter is not None and config.device == "cpu"
        self.exact_rows = row_invariant_rows(target) if on_cpu else None
        self.attention_tokens = getattr(target, "kernel_attention_tokens", 0)
        if self.exact_rows is None and on_cpu and config.dtype != "float32":
            # said, not hidden: README promises bf16 greedy equality where the kernels serve every linear
            logger.warning("engine: this target's %s verify steps do not round as one-token steps do (the CPU "
                           "kernels do not serve all of its linears here: oneDNN's or torch's ops run them): greedy "
                           "speculative output can part from plain greedy output at near-ties; --dtype float32 keeps "
                           "them equal", config.dtype)
        self._note_cut_steps(config.max_batch_size)
        head = getattr(target, "greedy_head", None)
        table = getattr(self.drafter, "kernel_table", None)
        logger.info(
            "engine: %s, dtype %s, rows %d, max_model_len %d, K %d, target_layer_ids %s, draft vocabulary %s, "
            "K by batch size %s, draft tree %s, context lookup %s, CPU linears %s, greedy head %s, drafter tables %s",
            "speculative" if self.drafter is not None else "autoregressive", config.dtype,
            config.max_batch_size, self.max_model_len, self.max_draft_len,
            list(self.runner.capture), "whole" if self.runner.draft_vocab_size is None else self.runner.draft_vocab_size,
            self.scheduler.config.draft_len_schedule or ("none, K everywhere" if self.drafter is not None else "-"),
            self.draft_tree or "none", self.runner.lookup_nodes or "off",
            _LINEAR_PATHS[layout] if config.device == "cpu" else "-",
            f"int8 screen up to {head.max_rows} rows" if head is not None else "full",
            "-" if table is None else "int8" if table.int8 else "bf16",
        )

    def _draft_vocab(self, config: EngineConfig) -> torch.Tensor | None:
        if self.drafter is None:
            return None
        return cut_draft_vocab(self.drafter.draft_vocab, config.draft_vocab_size)

    @classmethod
    def from_dirs(cls, target_dir: str | Path, drafter_dir: str | Path | None, config: EngineConfig) -> "LLMEngine":
        """An engine over a Hugging Face-format target directory and a z-lab-format drafter directory (None without
        speculation). No build checked them: their weights are checked finite as they load (a NaN would run, writing
        token 0 forever), and the tokenizer as a build checks it."""
        target = load_target(target_dir, config.torch_dtype, config.device, check_finite=True)
        drafter = None
        if config.speculative:
            if drafter_dir is None:
                raise ValueError("speculative decoding needs --drafter DIR (or pass --no-spec)")
            drafter = load_drafter(drafter_dir, target.config, config.torch_dtype, config.device, check_finite=True)
        tokenizer = load_tokenizer(target_dir, target.config.vocab_size)
        return cls(target, tokenizer, drafter, config)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.target.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's token ids: as written, or as a user turn of the tokenizer's chat template (chat=True)."""
        if not isinstance(prompt, str):  # an int failed in len(), a list of ids deep in the tokenizer
            raise TypeError(f"encode takes text, got {type(prompt).__name__} (token ids need no encoding)")
        with self._encode_lock:
            return self.prompt_encoder.encode(prompt, chat)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict | None = None, add_special_tokens: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
        """PromptEncoder.encode_chat with this engine's tokenizer (the options are documented there)."""
        with self._encode_lock:
            return self.prompt_encoder.encode_chat(
                messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                chat_template=chat_template, template_kwargs=template_kwargs, add_special_tokens=add_special_tokens,
                tools=tools)

    def check_prompt_ids(self, prompt_ids: list[int]) -> None:
        """ValueError unless every id is a token of the target: in a step, the embedding lookup would fail every
        request batched with this one."""
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}, got {bad[:5]}")

    def make_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """A request, checked against this engine (ValueError for a prompt the context cannot hold, a token id
        past the vocabulary, ...), not yet queued."""
        if not isinstance(params, SamplingParams):  # a dict failed later with an AttributeError
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        # checked anew, and the request's own: a field set after construction skipped the checks (max_new_tokens 0
        # gave a token, a stop string set alone stopped at each of its characters), and one set while it ran changed it
        params = dataclasses.replace(params)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate"
            )
        self.check_prompt_ids(prompt_ids)
        params.check_token_ids(self.target.config.vocab_size, self.eos_token_ids)
        seq = Sequence(prompt_ids, params, self.eos_token_ids)
        seq.uniforms = PositionalUniforms(params.seed)
        seq.generator = torch.Generator(device="cpu").manual_seed(seq.uniforms.derived_seed())
        if params.structured is not None:
            seq.grammar = self.grammars.grammar(params.structured)
        if params.stop and self.tokenizer is not None:
            stops = list(params.stop)
            # Only the output's tail is decoded: as many tokens as the longest stop string can span (a token that
            # is not special decodes to at least one byte), 64 at least.
            tail = max(64, max(len(x.encode()) for x in stops) + 1)
            seq.stop_check = lambda ids: _holds_stop(self.tokenizer, ids, stops, tail, params.min_tokens)
        return seq

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request (ValueError for bad input, QueueFullError when the queue is full)."""
        if not _is_ids(prompt_ids):  # floats were cut, bools read as 0 and 1
            raise TypeError(f"prompt_ids must be a list of token ids (encode() makes them of text), got "
                            f"{prompt_ids!r:.60}")
        seq = self.make_sequence([int(t) for t in prompt_ids], params)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: int) -> bool:
        """Cancel a request; a running one leaves (and frees its row) at the next step."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether a request is queued, running, or aborted (or finished by a failed step) and not yet answered by a
        step."""
        return self.scheduler.has_work()

    def generate(
        self, prompts: str | list[int] | list[list[int] | str],
        params: SamplingParams | list[SamplingParams] | tuple[SamplingParams, ...] | None = None,
    ) -> list[RequestOutput]:
        """Generate for prompts (token ids, or text encoded as is; `encode(text, chat=True)` for the chat template)
        with continuous batching; outputs in prompt order. One prompt may be passed alone, as text or as its ids."""
        prompts = _prompt_list(prompts)
        params = SamplingParams() if params is None else params  # an empty list is one SamplingParams too few
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):  # zip would drop the unmatched prompts' outputs without a word
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams: pass one, or one per prompt")
        seqs = []
        for i, (prompt, sp) in enumerate(zip(prompts, plist)):
            try:
                seqs.append(self.make_sequence(self.encode(prompt) if isinstance(prompt, str) else prompt, sp))
            except (ValueError, TypeError) as e:
                if len(prompts) == 1:
                    raise
                # which of a batch's prompts: "empty prompt" or a context overrun named none of them
                which = f"prompts[{i}]" + (f" with params[{i}]" if isinstance(params, (list, tuple)) else "")
                e.args = (f"{which}: {e}", *e.args[1:])  # (its type and fields kept: ParamError's param)
                raise
        pending = list(reversed(seqs))
        with self._aborted_unless_done(seqs):
            # its own requests: a stream or another thread's requests batched beside them run on in their own calls
            # (waiting for them, a 4-token answer took a 300-token one's time)
            while pending or not all(s.is_finished for s in seqs):
                while pending and self.scheduler.try_add(pending[-1]):
                    pending.pop()
                self.step()
        return [self.make_output(s) for s in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """One prompt's answer as its steps make it (requests queued beside it step along): text deltas, the last
        chunk carrying the whole output. Leaving the loop early (break, an exception, Ctrl-C) aborts the request."""
        # checked as generate's (bools or floats are no token ids); an empty list is one prompt here, an empty one
        prompts = [[]] if _is_sequence(prompt) and not len(prompt) else _prompt_list(prompt)
        if len(prompts) != 1:
            raise ValueError(f"stream takes one prompt, got {len(prompts)}")
        params = SamplingParams() if params is None else params
        seq = self.make_sequence(self.encode(prompts[0]) if isinstance(prompts[0], str) else prompts[0], params)
        # the request's own copy of params: the caller's may change while it streams
        detok = IncrementalDetokenizer(self.tokenizer, seq.params.stop, seq.params.min_tokens)
        with self._aborted_unless_done([seq]):
            while not self.scheduler.try_add(seq):  # a full queue: wait for room, as generate does
                self.step()
            while True:
                if not seq.is_finished:  # (another call's step, between two chunks, may have finished it)
                    self.step()
                if seq.is_finished:
                    out = self.make_output(seq)
                    yield StreamChunk(detok.delta(seq.output_ids, out.text), out.num_tokens, out)
                    return
                if text := detok.delta(seq.output_ids):
                    yield StreamChunk(text, len(seq.output_ids))

    @contextlib.contextmanager
    def _aborted_unless_done(self, seqs: list[Sequence]):
        """Requests a call queued are aborted where it ends before they finish (an error in a step, Ctrl-C, a
        stream left early): else they ran on, and a later call stepped them or failed on them again. At the next
        step, taking no lock: a stream's generator may be closed by the garbage collector inside the scheduler's
        locked code."""
        try:
            yield
        finally:
            for s in seqs:
                if not s.is_finished:
                    self.scheduler.abort_later(s.request_id)

    def step(self) -> "StepResult":
        """One engine iteration: prefill chunks, then one draft-verify step for every decoding request."""
        with self._step_lock:
            batch = self.scheduler.schedule()
            try:
                return self._run_batch(batch)
            except BaseException:
                self._after_failed_step(batch)
                raise

    def _after_failed_step(self, batch: ScheduledBatch) -> None:
        """Undo what a step that raised (an error, Ctrl-C) left half done, for the requests that step on in other
        calls: a prompt copy that did not land leaves its request holding nothing (it held what its row lacked, and
        answered wrongly, as did a later request taking that row over); requests the step finished before it failed
        are released (the next step decoded them on past their end); those and the aborted requests it took are
        handed to the next step to answer (they left the scheduler: nothing else would, and a server's
        fail_running no longer sees them). On a hybrid target a forward that ran has moved its rows' recurrent
        states past what they accepted: a decoding request whose row no longer holds the state after its last
        position finishes with "error" (no step could continue it; its prompt's marks stay for later requests)."""
        for c in batch.prefills:
            c.undo_takeover()
        holds = self.scheduler.config.holds_prefix
        for s in batch.decodes:
            if holds is not None and not s.is_finished and not holds(s.slot, s.num_cached):
                s.finish_reason = "error"
        finished = self._finish([c.seq for c in batch.prefills] + batch.decodes)
        self.scheduler.answer_next([*finished, *batch.aborted])

    def _finish(self, seqs: list[Sequence]) -> list[Sequence]:
        """Release the finished ones among seqs that hold a row, with their times; returns them."""
        now, finished = time.perf_counter(), []
        for s in seqs:
            if s.is_finished and self.scheduler.finish(s):
                s.stats.decode_time = now - s.decode_start if len(s.output_ids) > 1 else 0.0
                s.stats.latency = now - s.arrival
                finished.append(s)
        return finished

    def _run_batch(self, batch: ScheduledBatch) -> "StepResult":
        result = StepResult(batch)
        # (request id, chunk start) -> the requests taking a copy of that chunk (a step may carry several of a prompt's)
        copies: dict[tuple[int, int], list[Sequence]] = {}
        for c in batch.prefills:
            if c.source is not None:
                copies.setdefault((c.source.request_id, c.start), []).append(c.seq)
            if c.takes is not None:  # before any forward writes the row it copies from
                row, end = c.takes
                self.runner.copy_prompt(row, c.seq.slot, end)
                c.copied = True
        for c in batch.prefills:
            if c.source is not None:
                continue
            # one forward per chunk: batched, a chunk's rows would be padded to its neighbours' and its sums shaped by
            # them (the scheduler's grid: a prompt's K/V must not depend on what arrived with it)
            group = copies.get((c.seq.request_id, c.start), [])
            firsts = self.runner.prefill([c.seq], [c.start], [c.end], [group])
            for seq, t in zip([c.seq, *group], firsts):
                seq.num_prefilled = c.end
                if t is not None:
                    seq.decode_start = time.perf_counter()
                    seq.stats.time_to_first_token = seq.decode_start - seq.arrival
                    seq.append([t], self.max_model_len)
                    result.updated.append(seq)
        if batch.decodes:
            active = batch.decodes
            # cut first: adaptive measures and chooses between the K that runs and plain steps
            k, nodes = batch.num_draft, self._tree_nodes(active) if batch.num_draft > 0 else 0
            deep = min(self.max_draft_len, self.scheduler.draft_room(active))
            if self.drafter is not None and 0 < k < deep and self._following_predictions(active):
                k, nodes = deep, 0
            k, nodes = self._within_exact_rows(len(active), k, nodes)
            if self.adaptive is not None:
                k = self.adaptive.choose(len(active), k)
                nodes = nodes if k > 0 else 0
            result.num_draft = k
            before = (active[0].stats.draft_time, active[0].stats.verify_time)
            # more pending features than a steady step's (read before the step takes them in)
            catch_up = self.adaptive is not None and k > 0 and max(s.num_pending_features for s in active) > k + 1
            if nodes:
                emitted, nodes = self.runner.tree_step(active, k, nodes)
            else:
                emitted = self.runner.spec_step(active, k) if k > 0 else self.runner.decode_step(active)
            # Every row of a step is charged the step's time, so one row's increase is the step's.
            result.draft_time = active[0].stats.draft_time - before[0]
            result.verify_time = active[0].stats.verify_time - before[1]
            if self.adaptive is not None:
                # The whole cycle since the previous step, when the engine went straight from it to this one: idle
                # waits for requests and prompt chunks are not a decode step's cost.
                cycle = None if batch.prefills or self._busy_since is None else time.perf_counter() - self._busy_since
                self.adaptive.observe(len(active), k, cycle, [len(t) for t in emitted], catch_up)
            result.draft_tokens = (nodes or k) if k > 0 else 0
            for s, toks in zip(active, emitted):
                n = s.append(toks, self.max_model_len)
                if k > 0:
                    s.stats.acceptance_lengths.append(n)
                    s.stats.draft_lens.append(nodes or k)
                    result.acceptance_lengths.append(n)
                result.updated.append(s)
        self._finish(result.updated)
        result.updated.extend(batch.aborted)
        self._busy_since = time.perf_counter() if batch.decodes and self.has_unfinished() else None
        return result

    def _within_exact_rows(self, batch: int, k: int, nodes: int) -> tuple[int, int]:
        """K and tree nodes for a step of `batch` requests, cut where its verify forward (each request's anchor and
        drafts) would pass exact_rows: past the bf16 kernel's reach oneDNN's products round apart from a one-token
        step's (SmolLM2, 8 requests at K=4, 40 rows, half sampled with seeds: 7 of 16 answers parted from each one's
        alone, decoded plainly; none with the cut; benchmarks/batch_exactness.py); and where the step passes the
        target's kernel_attention_tokens, where a row's queries past KERNEL_MAX_QUERIES attend through SDPA (a
        gpt-oss tree of 17 nodes parted from plain decoding)."""
        if self.exact_rows is None or k == 0 or batch > self.exact_rows:  # past it plain steps round apart too
            return k, nodes
        room = self.exact_rows // batch - 1  # drafts a request can verify
        if batch * (room + 1) > self.attention_tokens:
            room = max(min(room, KERNEL_MAX_QUERIES - 1), self.attention_tokens // batch - 1)
        if room < 1:
            return 0, 0
        return (k, min(nodes, room)) if nodes else (min(k, room), 0)

    def _note_cut_steps(self, max_batch: int) -> None:
        """Say at which batch sizes _within_exact_rows drafts less than the tables ask for (in a tree, or in the
        chain a batch drafts where a row samples by the "rejection" rule)."""
        if self.exact_rows is None:
            return
        cut = []
        for b in range(1, max_batch + 1):
            k = self.scheduler.config.draft_len_for(b)
            tree = (k, expand(self.draft_tree, b) if self.draft_tree else 0)
            if k and (self._within_exact_rows(b, k, 0) != (k, 0) or self._within_exact_rows(b, *tree) != tree):
                cut.append(b)
        if cut:
            sizes = ", ".join(map(str, cut)) if len(cut) <= 4 else f"{cut[0]}-{cut[-1]} (some)"
            rows = f"at most {self.exact_rows} rows" if self.exact_rows < sys.maxsize else "any rows"
            logger.info("engine: a step verifies %s, and past %d tokens at most %d a request (the CPU kernels' reach, "
                        "linears and attention, where each row comes out as in a one-token step): at %s requests it "
                        "drafts fewer tokens than its tables ask for", rows, self.attention_tokens, KERNEL_MAX_QUERIES,
                        sizes)

    @staticmethod
    def _following_predictions(active: list[Sequence]) -> bool:
        """Whether every row of a step follows its predicted output (OpenAI's predicted outputs;
        spec/context_lookup.py): such a step drafts a chain as deep as the drafter reaches (and the rows' room)
        rather than the schedule's K (> 0), the prediction drafted where likelier than the drafter's chain, as it is
        expected to be accepted far deeper than the schedule's K plans for. (Context lookups that expect more than K
        accepted drafts, taken so too, lost: benchmarks/README.md, "Predicted outputs at one stream".)"""
        return all(s.params.prediction and not s.params.samples_drafts and s.context_lookup().follows_prediction()
                   for s in active)

    def _tree_nodes(self, active: list[Sequence]) -> int:
        """Draft tree nodes for this step's batch: the engine's draft_tree for its size when every row is greedy or
        sampled under the "match" rule (trees verify by the target's own choice at each node), else 0 (a chain)."""
        tree_rows = all(not s.params.samples_drafts for s in active)
        if not self.draft_tree or self.drafter is None or not tree_rows:
            return 0
        return expand(self.draft_tree, len(active))

    def make_output(self, s: Sequence) -> RequestOutput:
        ids, stop_reason = s.output_ids, None
        if s.finish_reason == "stop" and ids and ids[-1] in s.stop_ids:
            ids = ids[:-1]  # a stop token's text is not the answer's (vLLM's too); its id stays in token_ids
            if s.params.ignore_eos or s.output_ids[-1] not in self.eos_token_ids:
                stop_reason = s.output_ids[-1]
        text = client_text(self.tokenizer, ids) if self.tokenizer is not None else ""
        if s.params.stop:
            cut, stop = find_stop(text, s.params.stop, stop_search_start(self.tokenizer, ids, s.params.min_tokens))
            if cut >= 0:
                text, stop_reason = text[:cut], stop
        return RequestOutput(
            prompt_token_ids=s.prompt_ids,
            token_ids=list(s.output_ids),
            text=text,
            finish_reason=s.finish_reason or "length",
            stop_reason=stop_reason,
            acceptance_lengths=list(s.stats.acceptance_lengths),
            draft_lens=list(s.stats.draft_lens),
            tau=s.stats.tau,
            acceptance_histogram=s.stats.histogram(self.max_draft_len + 1) if self.drafter is not None else [],
            draft_time=s.stats.draft_time,
            verify_time=s.stats.verify_time,
            prefill_time=s.stats.prefill_time,
            num_cached_tokens=s.num_reused,
            decode_time=s.stats.decode_time,
            time_to_first_token=s.stats.time_to_first_token,
            latency=s.stats.latency,
            logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None,
            prompt_logprobs=list(s.prompt_logprobs) if s.params.prompt_logprobs is not None else None,
            error=s.error,
        )


@dataclass
class StepResult:
    """What one step did: the requests that got tokens or finished, and the step's statistics."""

    batch: ScheduledBatch
    updated: list[Sequence] = field(default_factory=list)  # got new tokens, finished or were aborted
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per decoding row (speculative)
    draft_time: float = 0.0
    verify_time: float = 0.0
    num_draft: int = 0  # the K this step ran (the schedule's, or 0 where adaptive_draft_len turned it off)
    draft_tokens: int = 0  # drafts each decoding row verified (a tree's nodes, else K)

    @property
    def batch_size(self) -> int:
        return len(self.batch.decodes)
