"""Where a drafter's acceptance goes (issue 3): teacher-forced top-1 accuracy per block slot against real
acceptance in speculative decoding, on training and held-out records of the drafter's own data.

For each split, the first N greedy records: (1) teacher-forced: random anchors in the response, every block
slot's top-1 prediction against the recorded token (the training objective's view); (2) real: the prompts
decoded speculatively at K (fp32, greedy), P(at least k drafts accepted) per step and tau. A drafter that
learned slot 1 but not the later slots, or that does much better on training records than held-out ones,
shows here. fp32 throughout (bf16 near-ties would blur the comparison).

    .venv/bin/python benchmarks/diagnose_acceptance.py [--drafter drafters/smollm2-135m-dflash] [--records N] [-k 7]
        [--draft-vocab-size N] [--data RESPONSES.jsonl.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.train.blocks import IGNORE, sample_blocks, training_mask  # noqa: E402
from dflash_trt.train.feature_cache import TargetFeatures  # noqa: E402


@torch.no_grad()
def slot_accuracy(engine: LLMEngine, records: list[dict], anchors: int, seed: int = 0) -> list[float]:
    drafter, target = engine.drafter, engine.target
    block = drafter.config.block_size
    feats = TargetFeatures(target, drafter.config.target_layer_ids)
    gen = torch.Generator().manual_seed(seed)
    hits, total = torch.zeros(block), torch.zeros(block)
    for r in records:
        ids = torch.tensor(r["prompt_ids"] + r["response_ids"])
        b = sample_blocks(ids, len(r["prompt_ids"]), anchors, block, drafter.config.mask_token_id, gen)
        if b is None:
            continue
        c = int(b.anchors.max())
        h = drafter.forward_train(feats.batch([r], [c]), torch.arange(c)[None],
                                  F.embedding(b.block_ids, target.embed_tokens.weight)[None], b.block_positions[None],
                                  training_mask(c, b.anchors, block)[None, None])[0]
        pred = drafter.compute_logits(h, target.lm_head_forward).argmax(-1)
        slot = torch.arange(b.block_ids.numel()) % block
        labelled = b.labels != IGNORE
        hits.index_add_(0, slot[labelled], (pred == b.labels)[labelled].float())
        total.index_add_(0, slot[labelled], torch.ones(int(labelled.sum())))
    return [round(float(x), 3) for x in (hits / total.clamp_min(1))[1:]]


def real_acceptance(engine: LLMEngine, records: list[dict], new_tokens: int) -> dict:
    outs = engine.generate([r["prompt_ids"] for r in records], SamplingParams(max_new_tokens=new_tokens))
    steps = [a for o in outs for a in o.acceptance_lengths]
    k = engine.max_draft_len
    return {"tau": round(sum(steps) / len(steps), 3),
            "p_at_least_k_accepted": [round(sum(a > j for a in steps) / len(steps), 3) for j in range(1, k + 1)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default=str(SMOLLM2_DRAFTER))
    ap.add_argument("--data", default=str(SMOLLM2_DRAFTER / "training-data" / "responses.jsonl.gz"))
    ap.add_argument("--records", type=int, default=24)
    ap.add_argument("-k", type=int, default=7)
    ap.add_argument("--anchors", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="draft among the drafter's N most frequent tokens, 0: the whole vocabulary (default: all its "
                         "draft_vocab.json lists; real acceptance only, slot accuracy uses the whole head)")
    ap.add_argument("--name", default="acceptance_diagnosis_cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = LLMEngine.from_dirs(smollm2_dir(), args.drafter, EngineConfig(max_batch_size=1, max_draft_len=args.k,
                                                                           pack_weights=False,
                                                                           draft_vocab_size=args.draft_vocab_size))
    with gzip.open(args.data, "rt") as f:
        data = [json.loads(line) for line in f]
    result = {}
    for split in ("train", "heldout"):
        recs = [r for r in data if r["split"] == split and r["mode"] == "greedy"][: args.records]
        if not recs:  # e.g. a file of held-out records only
            print(f"{split}: no greedy records in {args.data}")
            continue
        result[split] = {"records": len(recs), "teacher_forced_slot_accuracy": slot_accuracy(engine, recs, args.anchors),
                         **real_acceptance(engine, recs, args.new_tokens)}
        print(split, json.dumps(result[split]))
    path = record(args.name, {"command": " ".join(sys.argv), "drafter": args.drafter, "dtype": "float32", "k": args.k,
                              "draft_vocab_size": "all" if args.draft_vocab_size is None else args.draft_vocab_size,
                              **result})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
