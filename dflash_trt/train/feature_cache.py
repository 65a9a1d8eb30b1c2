"""Captured target features: computed once and stored as fp16 memory-mapped shards (FeatureCache), or
computed on the fly by the target on its own device (TargetFeatures: on a GPU the forward costs less than
reading the cache back). The trainer reads either through `batch`.

Layout of a cache directory:
  index.json                index of the shards: feature_dim, target_layer_ids,
                            shards [{file, tokens, sequences: {id: [offset, length]}}]
  shard_00000.npy ...       float16 [tokens, len(target_layer_ids) * hidden]
  shard_00000.tokens.npy    int32 [tokens]: the token ids the features were computed from
A shard is written to temporary names and renamed, then recorded in index.json. A later call caches only
the sequences the index lacks, in new shards: an interrupted run resumes, and appended records are added.
A sequence is reused only where its cached token ids begin with the ones asked for: a record id that now names
other tokens (responses generated again into the same --data) is cached again, never trained on stale features.
A shard that cannot be read back (missing, cut short, without its token ids) is dropped from the index and its
sequences cached again.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from dflash_trt.dir_swap import replace_file
from dflash_trt.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


class FeatureSource(Protocol):
    target_layer_ids: list[int]

    def __contains__(self, sid: str) -> bool: ...

    def batch(self, records: list[dict], lengths: list[int]) -> torch.Tensor:
        """Features of each record's first lengths[i] tokens, zero-padded: [n, max(lengths), feature_dim]."""
        ...


class FeatureCache:
    def __init__(self, root: str | Path, index: dict | None = None) -> None:
        """index: the index as read and checked already (build_feature_cache's), else root's index.json."""
        self.root = Path(root)
        index = read_index(self.root / "index.json") if index is None else index
        self.feature_dim = index["feature_dim"]
        self.target_layer_ids = index["target_layer_ids"]
        self._where: dict[str, tuple[int, int, int]] = {}
        self._maps: dict[int, np.ndarray] = {}
        self._tokens: dict[int, np.ndarray] = {}
        # Every shard is opened now, not when a training step first reads it (hours in).
        for i, shard in enumerate(index["shards"]):
            arrays, problem = open_shard(self.root, shard, self.feature_dim)
            if problem:
                raise ValueError(f"{self.root / shard['file']}: {problem}; build_feature_cache caches its sequences "
                                 "again (`dflash-trt train` does), or delete the directory")
            self._maps[i], self._tokens[i] = arrays
            for sid, (offset, length) in shard["sequences"].items():
                self._where[sid] = (i, offset, length)

    def __contains__(self, sid: str) -> bool:
        return sid in self._where

    def ids(self) -> list[str]:
        return list(self._where)

    def get(self, sid: str) -> np.ndarray:
        """[length, feature_dim] float16, memory-mapped."""
        shard, offset, length = self._where[sid]
        return self._maps[shard][offset : offset + length]

    def tokens(self, sid: str) -> np.ndarray:
        """[length] int32: the token ids get(sid) was computed from, memory-mapped."""
        shard, offset, length = self._where[sid]
        return self._tokens[shard][offset : offset + length]

    def holds(self, sid: str, ids: list[int]) -> bool:
        """Whether the features of exactly these tokens (as a prefix of what is cached under sid) are cached."""
        if sid not in self._where or self._where[sid][2] < len(ids):
            return False
        return bool(np.array_equal(self.tokens(sid)[: len(ids)], np.asarray(ids, dtype=np.int32)))

    def batch(self, records: list[dict], lengths: list[int]) -> torch.Tensor:
        out = torch.zeros(len(records), max(lengths), self.feature_dim)
        for i, (r, n) in enumerate(zip(records, lengths)):
            out[i, :n] = torch.from_numpy(np.asarray(self.get(r["id"])[:n], dtype=np.float32))
        return out


