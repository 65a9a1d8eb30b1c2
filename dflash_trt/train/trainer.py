"""The DFlash drafter trainer (arXiv 2602.06036 §4.2, §A.1).

Only the drafter's layers, fc and norms train; the target's embedding and lm_head are shared and
frozen. Each step draws sequences, samples random anchors inside their responses (train/blocks.py),
runs every block of a sequence in one drafter forward under the block-sparse mask, and minimises the
position-decayed cross-entropy. AdamW, linear warmup then cosine decay, gradient clipping.
checkpoint.pt (drafter, optimizer, step, RNG) makes a run resumable; drafter/ holds the best
checkpoint so far in z-lab's format, judged by the held-out acceptance length tau.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

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
from dflash_trt.train.blocks import sample_blocks, training_mask, weighted_cross_entropy
from dflash_trt.train.feature_cache import FeatureCache

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    num_layers: int = 2
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # None: z-lab's spacing for num_features layers
    num_features: int = 5
    mask_token_id: int | None = None  # None: must be given by the caller (a token the target never emits)
    steps: int = 2000
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    anchors_per_seq: int = 32
    seqs_per_step: int = 4
    gamma: float | None = None  # None: by block size (7 for 16, 5 for 10, 4 for 8)
    max_seq_len: int = 1024
    init_from_target: bool = False  # start drafter layers from the target's last layers (EAGLE-style)
    init_drafter: str | None = None  # warm start from a z-lab-format drafter (e.g. a shipped one), same shape
    eval_every: int = 250
    eval_prompts: int = 8
    eval_new_tokens: int = 96
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_layers < 1 or self.steps < 1:
            raise ValueError("num_layers and steps must be >= 1")


def drafter_config_for(target_cfg, cfg: TrainConfig) -> DFlashConfig:
    """A drafter shaped like the target's layers (same hidden size, heads and MLP width)."""
    ids = cfg.target_layer_ids or build_target_layer_ids(target_cfg.num_hidden_layers, cfg.num_features)
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


