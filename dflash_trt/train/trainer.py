"""The DFlash drafter trainer (arXiv 2602.06036 §4.2, §A.1).

Only the drafter's layers, fc and norms train; the target's embedding and lm_head are shared and
frozen. Each step draws sequences, samples random anchors inside their responses (train/blocks.py),
runs every block of a sequence in one drafter forward under the block-sparse mask, and minimises the
position-decayed cross-entropy (with `distill`, mixed with the KL to the target's own next-token distribution:
train/teacher.py). AdamW, linear warmup then cosine decay, gradient clipping.
checkpoint.pt (drafter, optimizer, step, RNG) makes a run resumable; drafter/ holds the best
checkpoint so far in z-lab's format, judged by the held-out acceptance length tau (with nothing held out, the latest).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import shutil
import signal
import statistics
import time
from collections import deque
from itertools import zip_longest
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash_trt.dir_swap import signals_held
from dflash_trt.hardware import native_bf16
from dflash_trt.layers.linear import pack_linears
from dflash_trt.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    build_target_layer_ids,
    load_drafter,
    new_drafter,
    save_drafter,
)
from dflash_trt.models.weights import WeightSet
from dflash_trt.signals import signal_handlers
from dflash_trt.spec.draft_vocab import rank_tokens, save_draft_vocab
from dflash_trt.train.blocks import (IGNORE, TrainBlocks, batch_training_mask, blocks_at, next_step_anchors,
                                     sample_blocks)
from dflash_trt.train.feature_cache import FeatureSource
from dflash_trt.train.teacher import Teacher, distill_loss

logger = logging.getLogger(__name__)

# A time budget plans by the median time of the latest this many steps: the first ones pay one-off costs (a GPU's kernel
# compilation and allocator warm-up made them 3x slower than the rest), and a stray slow step should not move the plan.
PACE_STEPS = 20


@contextlib.contextmanager
def _written(tmp: Path) -> Iterator[None]:
    """Writes to `tmp` (a file or directory) that fail come out as an OSError naming it and the space left, `tmp`
    removed: a full disk read as safetensors' or torch.save's own errors ("unexpected pos 3550784 vs 3550736")."""
    from safetensors import SafetensorError

    def remove() -> None:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as e:  # torch.save's are RuntimeErrors
        remove()
        try:
            free = f"; {shutil.disk_usage(tmp.parent).free / 2**20:.0f} MiB free there"
        except OSError:
            free = ""
        raise OSError(f"cannot write {tmp}: {e}{free}") from e
    except BaseException:  # a signal off the main thread, where signals_held cannot hold it
        remove()
        raise


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient is not finite: nothing of it is applied."""


@dataclass
class TrainConfig:
    num_layers: int = 2
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # None: feature_layer_ids(num_features)
    num_features: int | None = None  # None: 5, or as many as a target under 8 layers has distinct (feature_layer_ids)
    mask_token_id: int | None = None  # None: must be given by the caller (a token the target never emits)
    steps: int = 2000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    anchors_per_seq: int = 32
    seqs_per_step: int = 4
    micro_batch: int | None = None  # sequences per drafter forward (None: all seqs_per_step at once)
    gamma: float | None = None  # None: by block size (7 for 16, 5 for 10, 4 for 8)
    max_seq_len: int = 1024
    init_from_target: bool = False  # start drafter layers from the target's last layers (EAGLE-style)
    init_drafter: str | None = None  # warm start from a z-lab-format drafter (e.g. a shipped one); grow_from
    eval_every: int = 250
    eval_prompts: int = 8
    eval_new_tokens: int = 96
    # Fit the run (its length, at most `steps`, and the schedule) into this much wall-clock time, its evaluations and
    # a resumed run's earlier training included (Trainer._fit_to_budget).
    time_budget_s: float | None = None
    # The loss's softmax over the draft vocabulary (the training responses' tokens, which the exported drafter
    # drafts among), as inference computes it: SmolLM2's head shrinks from 49,152 rows to ~15k, and the head was
    # two thirds of a CPU training step. False: over the whole vocabulary.
    draft_vocab_loss: bool = True
    # Keep only the N most frequent training-response tokens (None: all of them): the vocabulary the drafter ships,
    # drafts among and, with draft_vocab_loss, is trained over, so that training's softmax is inference's (the
    # shipped SmolLM2 drafter drafts among 2,048) and its head costs N rows.
    draft_vocab_size: int | None = None
    # Weight of the KL to the target's own next-token distribution (train/teacher.py) against the hard labels'
    # cross-entropy: loss = (1 - distill) * CE + distill * KL. 0: hard labels only.
    distill: float = 0.0
    # Share of each sequence's random anchors moved, before the step trains on them, to where a greedy decoding step
    # from them would start the next one (train/blocks.py next_step_anchors), judged by the drafter as it is: real
    # steps start right after a rejection, where text is harder than at a random position (benchmarks/README,
    # session 22: teacher-forced tau 2.63 at random anchors, 2.38 walking the steps). 0: random anchors only.
    steer_anchors: float = 0.0
    # bf16 autocast for the drafter's forward and backward. None: where the device multiplies bf16 natively
    # (hardware.native_bf16: GPUs from Ampere on, AMX, AVX512-BF16); elsewhere fp32, ~10x faster on an AVX2 CPU.
    bf16_autocast: bool | None = None
    seed: int = 0
    data_dir: str | None = None  # the responses and features the run trains on (recorded: --resume finds them)
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.block_size > self.max_seq_len:  # a block's positions past the sequences would never be labelled
            raise ValueError(f"block_size must be at most max_seq_len ({self.max_seq_len}), got {self.block_size}")
        if self.num_layers < 1 or self.steps < 1:
            raise ValueError("num_layers and steps must be >= 1")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if not 0.0 <= self.distill <= 1.0:
            raise ValueError(f"distill must be in [0, 1], got {self.distill}")
        if not 0.0 <= self.steer_anchors <= 1.0:
            raise ValueError(f"steer_anchors must be in [0, 1], got {self.steer_anchors}")