class TargetFeatures:
    """The target's hidden states at layer_ids, computed per batch (prompt + response of each record)."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int]) -> None:
        self.target, self.target_layer_ids = target, list(layer_ids)

    def __contains__(self, sid: str) -> bool:
        return True

    @torch.no_grad()  # not inference_mode: the trainer's autograd graph reads these tensors
    def batch(self, records: list[dict], lengths: list[int]) -> torch.Tensor:
        ids = [(r["prompt_ids"] + r["response_ids"])[:n] for r, n in zip(records, lengths)]
        cache = self.target.make_cache(len(ids), max(lengths))
        feats = _features(self.target, ids, cache, self.target_layer_ids)
        for i, n in enumerate(lengths):
            feats[i, n:] = 0
        return feats


def read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
        if not isinstance(index, dict) or not {"feature_dim", "target_layer_ids", "shards"} <= set(index):
            raise ValueError("keys missing")
        shards = index["shards"]
        if not isinstance(shards, list) or not all(
                isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("sequences"), dict)
                for s in shards):
            raise ValueError("its shards are not a list of {file, sequences, ...}")
    except (ValueError, TypeError) as e:  # not JSON, or not an index
        raise ValueError(f"{path} is damaged ({e}): delete {path.parent} (the features are computed again from the "
                         "responses), or pass another --data") from None
    return index


def open_shard(root: Path, shard: dict, feature_dim: int) -> tuple[tuple[np.ndarray, np.ndarray] | None, str | None]:
    """((the shard's features, its token ids), memory-mapped, None), or (None, what is wrong with it): missing,
    truncated or of another shape (a copy cut short, a disk that lost it), or without token ids (a cache written
    before they were stored)."""
    if "tokens" not in shard:
        return None, "has no token ids to check its sequences against"
    need = max((offset + length for offset, length in shard["sequences"].values()), default=0)
    arrays = []
    for name, dtype, shape in ((shard["file"], np.float16, [need, feature_dim]), (shard["tokens"], np.int32, [need])):
        path = root / name
        if not path.is_file():
            return None, "missing" if name == shard["file"] else f"its token ids {name} are missing"
        try:
            data = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            return None, f"{name} unreadable ({e})"
        if data.dtype != dtype or data.ndim != len(shape) or list(data.shape[1:]) != shape[1:] or data.shape[0] < need:
            return None, f"{name} holds {data.dtype} {list(data.shape)}, the index needs {np.dtype(dtype)} {shape}"
        arrays.append(data)
    return (arrays[0], arrays[1]), None


def check_index(root: Path, feature_dim: int, layer_ids: list[int]) -> dict | None:
    """The cache index at root (None if none), refused if made for other target layers or another width."""
    path = root / "index.json"
    if not path.is_file():
        return None
    index = read_index(path)
    if index["target_layer_ids"] != list(layer_ids):
        raise ValueError(f"{path}: cached target_layer_ids={index['target_layer_ids']} differ from {list(layer_ids)}; "
                         "use another --data directory")
    if index["feature_dim"] != feature_dim:
        raise ValueError(f"{path}: cached features are {index['feature_dim']} wide, this target's layers give "
                         f"{feature_dim} (data of another target?); use another --data directory")
    return index


def _read_index(root: Path, feature_dim: int, layer_ids: list[int]) -> dict:
    """The index, less the shards that cannot be read: their sequences are cached again (they are the target's
    features of the stored responses, so nothing is lost)."""
    index = check_index(root, feature_dim, layer_ids)
    if index is None:
        return {"feature_dim": feature_dim, "target_layer_ids": list(layer_ids), "shards": []}
    kept = []
    for shard in index["shards"]:
        _, problem = open_shard(root, shard, feature_dim)
        if problem:
            logger.warning("%s: %s; its %d sequences are cached again", root / shard["file"], problem,
                           len(shard["sequences"]))
        else:
            kept.append(shard)
    index["shards"] = kept
    return index


def _size(n: int) -> str:
    """Bytes in the largest unit a tenth of which they reach (a small disk read "0.0 GB needed, 0.0 GB free")."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale / 10:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def space_shortfall(root: Path, token_bound: int, feature_dim: int) -> str | None:
    """Before the responses are generated (hours on the CPU): why caching the features of up to token_bound tokens
    may not fit root's disk (counting what root's shards hold already), or None where it fits."""
    held = sum(f.stat().st_size for f in root.glob("shard_*.npy")) if root.is_dir() else 0
    need = max(token_bound * feature_dim * 2 - held, 0)  # float16
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if need <= free:
        return None
    return (f"{root}: caching the features may need up to {_size(need)} (every response at its longest), and "
            f"{_size(free)} is free: the run would stop there after generating the responses; pass "
            "--features live (computed per step), fewer --max-prompts, or a --data directory on a larger disk")


@torch.inference_mode()
def build_feature_cache(
    target: torch.nn.Module,
    sequences: list[tuple[str, list[int]]],  # (id, token ids) in a fixed order
    root: str | Path,
    layer_ids: list[int],
    shard_tokens: int = 262_144,
    batch_rows: int = 8,
    compute_with: Callable[[], torch.nn.Module] | None = None,
) -> FeatureCache:
    """Cache the features of every sequence not cached yet; -> the whole cache. compute_with loads the model that
    computes them (cli.feature_target: a bf16 target's fp32 twin) and is called only when something is missing, so
    a resume over a complete cache loads nothing; by default target computes them."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    feature_dim = target.config.hidden_size * len(layer_ids)
    index = _read_index(root, feature_dim, layer_ids)
    cached = FeatureCache(root, index)
    # Only what is not cached yet (or cached shorter, after max_seq_len grew, or from other tokens) goes into new
    # shards: a resume, or a run with more records appended, never rewrites (or silently skips sequences of) a
    # shard on disk. A sequence cached again lives in a later shard, which FeatureCache reads last.
    missing = [(sid, ids) for sid, ids in sequences if not cached.holds(sid, ids)]
    changed = sum(1 for sid, ids in missing if sid in cached and len(cached.tokens(sid)) >= len(ids))
    if changed:
        logger.warning("%s: %d cached sequences were computed from other tokens than their records now hold "
                       "(responses generated again?); they are cached again", root, changed)
    shards, current, size = [], [], 0
    for sid, ids in missing:
        current.append((sid, ids))
        size += len(ids)
        if size >= shard_tokens:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    total = sum(len(ids) for _, ids in sequences)
    bar = tqdm(total=total, initial=total - sum(len(ids) for _, ids in missing), desc="features", unit="tok",
               unit_scale=True, dynamic_ncols=True)
    if not missing:  # the index as read is whole (a shard dropped from it leaves sequences missing)
        bar.close()
        return cached
    need = sum(len(ids) for _, ids in missing) * feature_dim * 2  # float16
    free = shutil.disk_usage(root).free
    if need > free:
        bar.close()
        raise OSError(f"{root}: caching the features of {len(missing):,} sequences needs {_size(need)}, "
                      f"{_size(free)} is free; compute them per step instead (dflash-trt train --features live), "
                      "or free the space")
    model = target if compute_with is None else compute_with()
    cache = model.make_cache(batch_rows, max(len(ids) for _, ids in missing))
    taken = {s["file"] for s in index["shards"]}
    names = (n for n in (f"shard_{i:05d}.npy" for i in range(len(taken), 10**6)) if n not in taken)
    for shard, name in zip(shards, names):
        n_tok = sum(len(ids) for _, ids in shard)
        data = np.empty((n_tok, feature_dim), dtype=np.float16)
        tokens = np.empty(n_tok, dtype=np.int32)
        where, offset = {}, 0
        order = sorted(range(len(shard)), key=lambda j: len(shard[j][1]))
        try:
            for start in range(0, len(order), batch_rows):
                rows = [shard[j] for j in order[start : start + batch_rows]]
                feats = _features(model, [ids for _, ids in rows], cache, layer_ids).to(torch.float16).cpu().numpy()
                for (sid, ids), f in zip(rows, feats):
                    data[offset : offset + len(ids)] = f[: len(ids)]
                    tokens[offset : offset + len(ids)] = ids
                    where[sid] = [offset, len(ids)]
                    offset += len(ids)
                    bar.update(len(ids))
        except KeyboardInterrupt:  # minutes of prefill on a CPU (a big target's shard: hours): kept, as responses are
            if where:
                _write_shard(root, index, name, tokens[:offset], data[:offset], where)
            bar.close()
            raise
        _write_shard(root, index, name, tokens, data, where)
    bar.close()
    return FeatureCache(root)


def _write_shard(root: Path, index: dict, name: str, tokens: np.ndarray, data: np.ndarray,
                 where: dict[str, list[int]]) -> None:
    """Write a shard's arrays, then the index naming it (each replaced whole: a kill leaves the previous index)."""
    tokens_name = name.replace(".npy", ".tokens.npy")
    for file, array in ((tokens_name, tokens), (name, data)):
        replace_file(root / file, lambda tmp, array=array: _save_array(tmp, array))
    index["shards"].append({"file": name, "tokens": tokens_name, "sequences": where})
    replace_file(root / "index.json", lambda tmp: tmp.write_text(json.dumps(index)))


def _save_array(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as fh:  # a file object: np.save would append .npy to a path's name
        np.save(fh, array)


def _features(target, id_lists: list[list[int]], cache, layer_ids) -> torch.Tensor:
    """[rows, longest, feature_dim] in the target's dtype; rows are right-padded (causal: padding is unseen)."""
    dev = target.embed_tokens.weight.device
    n = max(len(x) for x in id_lists)
    ids = torch.zeros(len(id_lists), n, dtype=torch.long)
    for i, x in enumerate(id_lists):
        ids[i, : len(x)] = torch.tensor(x)
    rows = torch.arange(len(id_lists), device=dev)
    meta = AttentionMetadata.causal_step(rows, torch.arange(n, device=dev).expand(len(id_lists), n))
    return target.capture(ids.to(dev), meta, cache, tuple(layer_ids))