def lr_at(step: int, cfg: TrainConfig) -> float:
    warmup = max(1, int(cfg.warmup_ratio * cfg.steps))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    def __init__(self, target, target_dir: Path, tokenizer, records: list[dict], features: FeatureCache,
                 out_dir: Path, cfg: TrainConfig, resume: bool = False) -> None:
        self.target, self.tokenizer, self.features, self.cfg = target, tokenizer, features, cfg
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.train_records = [r for r in records if r["split"] == "train" and r["id"] in features]
        self.heldout = [r for r in records if r["split"] == "heldout" and r["id"] in features]
        if not self.train_records:
            raise ValueError("no training sequences with cached features")
        dcfg = drafter_config_for(target.config, cfg)
        if dcfg.target_layer_ids != features.target_layer_ids:
            raise ValueError(f"feature cache holds target_layer_ids={features.target_layer_ids}, "
                             f"the drafter wants {dcfg.target_layer_ids}")
        self.drafter = new_drafter(dcfg, seed=cfg.seed)
        if cfg.init_from_target:
            init_from_target_layers(self.drafter, target_dir)
        if cfg.init_drafter:
            warm = load_drafter(cfg.init_drafter, target.config)
            if warm.config.target_layer_ids != dcfg.target_layer_ids or warm.config.num_hidden_layers != cfg.num_layers:
                raise ValueError(f"{cfg.init_drafter}: target_layer_ids/layers {warm.config.target_layer_ids}/"
                                 f"{warm.config.num_hidden_layers} differ from the run's {dcfg.target_layer_ids}/{cfg.num_layers}")
            self.drafter.load_state_dict(warm.float().state_dict())
        self.embed = target.embed_tokens.weight.detach()  # frozen, shared
        self.head = target.lm_head_weight.detach()
        params = [p for p in self.drafter.parameters()]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.best_tau = -1.0
        self.log_path = self.out_dir / "train_log.jsonl"
        if resume and (self.out_dir / "checkpoint.pt").is_file():
            self._load_checkpoint()

    # -- one sequence -------------------------------------------------------------------------------
    def _sequence_loss(self, rec: dict, gen: torch.Generator) -> torch.Tensor | None:
        cfg = self.cfg
        ids = torch.tensor((rec["prompt_ids"] + rec["response_ids"])[: cfg.max_seq_len])
        blocks = sample_blocks(ids, len(rec["prompt_ids"]), cfg.anchors_per_seq, cfg.block_size,
                               self.drafter.config.mask_token_id, gen, cfg.gamma)
        if blocks is None:
            return None
        ctx_len = int(blocks.anchors.max())  # the last block sees context [0, its anchor)
        feats = torch.from_numpy(np.asarray(self.features.get(rec["id"])[:ctx_len], dtype=np.float32))[None]
        mask = training_mask(ctx_len, blocks.anchors, cfg.block_size)[None, None]
        embeds = F.embedding(blocks.block_ids, self.embed).float()[None]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = self.drafter.forward_train(feats, torch.arange(ctx_len)[None], embeds,
                                                blocks.block_positions[None], mask)[0]
            keep = blocks.labels != -100
            logits = F.linear(hidden[keep], self.head).float()
        return weighted_cross_entropy(logits, blocks.labels[keep], blocks.weights[keep])

    # -- loop ---------------------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        self.drafter.train()
        while self.step < cfg.steps:
            lr = lr_at(self.step, cfg)
            for g in self.opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            total, n = 0.0, 0
            for _ in range(cfg.seqs_per_step):
                rec = self.train_records[int(torch.randint(len(self.train_records), (1,), generator=self.gen))]
                loss = self._sequence_loss(rec, self.gen)
                if loss is None:
                    continue
                (loss / cfg.seqs_per_step).backward()
                total += loss.item()
                n += 1
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip))
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
            entry = {"step": self.step, "loss": total / max(n, 1), "lr": lr, "grad_norm": grad_norm,
                     "step_s": time.perf_counter() - t0}
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                entry.update(self.evaluate())
                self._save_checkpoint()
                if entry["val_tau"] > self.best_tau:
                    self.best_tau = entry["val_tau"]
                    self.export(self.out_dir / "drafter", entry)
                self.drafter.train()
            with self.log_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            bar.set_postfix(loss=f"{entry['loss']:.3f}", **({"tau": f"{entry['val_tau']:.2f}"} if "val_tau" in entry else {}))
            bar.update(1)
        bar.close()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss (fixed anchors) and held-out tau from real speculative greedy decoding."""
        from dflash_trt.engine.llm_engine import DTYPES, EngineConfig, LLMEngine
        from dflash_trt.sampling_params import SamplingParams

        self.drafter.eval()
        gen = torch.Generator().manual_seed(1234)
        losses = [self._sequence_loss(r, gen) for r in self.heldout[:32]]
        losses = [float(x) for x in losses if x is not None]
        draft = copy.deepcopy(self.drafter).to(self.target.embed_tokens.weight.dtype)
        pack_linears(draft)
        engine = LLMEngine(self.target, self.tokenizer, draft,
                           EngineConfig(max_batch_size=1, max_model_len=self.cfg.max_seq_len + 256,
                                        dtype=_name_of(DTYPES, self.target.embed_tokens.weight.dtype)))
        prompts = [r["prompt_ids"] for r in self.heldout if r.get("mode") == "greedy"][: self.cfg.eval_prompts]
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=self.cfg.eval_new_tokens)) if prompts else []
        steps = sum(len(o.acceptance_lengths) for o in outs)
        committed = sum(sum(o.acceptance_lengths) for o in outs)
        return {"val_loss": sum(losses) / max(len(losses), 1), "val_tau": committed / steps if steps else 0.0}

    # -- persistence ----------------------------------------------------------------------------------
    def export(self, path: Path, metrics: dict) -> None:
        tmp = path.with_name(path.name + ".tmp")
        save_drafter(copy.deepcopy(self.drafter).to(torch.bfloat16), tmp, dtype=torch.bfloat16)
        (tmp / "training.json").write_text(json.dumps({"step": self.step, "metrics": metrics,
                                                       "config": asdict(self.cfg)}, indent=2) + "\n")
        if path.exists():
            import shutil

            shutil.rmtree(path)
        os.replace(tmp, path)

    def _save_checkpoint(self) -> None:
        state = {"drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(), "step": self.step,
                 "rng": self.gen.get_state(), "best_tau": self.best_tau, "config": asdict(self.cfg)}
        tmp = self.out_dir / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out_dir / "checkpoint.pt")

    def _load_checkpoint(self) -> None:
        state = torch.load(self.out_dir / "checkpoint.pt", weights_only=False)
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.gen.set_state(state["rng"])
        self.best_tau = state["best_tau"]
        logger.info("resumed from step %d (best held-out tau %.3f)", self.step, self.best_tau)


def _name_of(names: dict[str, torch.dtype], dtype: torch.dtype) -> str:
    """The EngineConfig name of a torch dtype (the first of its aliases in llm_engine.DTYPES)."""
    return next(name for name, d in names.items() if d == dtype)