DEFAULT_NUM_FEATURES = 5


def feature_layer_ids(num_target_layers: int, num_features: int | None) -> list[int]:
    """The target layers a drafter fuses: z-lab's spacing (build_target_layer_ids). Where num_features is not given,
    5 of them, or on a target under 8 layers, whose layers z-lab's spacing of 5 would repeat, up to 5 spread evenly
    over all its layers. A given number is spaced as given (a repeat is the caller's to refuse)."""
    ids = build_target_layer_ids(num_target_layers, num_features or DEFAULT_NUM_FEATURES)
    if num_features is None and len(set(ids)) < len(ids):
        ids = evenly_spaced_layers(num_target_layers, min(DEFAULT_NUM_FEATURES, num_target_layers))
    return ids


def evenly_spaced_layers(num_target_layers: int, k: int) -> list[int]:
    """k distinct layers from the first to the last (k <= num_target_layers); one: the middle one."""
    return [round(i * (num_target_layers - 1) / (k - 1)) for i in range(k)] if k > 1 else [num_target_layers // 2]


def drafter_config_for(target_cfg, cfg: TrainConfig) -> DFlashConfig:
    """A drafter shaped like the target's layers (same hidden size, heads and MLP width)."""
    ids = cfg.target_layer_ids or feature_layer_ids(target_cfg.num_hidden_layers, cfg.num_features)
    if cfg.mask_token_id is None:
        raise ValueError("mask_token_id is required: a token id inside the target's embedding it never emits")
    return DFlashConfig(
        hidden_size=target_cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim, intermediate_size=target_cfg.intermediate_size, block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id, target_layer_ids=list(ids), vocab_size=target_cfg.vocab_size,
        num_target_layers=target_cfg.num_hidden_layers, rms_norm_eps=target_cfg.rms_norm_eps,
        rope=dict(target_cfg.rope), max_position_embeddings=target_cfg.max_position_embeddings,
    )


def init_from_target_layers(drafter: DFlashDrafter, target_dir: Path) -> None:
    """Copy the target's last decoder layers into the drafter's (same shapes); q/k norms stay identity."""
    w = WeightSet(target_dir)
    n_target = drafter.config.num_target_layers
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            p = f"model.layers.{n_target - len(drafter.layers) + i}."
            a = layer.self_attn
            a.q_proj.weight.copy_(w.get(p + "self_attn.q_proj.weight"))
            a.kv_proj.weight.copy_(torch.cat([w.get(p + "self_attn.k_proj.weight"), w.get(p + "self_attn.v_proj.weight")]))
            a.o_proj.weight.copy_(w.get(p + "self_attn.o_proj.weight"))
            layer.mlp.gate_up_proj.weight.copy_(torch.cat([w.get(p + "mlp.gate_proj.weight"), w.get(p + "mlp.up_proj.weight")]))
            layer.mlp.down_proj.weight.copy_(w.get(p + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(w.get(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(w.get(p + "post_attention_layernorm.weight"))
        drafter.norm.weight.copy_(w.get("model.norm.weight"))


def grow_from(drafter: DFlashDrafter, warm: DFlashDrafter, source: str) -> None:
    """Warm-start `drafter` from `warm`, which may have fewer layers: its layers come first, and each extra one
    starts with zero o_proj and down_proj, so it adds nothing to the residual stream and the deeper drafter drafts
    exactly what `warm` did until training moves them (capacity, not a restart, when a drafter underfits)."""
    check_warm_start(warm.config, drafter.config, source)
    have, want = warm.config.num_hidden_layers, drafter.config.num_hidden_layers
    missing, unexpected = drafter.load_state_dict(warm.float().state_dict(), strict=False)
    grown = tuple(f"layers.{i}." for i in range(have, want))
    if unexpected or any(not k.startswith(grown) for k in missing):
        raise ValueError(f"{source}: tensors {sorted(unexpected)} unexpected, {sorted(missing)} missing")
    with torch.no_grad():
        for layer in drafter.layers[have:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            for bias in (layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias):
                if bias is not None:
                    bias.zero_()


def check_warm_start(warm: DFlashConfig, run: DFlashConfig, source: str) -> None:
    """Refuse a warm start from a drafter that grow_from cannot grow into the run's."""
    have, want = warm.num_hidden_layers, run.num_hidden_layers
    if warm.target_layer_ids != run.target_layer_ids or have > want:
        raise ValueError(f"{source}: target_layer_ids/layers {warm.target_layer_ids}/{have} do not fit the "
                         f"run's {run.target_layer_ids}/{want} (same ids, at most as many layers)")
    widths = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    differ = [f"{k} {getattr(warm, k)} there, {getattr(run, k)} here" for k in widths
              if getattr(warm, k) != getattr(run, k)]
    if differ:
        raise ValueError(f"{source}: a drafter of another width ({'; '.join(differ)}): it cannot start this run")


def saved_run(out_dir: Path) -> dict | None:
    """{step, config} of the run checkpointed in out_dir (None if none), read without loading its tensors."""
    path = Path(out_dir) / "checkpoint.pt"
    if not path.is_file():
        return None
    try:
        # map_location: a checkpoint saved on a GPU still reads (and resumes) on a machine without one
        state = torch.load(path, weights_only=False, mmap=True, map_location="cpu")
        return {"step": state["step"], "config": state["config"],
                "shapes": {name: tuple(t.shape) for name, t in state["drafter"].items()}}
    except Exception as e:  # torch.load raises whatever its readers do on a damaged file
        # Checkpoints are renamed into place whole: this one was damaged after (a disk, a copy cut short).
        raise ValueError(f"{path} is not a readable training checkpoint ({type(e).__name__}: {e}): move it away to "
                         f"train from step 0 ({path.parent / 'drafter'} keeps the best drafter so far), or choose "
                         "another --out") from None


def shape_mismatches(saved: dict[str, tuple], dcfg: DFlashConfig) -> list[str]:
    """The tensors of a saved drafter whose shapes differ from those of a drafter built from dcfg (built on the meta
    device: shapes only, no memory)."""
    with torch.device("meta"):
        want = {name: tuple(t.shape) for name, t in DFlashDrafter(dcfg).state_dict().items()}
    return [f"{name} {list(saved.get(name, ()))} in the checkpoint, {list(want.get(name, ()))} for this target"
            for name in sorted(set(saved) | set(want)) if saved.get(name) != want.get(name)]


def warmup_share(cfg: TrainConfig, steps: int) -> float:
    """The share of a run of `steps` steps that warms up: warmup_ratio of it in whole steps, at least one."""
    return max(1, int(cfg.warmup_ratio * steps)) / steps


def lr_at(before: float, after: float, warmup: float, cfg: TrainConfig) -> float:
    """The learning rate of a step that takes the run from `before` to `after` (the shares of it done): linear warmup
    while `after` is within the `warmup` share, then cosine decay by `before` down to min_lr_ratio of cfg.lr. Step k
    of a run of N steps goes from k / N to (k + 1) / N, warming up over its first W = warmup x N steps at
    lr (k + 1) / W, then at the cosine of (k - W) / (N - W).

    A function of the shares done, not of step numbers, so that a time budget re-fitting the run's length changes how
    fast the rate moves along the curve, never where on it the rate is."""
    if after <= warmup * (1 + 1e-9):  # (k + 1) / N summed step by step lands a rounding off W / N
        return cfg.lr * min(1.0, after / warmup)
    progress = (before - warmup) / max(1.0 - warmup, 1e-9)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


class Trainer:
    """Trains on the target's device (CPU or CUDA); `features` is a FeatureCache or TargetFeatures."""

    def __init__(self, target, target_dir: Path, tokenizer, records: list[dict], features: FeatureSource,
                 out_dir: Path, cfg: TrainConfig, resume: bool = False) -> None:
        self.target, self.tokenizer, self.features, self.cfg = target, tokenizer, features, cfg
        self.device = target.embed_tokens.weight.device
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.train_records = [r for r in records if r["split"] == "train" and r["id"] in features]
        # scored from every source, not from whichever the data stores first
        self.heldout = by_source_in_turn([r for r in records if r["split"] == "heldout" and r["id"] in features])
        # What the exported drafter will draft among; evaluation drafts among it too (spec/draft_vocab.py).
        self.vocab_ids, self.vocab_counts = rank_tokens(r["response_ids"] for r in self.train_records)
        keep = cfg.draft_vocab_size
        self.vocab_ids, self.vocab_counts = self.vocab_ids[:keep], self.vocab_counts[:keep]
        # A record whose prompt fills max_seq_len has no label to train on: drawn, it would make a step of nothing.
        fits = [r for r in self.train_records if _labelled(r, cfg.max_seq_len)]
        if len(fits) < len(self.train_records):
            logger.warning("%d of %d training records have no response token within max_seq_len=%d: not drawn",
                           len(self.train_records) - len(fits), len(self.train_records), cfg.max_seq_len)
        self.train_records = fits
        if self.heldout and not any(_labelled(r, cfg.max_seq_len) for r in self.heldout):
            logger.warning("none of the %d held-out records has a response token within max_seq_len=%d: "
                           "evaluations score nothing, and %s holds the latest step's drafter", len(self.heldout),
                           cfg.max_seq_len, self.out_dir / "drafter")
        if not self.train_records:
            raise ValueError(f"no training sequences with cached features and a response token within "
                             f"--max-seq-len {cfg.max_seq_len} (their prompt first, as the chat template writes it)")
        if not self.heldout:
            logger.warning("no held-out records: evaluations score nothing, and %s holds the latest step's drafter",
                           self.out_dir / "drafter")
        dcfg = drafter_config_for(target.config, cfg)
        if dcfg.target_layer_ids != features.target_layer_ids:
            raise ValueError(f"feature cache holds target_layer_ids={features.target_layer_ids}, "
                             f"the drafter wants {dcfg.target_layer_ids}")
        self.drafter = new_drafter(dcfg, seed=cfg.seed)
        if cfg.init_from_target:
            init_from_target_layers(self.drafter, target_dir)
        if cfg.init_drafter:
            grow_from(self.drafter, load_drafter(cfg.init_drafter, target.config), cfg.init_drafter)
        self.drafter.to(self.device)
        self.embed = target.embed_tokens.weight.detach()  # frozen, shared
        self.autocast = native_bf16(self.device.type) if cfg.bf16_autocast is None else cfg.bf16_autocast
        # fp32 steps multiply hidden states by the head in fp32 (autocast casts them otherwise)
        self.head = target.lm_head_weight.detach() if self.autocast else target.lm_head_weight.detach().float()
        # label_of[token] is its row in self.head; -1 (never a label) for a token outside a restricted head.
        self.label_of: torch.Tensor | None = None
        if cfg.draft_vocab_loss and self.vocab_ids.numel():
            self.head = self.head[self.vocab_ids.to(self.device)]
            self.label_of = torch.full((target.lm_head_weight.shape[0],), -1, dtype=torch.long)
            self.label_of[self.vocab_ids] = torch.arange(self.vocab_ids.numel())
        self.teacher = Teacher(target, dcfg.target_layer_ids, self.head) if cfg.distill else None
        params = [p for p in self.drafter.parameters()]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.best_score = -math.inf  # held-out tau, or minus the held-out loss when eval_prompts is 0
        self.best_loss = math.inf  # breaks ties of tau (a weak drafter's 1.00 at every evaluation of few prompts)
        # An evaluation's wall-clock time with the export and checkpoint it brings (None: not measured in this
        # process); a time budget keeps room for those still ahead. And the times of this process's latest steps.
        self._eval_s: float | None = None
        self._step_s: deque[float] = deque(maxlen=PACE_STEPS)
        # The share of the LR schedule done (lr_at): k / steps, unless a time budget re-fitted the run's length
        self._progress = 0.0
        # --steps, the most a time budget may fit the run to; and the seconds the checkpoint's run trained before
        # this process (a resumed budget counts them)
        self.max_steps = cfg.steps
        self._trained_s, self._started = 0.0, None
        self.log_path = self.out_dir / "train_log.jsonl"
        if resume and (self.out_dir / "checkpoint.pt").is_file():
            self._load_checkpoint()
        self._saved_step = self.step
        self._cut_log()
        _settle_export(self.out_dir / "drafter")

    def _cut_log(self) -> None:
        """Drop the log's lines past the step training starts from: a run killed after its last checkpoint logged
        steps that this one trains again (and a torn last line)."""
        if not self.log_path.is_file():
            return
        lines = self.log_path.read_text().splitlines()
        keep = [line for line in lines if _logged_step(line) <= self.step]
        if len(keep) < len(lines):
            tmp = self.log_path.with_name(self.log_path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.log_path)

    # -- one batch of sequences ------------------------------------------------------------------------
    def _token_ids(self, rec: dict) -> torch.Tensor:
        return torch.tensor((rec["prompt_ids"] + rec["response_ids"])[: self.cfg.max_seq_len])

    def _sample(self, rec: dict, gen: torch.Generator) -> TrainBlocks | None:
        cfg = self.cfg
        return sample_blocks(self._token_ids(rec), len(rec["prompt_ids"]), cfg.anchors_per_seq, cfg.block_size,
                             self.drafter.config.mask_token_id, gen, cfg.gamma)

    def _forward(self, items: list[tuple[dict, TrainBlocks]], full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every block of every sequence in one drafter forward -> hidden [n, M, H], label rows, weights and
        positions [n, M]; `full` holds each sequence's features at least up to its last anchor.

        Sequence i's context is its first max(anchor) tokens, padded to the longest; its blocks are padded
        to the most blocks. The padded [n, 1, M, S + M] mask keeps each sequence's training mask in place
        (context columns 0.., block columns S..); padding queries see only themselves and carry no label.
        """
        cfg, dev = self.cfg, self.device
        n = len(items)
        s, m = max(int(b.anchors.max()) for _, b in items), max(b.block_ids.numel() for _, b in items)
        block_ids = torch.full((n, m), self.drafter.config.mask_token_id, dtype=torch.long)
        positions = torch.zeros(n, m, dtype=torch.long)
        labels = torch.full((n, m), IGNORE, dtype=torch.long)
        weights = torch.zeros(n, m)
        for i, (_, b) in enumerate(items):
            q = b.block_ids.numel()
            block_ids[i, :q], positions[i, :q] = b.block_ids, b.block_positions
            labels[i, :q], weights[i, :q] = self._rows_of(b.labels), b.weights
        feats = full[:, :s].to(dev, torch.float32)  # context columns past a sequence's own are masked
        block_ids, positions, labels, weights = (t.to(dev) for t in (block_ids, positions, labels, weights))
        # Built where the drafter runs: a per-sequence loop on the host cost a GPU step more than its math did.
        mask = batch_training_mask([b.anchors for _, b in items], cfg.block_size, dev)
        embeds = F.embedding(block_ids, self.embed).float()
        hidden = self.drafter.forward_train(feats, torch.arange(s, device=dev).expand(n, s), embeds, positions, mask)
        return hidden, labels, weights, positions

    def _batch_loss(self, items: list[tuple[dict, TrainBlocks]], full: torch.Tensor | None = None) -> torch.Tensor:
        """Mean over sequences of each one's decay-weighted CE, all blocks of all sequences in one forward.
        `full`: the sequences' features if already computed (long enough for _forward and the teacher)."""
        cfg, dev = self.cfg, self.device
        n = len(items)
        if full is None:
            # The teacher predicts the token at a label's position from the features before it: up to the last label.
            lengths = [int(b.anchors.max()) if self.teacher is None
                       else int(b.block_positions[b.labels != IGNORE].max()) for _, b in items]
            full = self.features.batch([r for r, _ in items], lengths)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.autocast):
            hidden, labels, weights, positions = self._forward(items, full)
            keep = labels != IGNORE
            logits = F.linear(hidden[keep], self.head).float()
        m = labels.shape[1]
        seq_of = torch.arange(n, device=dev)[:, None].expand(n, m)[keep]
        ce = F.cross_entropy(logits, labels[keep], reduction="none")
        if self.teacher is not None:
            # Slot k of a block is labelled with the token at its position; the target chose it one position back.
            teacher = self.teacher.logits(full, seq_of, positions[keep] - 1)
            ce = (1 - cfg.distill) * ce + cfg.distill * distill_loss(logits, teacher)
        ce = ce * weights[keep]
        per_seq = torch.zeros(n, device=dev).index_add(0, seq_of, ce)
        per_seq = per_seq / torch.zeros(n, device=dev).index_add(0, seq_of, weights[keep]).clamp_min(math.ulp(1.0))
        return per_seq.mean()

    @torch.no_grad()
    def _steer(self, items: list[tuple[dict, TrainBlocks]],
               gen: torch.Generator) -> tuple[list[tuple[dict, TrainBlocks]], torch.Tensor]:
        """Move a steer_anchors share of each sequence's anchors to where a greedy decoding step from them, drafted
        by the drafter as it is now, would start the next one -> the new blocks and the sequences' whole features
        (computed once, for this probe and for the loss)."""
        cfg, bsz = self.cfg, self.cfg.block_size
        ids = [self._token_ids(r) for r, _ in items]
        full = self.features.batch([r for r, _ in items], [t.numel() for t in ids])
        mask_id = self.drafter.config.mask_token_id
        moved = [torch.randperm(b.anchors.numel(), generator=gen)[: round(cfg.steer_anchors * b.anchors.numel())]
                 for _, b in items]
        probed = [i for i, idx in enumerate(moved) if idx.numel()]
        if not probed:
            return items, full
        probes = [(items[i][0], blocks_at(ids[i], items[i][1].anchors[moved[i]], bsz, mask_id)) for i in probed]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            hidden, labels, _, _ = self._forward(probes, full[probed])
            drafts = F.linear(hidden, self.head).argmax(-1)
        # Every probe's slots compared where they were drafted and read back at once: a host read per row
        # synchronises with the device each time.
        correct = (drafts == labels).view(len(probed), -1, bsz)[:, :, 1:].cpu()
        out = list(items)
        for row, i in enumerate(probed):
            anchors = items[i][1].anchors.clone()
            nxt = next_step_anchors(anchors[moved[i]], correct[row, : moved[i].numel()])
            inside = nxt <= ids[i].numel() - 2
            anchors[moved[i][inside]] = nxt[inside]
            out[i] = (items[i][0], blocks_at(ids[i], torch.unique(anchors), bsz, mask_id, cfg.gamma))
        return out, full

    def _rows_of(self, labels: torch.Tensor) -> torch.Tensor:
        """Token labels as rows of self.head; a token the head lacks (only held-out data has them) is ignored."""
        if self.label_of is None:
            return labels
        rows = self.label_of[labels.clamp_min(0)]
        return torch.where((labels == IGNORE) | (rows < 0), IGNORE, rows)

    def _batches(self, recs: list[dict], gen: torch.Generator) -> list[list[tuple[dict, TrainBlocks]]]:
        items = [(r, b) for r in recs if (b := self._sample(r, gen)) is not None]
        size = self.cfg.micro_batch or max(len(items), 1)
        return [items[i : i + size] for i in range(0, len(items), size)]

    # -- loop ---------------------------------------------------------------------------------------
    def train(self) -> None:
        """Train up to cfg.steps. Ctrl-C or SIGTERM lets the step in flight finish, saves checkpoint.pt there and
        raises KeyboardInterrupt (a second one stops at once, back to the last checkpoint)."""
        with _FinishStepOnInterrupt(self.out_dir / "checkpoint.pt") as stop:
            self._train(stop)
        if stop.requested and self.step < self.cfg.steps:
            if self._saved_step != self.step:
                self._save_checkpoint()
            raise KeyboardInterrupt

    def train_step(self, phase: Callable[[str], None] | None = None) -> dict:
        """One optimizer step on seqs_per_step random training sequences at the schedule's learning rate ->
        {step (after it), loss (the sequences' mean), lr, grad_norm (before clipping)}. `phase(name)` is called as
        each phase ends (benchmarks/profile_train_step.py times them)."""
        cfg = self.cfg
        done = phase or (lambda name: None)
        # What is left of the schedule spread evenly over the steps left: k / steps for a run of fixed length
        after = self._progress + (1.0 - self._progress) / max(1, cfg.steps - self.step)
        lr = lr_at(self._progress, after, warmup_share(cfg, self.max_steps), cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        picks = torch.randint(len(self.train_records), (cfg.seqs_per_step,), generator=self.gen).tolist()
        batches = self._batches([self.train_records[i] for i in picks], self.gen)
        done("sample blocks")
        total, n = 0.0, 0
        for batch in batches:
            full = None
            if cfg.steer_anchors:
                batch, full = self._steer(batch, self.gen)
                done("features + steering probe")
            loss = self._batch_loss(batch, full)
            done("loss forward" if full is not None else "features + loss forward")
            (loss * len(batch) / cfg.seqs_per_step).backward()
            total += loss.item() * len(batch)
            n += len(batch)
            done("backward")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip))
        if not (math.isfinite(total) and math.isfinite(grad_norm)):  # else NaN weights, exported as the drafter
            raise TrainingDiverged(f"step {self.step + 1}: loss {total / max(n, 1)}, gradient norm {grad_norm}: "
                                   f"training diverged (a learning rate of {cfg.lr:g} too high?); {self.out_dir} "
                                   "keeps what its last evaluation saved")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        done("clip + optimizer")
        self.step += 1
        self._progress = after
        return {"step": self.step, "loss": total / max(n, 1), "lr": lr, "grad_norm": grad_norm}

    def _train(self, stop: _FinishStepOnInterrupt) -> None:
        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        start = self._started = time.perf_counter()
        if cfg.time_budget_s is not None and self._eval_s is None and self.step < cfg.steps:
            with _describing(bar, "train (timing an evaluation)"):
                self._eval_s = self._measure_eval_s()
        self.drafter.train()
        last = time.perf_counter()
        while self.step < cfg.steps and not stop.requested:
            t0 = time.perf_counter()
            entry = self.train_step()
            now = time.perf_counter()
            entry["step_s"] = now - t0
            self._step_s.append(now - last)  # with the previous step's log line and progress bar
            if cfg.time_budget_s is not None:
                self._fit_to_budget(now - start)
                bar.total = cfg.steps
            evaluated = self.step % cfg.eval_every == 0 or self.step == cfg.steps
            t_eval = time.perf_counter()
            if evaluated:
                with _describing(bar, "train (evaluating)"):  # decoding held-out prompts: seconds with no step
                    entry.update(self.evaluate())
                if "val_loss" not in entry:  # nothing held out to choose by
                    self.export(self.out_dir / "drafter", entry)
                elif self._improves(entry):
                    self.best_score, self.best_loss = held_out_score(entry), entry["val_loss"]
                    self.export(self.out_dir / "drafter", entry)
                self.drafter.train()
            with self.log_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            if evaluated:
                # Last, so that the checkpoint never runs ahead of the drafter, best score and log it vouches for
                # (a kill in between resumes from the previous one, and the log is cut back to it).
                self._save_checkpoint()
            bar.set_postfix(loss=f"{entry['loss']:.3f}", **({"tau": f"{entry['val_tau']:.2f}"} if "val_tau" in entry else {}))
            bar.update(1)
            last = time.perf_counter()
            if evaluated:
                self._eval_s = last - t_eval
        bar.close()

    def _improves(self, metrics: dict) -> bool:
        """Whether an evaluation's drafter is the best so far: by held-out tau (or loss without evaluation prompts),
        at an equal tau by the lower held-out loss."""
        score = held_out_score(metrics)
        return score > self.best_score or (score == self.best_score and metrics["val_loss"] < self.best_loss)

    def _fit_to_budget(self, elapsed: float) -> None:
        """Set the run's length (at most max_steps) to the most steps that end inside time_budget_s, `elapsed` seconds
        into this process, with the evaluations they bring (every eval_every steps, and after the last) included.

        Re-fitted after every step, at the pace of the latest PACE_STEPS, so that a short budget holds to a step too;
        at least this step is trained (it ends the run, with an evaluation, where no more fit)."""
        cfg = self.cfg
        pace = statistics.median(self._step_s)
        left = cfg.time_budget_s - self._trained_s - elapsed

        def cost(n: int) -> float:  # of n more steps: they, and the evaluations from this step to their last
            s, every = self.step, cfg.eval_every
            return n * pace + self._eval_s * ((s + n) // every - (s - 1) // every + ((s + n) % every != 0))

        lo, hi = 0, max(0, self.max_steps - self.step)  # cost grows with n: the most that fit, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost(mid) <= left else (lo, mid - 1)
        if len(self._step_s) == 1 and cost(0) > left:
            logger.warning("a time budget of %.0f s is too short: a run trains at least one step and ends with an "
                           "evaluation (here ~%.1f s a step and ~%.1f s an evaluation), so this one ends ~%.0f s past "
                           "it", cfg.time_budget_s, pace, self._eval_s, cost(0) - left)
        cfg.steps = self.step + lo
        logger.debug("time budget: %.1f s left at %.3f s/step and %.1f s/evaluation -> %d steps", left, pace,
                     self._eval_s, cfg.steps)

    def _measure_eval_s(self) -> float:
        """What an evaluation costs, measured before the first one: the held-out loss whole and the decoding of one
        evaluation prompt, counted once per prompt (decoded one at a time, they dominate it). A budget ending before
        the first eval_every evaluation must keep room for the closing one, and a step's time says nothing of it."""
        t0 = time.perf_counter()
        _, decode_s = self._evaluate(1)
        n = len(self._eval_prompts())
        took = time.perf_counter() - t0 + decode_s * max(0, n - 1)
        logger.info("time budget: an evaluation takes ~%.1f s (measured decoding 1 of its %d prompts)", took, n)
        return took

    def evaluate(self) -> dict:
        """Held-out loss (fixed anchors) and, unless eval_prompts is 0, held-out tau from real speculative
        greedy decoding; a metric with nothing held out to measure is left out (a 0 would read as a score)."""
        t0 = time.perf_counter()
        metrics, _ = self._evaluate(self.cfg.eval_prompts)
        # a time budget keeps room for the next one (an evaluation before training spares it measuring one)
        self._eval_s = time.perf_counter() - t0
        return metrics

    def _eval_prompts(self) -> list[list[int]]:
        return [r["prompt_ids"] for r in self._eval_records()]

    def _eval_records(self) -> list[dict]:
        greedy = by_source_in_turn([r for r in self.heldout if r.get("mode") == "greedy"])
        return greedy[: self.cfg.eval_prompts]

    def _scored_on(self) -> list[str]:
        """The ids of the records an evaluation scores (its loss's, then its prompts'): scores of other records do
        not compare."""
        return [r["id"] for r in self.heldout[:32]] + [r["id"] for r in self._eval_records()]

    @torch.no_grad()
    def _evaluate(self, n_prompts: int) -> tuple[dict, float]:
        """evaluate(), decoding at most n_prompts of its prompts -> (its metrics, the seconds spent decoding)."""
        from dflash_trt.engine.llm_engine import DTYPES, EngineConfig, LLMEngine
        from dflash_trt.sampling_params import SamplingParams

        self.drafter.eval()
        gen = torch.Generator().manual_seed(1234)
        batches = self._batches(self.heldout[:32], gen)
        if not batches:
            return {}, 0.0
        val_loss = sum(float(self._batch_loss(b)) * len(b) for b in batches) / sum(map(len, batches))
        prompts = self._eval_prompts()[:n_prompts]
        if not prompts:
            return {"val_loss": val_loss}, 0.0
        draft = copy.deepcopy(self.drafter).to(self.target.embed_tokens.weight.dtype)
        draft.draft_vocab = self.vocab_ids if self.vocab_ids.numel() else None
        pack_linears(draft)
        # room for the longest held-out prompt (generated whole, so it can exceed max_seq_len), its new tokens and a
        # last draft block
        room = max(map(len, prompts)) + self.cfg.eval_new_tokens + self.cfg.block_size + 1
        engine = LLMEngine(self.target, self.tokenizer, draft,
                           EngineConfig(max_batch_size=1, max_model_len=max(room, self.cfg.max_seq_len + 256),
                                        dtype=_name_of(DTYPES, self.target.embed_tokens.weight.dtype),
                                        device=str(self.device)))
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=self.cfg.eval_new_tokens))
        decode_s = time.perf_counter() - t0
        steps = sum(len(o.acceptance_lengths) for o in outs)
        committed = sum(sum(o.acceptance_lengths) for o in outs)
        return {"val_loss": val_loss, **({"val_tau": committed / steps} if steps else {})}, decode_s

    # -- persistence ----------------------------------------------------------------------------------
    def export(self, path: Path, metrics: dict) -> None:
        """Write the drafter to path whole or not at all: built beside it, then swapped in by renames. Ctrl-C,
        SIGTERM and SIGHUP wait for it (a second Ctrl-C inside torch.save or safetensors came out as a failed write)."""
        tmp, old = _settle_export(path)
        with signals_held():
            with _written(tmp):
                save_drafter(copy.deepcopy(self.drafter).to(torch.bfloat16), tmp, dtype=torch.bfloat16)
                if self.vocab_ids.numel():
                    save_draft_vocab(tmp, self.vocab_ids, self.vocab_counts)
                (tmp / "training.json").write_text(json.dumps({"step": self.step, "metrics": metrics,
                                                               "config": asdict(self.cfg)}, indent=2) + "\n")
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)

    def _save_checkpoint(self) -> None:
        trained_s = self._trained_s + (time.perf_counter() - self._started if self._started is not None else 0.0)
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                 "rng": self.gen.get_state(), "best_score": self.best_score, "best_loss": self.best_loss,
                 "scored_on": self._scored_on(), "config": asdict(self.cfg),
                 "progress": self._progress, "trained_s": trained_s}
        tmp = self.out_dir / "checkpoint.pt.tmp"
        with signals_held():  # as in export: a signal inside torch.save reads as a failed write
            with _written(tmp), tmp.open("wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())  # else a power cut after the rename can leave checkpoint.pt empty
            os.replace(tmp, self.out_dir / "checkpoint.pt")
            self._saved_step = self.step

    def _load_checkpoint(self) -> None:
        state = torch.load(self.out_dir / "checkpoint.pt", weights_only=False, map_location="cpu")
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["optimizer"])  # moves its state to the parameters' device
        self.step = state["step"]
        if self.cfg.time_budget_s is not None:
            # The same run goes on: its schedule's length as last fitted (not --steps' again, which would jump the
            # learning rate) until the pace is measured anew, and the budget less the time it already trained.
            self._trained_s = state.get("trained_s", 0.0)
            self.cfg.steps = min(self.max_steps, max(self.step, state["config"].get("steps", self.max_steps)))
            self._progress = state.get("progress", self.step / self.cfg.steps)
        else:  # the schedule of --steps, which may have changed since
            self._progress = min(1.0, self.step / self.cfg.steps)
        self.gen.set_state(state["rng"])
        self.best_score = state.get("best_score", state.get("best_tau", -math.inf))  # best_tau: older checkpoints
        self.best_loss = state.get("best_loss", math.inf)
        if state.get("scored_on") != self._scored_on() and self.best_score > -math.inf:
            # other held-out records (other data, --eval-prompts, or a checkpoint of before they were taken from each
            # source in turn): its best is no bar for this run's scores
            logger.warning("the checkpoint's best held-out score (%.3f) was measured on other held-out records than "
                           "this run's: the next evaluation's drafter replaces %s", self.best_score,
                           self.out_dir / "drafter")
            self.best_score, self.best_loss = -math.inf, math.inf
        logger.info("resumed from step %d (best held-out score %.3f)", self.step, self.best_score)


@contextlib.contextmanager
def _describing(bar: tqdm, desc: str):
    """The bar names the work between its steps while it lasts (else it looks stalled)."""
    if bar.disable:  # TQDM_DISABLE=1, or no terminal to draw on: such a bar has no description to set
        yield
        return
    before = bar.desc
    bar.set_description_str(desc)
    try:
        yield
    finally:
        bar.set_description_str(before, refresh=False)


def by_source_in_turn(records: list[dict]) -> list[dict]:
    """The records one source family at a time in turn (a family: `source` up to its first '/'), each family's in
    their own order. Data is stored source by source: SmolLM2's first 98 held-out records are all chatterbot's trivia,
    so its first 16 greedy prompts, and the 32 records of the held-out loss, chose a drafter on trivia alone."""
    families: dict[str, list[dict]] = {}
    for r in records:
        families.setdefault(str(r.get("source", "")).split("/")[0], []).append(r)
    return [r for turn in zip_longest(*families.values()) for r in turn if r is not None]


def held_out_score(metrics: dict) -> float:
    """An evaluation's held-out score: its tau, or minus its loss without evaluation prompts."""
    return metrics["val_tau"] if "val_tau" in metrics else -metrics["val_loss"]


def _labelled(record: dict, max_seq_len: int) -> bool:
    """Whether a record has a response token to learn within its first max_seq_len tokens."""
    kept = min(len(record["prompt_ids"]) + len(record["response_ids"]), max_seq_len)
    return kept - 2 >= len(record["prompt_ids"])


def _logged_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _settle_export(path: Path) -> tuple[Path, Path]:
    """Clear what an export killed midway left beside path -> (its build directory, its swap-out name).

    Killed between its two renames, an export leaves path missing and its former version at the swap-out name:
    that version is put back."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if old.exists():
        if path.exists():
            shutil.rmtree(old)
        else:
            os.replace(old, path)
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp, old


class _FinishStepOnInterrupt:
    """While training: a first SIGINT (Ctrl-C), SIGTERM (`timeout`, `docker stop`, a scheduler's preemption) or SIGHUP
    (the terminal closed; not under nohup, which ignores it) asks the loop to stop after the step in flight
    (interrupted midway, the drafter and optimizer would be half updated, so not worth saving); a second raises
    KeyboardInterrupt at once."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint, self.requested = checkpoint, False
        self._installed = signal_handlers(self._handle, *self.SIGNALS)

    def __enter__(self) -> "_FinishStepOnInterrupt":
        self._installed.__enter__()
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        name = self.SIGNALS.get(signum, "a signal")
        logger.warning("%s: stopping after this step, to save it in %s (Ctrl-C or SIGTERM again stops at once, losing "
                       "the steps since the last checkpoint)", name, self.checkpoint)

    def __exit__(self, *exc) -> None:
        self._installed.__exit__(*exc)


def _name_of(names: dict[str, torch.dtype], dtype: torch.dtype) -> str:
    """The EngineConfig name of a torch dtype (the first of its aliases in llm_engine.DTYPES)."""
    return next(name for name, d in names.items() if d == dtype)
