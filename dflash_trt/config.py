"""Build configs: the YAML schema for one deployment (build_configs/*.yaml), validated with pydantic.

YAML keys are the field names, and those are TensorRT-LLM LLM-API keys wherever the concept exists
there (max_batch_size, max_seq_len, tensor_parallel_size, kv_cache_config.dtype,
speculative_config.max_draft_len ...), so one file drives both backends. Errors name the key.

Environment knobs: DFLASH_TRT_CACHE (embedded.py: where the converted default model and the compiled CPU kernels
live), DFLASH_TRT_CPU_KERNELS=0 (kernels/cpu_ops.py: torch's ops instead of the CPU kernels), DFLASH_TRT_AMX=0
(kernels/cpu_ops.c: the AVX-512 linear kernel on CPUs with AMX too), DFLASH_TRT_PANELS=0 (kernels/cpu_ops.c; each =0
switch takes 0, false, no or off), DFLASH_TRT_MARCH and CC (kernels/cpu_ops.py: how the CPU kernels are compiled),
DFLASH_TRT_API_KEY (serve's --api-key), and for debugging/testing DFLASH_TRT_BUILD_STALL_AFTER (build.py: stall a
build after a step, to test killed builds). The README says what each does.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from dflash_trt.draft_schedule import check_drafting_continues, check_table, with_k
from dflash_trt.hardware import PROFILE_NAMES, profile
from dflash_trt.sampling_params import is_int

EMBEDDED_PREFIX = "embedded:"


def _scalar_kind(annotation: Any) -> type | None:
    """int or bool for a field typed so (or Optional so), else None."""
    kinds = {a for a in (get_args(annotation) or (annotation,)) if a is not type(None)}
    return next(iter(kinds)) if len(kinds) == 1 and kinds <= {int, bool} else None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _exact_scalars(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `true` as 1 and "4" as 4: in a hand-written YAML file those are mistakes
        kind = _scalar_kind(cls.model_fields[info.field_name].annotation)
        if kind is int and isinstance(v, (bool, str, float)):
            raise ValueError(f"expected an integer, got {v!r}")
        if kind is bool and not isinstance(v, bool) and v is not None:
            raise ValueError(f"expected true or false, got {v!r}")
        return v


class SpeculativeConfig(_Strict):
    decoding_type: Literal["DFlash"] = "DFlash"
    # The drafter: an HF id, or a local path (starting with ./ ../ / or ~, relative to the YAML file).
    speculative_model: str
    max_draft_len: int | None = Field(default=None, ge=1)  # K; None: the checkpoint's block_size - 1
    # Batch-size threshold -> K, TensorRT-LLM's semantics (dflash_trt/draft_schedule.py): a batch of b rows
    # runs the K of the smallest key >= b, batches above the largest key run without drafts; key 1 is
    # required and equals max_draft_len. `auto`: the build chooses it from the performance model of the
    # hardware profile and acceptance_by_draft_len (plan.json records the prediction).
    draft_len_schedule: dict[int, int] | Literal["auto"] | None = None
    # This project's torch runtime only: the draft_len_schedule on a CPU whose linears have no AMX tiles (None:
    # draft_len_schedule), the same rules. There a verify step's rows cost their dot products, so drafting stops
    # paying at fewer rows.
    draft_len_schedule_without_amx: dict[int, int] | None = None
    # Measured (or published, with the source in a YAML comment) tau, tokens per step, by K: {K: tau}.
    # K values in 1..max_draft_len without an entry are extrapolated (geometric acceptance, perf_model.py).
    acceptance_by_draft_len: dict[int, float] | None = None
    # This project's torch runtime only: measure plain and speculative steps while serving and run K=0 where
    # plain decoding is faster (engine/adaptive_draft.py). TensorRT-LLM keeps the static schedule.
    adaptive_draft_len: bool = False
    # This project's torch runtime only: draft among the drafter's N most frequent tokens (its draft_vocab.json,
    # spec/draft_vocab.py); 0: the whole vocabulary; None: every token the file lists. TensorRT-LLM scores the
    # whole head.
    draft_vocab_size: int | None = Field(default=None, ge=0)
    # This project's torch runtime only: batch-size threshold -> draft tree nodes, the draft_len_schedule's rule
    # (spec/draft_tree.py): steps verify that many drafts, the best paths through each slot's top tokens,
    # up to K slots deep, instead of a chain of K (greedy and "match"-sampled requests; a batch with a "rejection"
    # row drafts a chain); 0 or past the largest key: a chain. TensorRT-LLM drafts a chain.
    draft_tree: dict[int, int] | None = None
    # This project's torch runtime only: the draft_tree table on a CPU whose linears have no AMX tiles (None:
    # draft_tree). There every extra row of a verify step costs its dot products, and large trees lose.
    draft_tree_without_amx: dict[int, int] | None = None
    # This project's torch runtime only: speculative steps also weigh up to this many tokens copied from the
    # request's own context where its last tokens occurred before (prompt lookup; spec/context_lookup.py): a tree's
    # nodes go to its prefixes where likelier than the drafter's paths, a chain drafts it instead of the drafter's
    # where it expects more accepted tokens; at most the drafter's block_size - 1 (deeper than a step's K it is cut
    # to K). 0: none.
    lookup_nodes: int = Field(default=0, ge=0)
    max_concurrency: int | None = Field(default=None, ge=1)
    attention_backend: Literal["VANILLA", "TRTLLM"] = "VANILLA"
    use_rejection_sampling: bool = False

    @model_validator(mode="after")
    def _schedule(self) -> "SpeculativeConfig":
        for k, tau in (self.acceptance_by_draft_len or {}).items():
            if k < 1 or not 1.0 <= tau <= k + 1:
                raise ValueError(
                    f"acceptance_by_draft_len entry {k}: {tau} needs K >= 1 and 1 <= tau <= K + 1 "
                    "(tau counts the bonus token)"
                )
        check_table(self.draft_tree or {}, "draft_tree", "nodes")
        check_table(self.draft_tree_without_amx or {}, "draft_tree_without_amx", "nodes")
        if self.draft_len_schedule is not None and self.max_concurrency is not None:
            raise ValueError("draft_len_schedule and max_concurrency are mutually exclusive; set one")
        if self.draft_len_schedule_without_amx is not None:
            if self.draft_len_schedule == "auto":
                raise ValueError(
                    "draft_len_schedule: auto chooses K for the CPU the build runs on, which "
                    "draft_len_schedule_without_amx would override there: give explicit tables, or auto alone"
                )
            # this runtime's alone: one row may draft less than K where a verify row costs its dot products
            self._check_schedule(self.draft_len_schedule_without_amx, "draft_len_schedule_without_amx",
                                 full_k_at_one_row=False)
        if self.draft_len_schedule == "auto":
            if not self.acceptance_by_draft_len:
                raise ValueError(
                    "draft_len_schedule: auto needs speculative_config.acceptance_by_draft_len, the measured tau "
                    "by K (e.g. {3: 2.1, 7: 2.9} from `dflash-trt bench speed`)"
                )
            return self
        if self.draft_len_schedule is not None:
            self._check_schedule(self.draft_len_schedule, "draft_len_schedule")
        return self

    def _check_schedule(self, schedule: dict[int, int], name: str, full_k_at_one_row: bool = True) -> None:
        if not schedule:
            raise ValueError(f"{name} must not be empty")
        check_table(schedule, name, "K")
        # TensorRT-LLM's validator (llm_args.py validate_draft_len_schedule_and_sort) required key 1, holding
        # max_draft_len; later versions require only the smallest key to hold it. Key 1 satisfies both.
        if 1 not in schedule:
            raise ValueError(f"{name}={schedule} needs a key 1 (TensorRT-LLM releases of the DFlash line before the "
                             "smallest-key rule require it): add 1: <max_draft_len>")
        if full_k_at_one_row and self.max_draft_len is not None and schedule[1] != self.max_draft_len:
            raise ValueError(
                f"{name}[1]={schedule[1]} must equal max_draft_len={self.max_draft_len} (one row runs the full K)"
            )
        if self.max_draft_len is not None and max(schedule.values()) > self.max_draft_len:
            raise ValueError(f"{name} values must be <= max_draft_len={self.max_draft_len}")


# TensorRT-LLM's sizes are C++ int32 (SizeType32): a larger one written into trtllm/config.yaml failed at its load
INT32_MAX = 2**31 - 1


class KvCacheConfig(_Strict):
    # auto: the checkpoint's quantized KV cache where it declares one, else the model dtype. nvfp4: FP4 values with
    # an FP8 scale per 16 (Blackwell only; TensorRT-LLM documents it for checkpoints ModelOpt quantized offline).
    dtype: Literal["auto", "fp8", "nvfp4", "bfloat16", "float16", "float32"] = "auto"
    free_gpu_memory_fraction: float = Field(default=0.9, gt=0, le=1)
    enable_block_reuse: bool | None = None
    tokens_per_block: int = Field(default=32, ge=1, le=INT32_MAX)


class CudaGraphConfig(_Strict):
    enable_padding: bool = False
    max_batch_size: int = Field(default=0, ge=0)
    batch_sizes: list[int] | None = None

    @model_validator(mode="after")
    def _sizes(self) -> "CudaGraphConfig":
        if self.batch_sizes and self.max_batch_size and max(self.batch_sizes) != self.max_batch_size:
            raise ValueError(f"max_batch_size={self.max_batch_size} must equal max(batch_sizes)={max(self.batch_sizes)}")
        return self


class MoeConfig(_Strict):
    backend: Literal["AUTO", "CUTLASS", "TRTLLM", "TRITON", "DEEPGEMM", "CUTEDSL", "VANILLA"] = "AUTO"


class AttentionDpConfig(_Strict):
    enable_balance: bool = False
    timeout_iters: int = Field(default=50, le=INT32_MAX)
    batching_wait_iters: int = Field(default=10, le=INT32_MAX)


# The page sizes TensorRT-LLM's trtllm-gen attention kernels take (FlashInferTrtllmGenFmha.SUPPORTED_TOKENS_PER_BLOCK)
TRTLLM_GEN_PAGE_SIZES = frozenset({16, 32, 64})


class BuildConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    # The target: "embedded:smollm2-135m-instruct", an HF id, or a local path (./ ../ / ~).
    model: str
    hardware: Literal["b300", "h200", "cpu"]
    # auto: config.json's dtype, but bfloat16 on the CPU (plan.py, cpu_dtype_note)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    moe_expert_parallel_size: int | None = Field(default=None, ge=1)
    moe_tensor_parallel_size: int | None = Field(default=None, ge=1)
    enable_attention_dp: bool = False
    max_batch_size: int = Field(ge=1, le=INT32_MAX)  # per rank under attention data parallelism, as in TRT-LLM
    max_seq_len: int = Field(ge=2, le=INT32_MAX)  # prompt + generated tokens per request
    max_num_tokens: int = Field(default=8192, ge=1, le=INT32_MAX)  # tokens per iteration (prefill chunk + decode rows)
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    speculative_config: SpeculativeConfig | None = None  # None: an engine without a drafter
    cuda_graph_config: CudaGraphConfig | None = None
    moe_config: MoeConfig | None = None
    attention_dp_config: AttentionDpConfig | None = None
    # copy: target weights copied into the engine; link: symlinked (large checkpoints; same machine).
    target_weights: Literal["copy", "link"] = "copy"
    # Further TensorRT-LLM LLM-API keys written verbatim into trtllm/config.yaml (checked against the
    # pinned version's accepted keys), e.g. stream_interval, num_postprocess_workers, env_overrides; keys of a
    # section the build config writes join it (kv_cache_config: {host_cache_size: ...}), unless it sets them.
    trtllm_options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _mapping(self) -> "BuildConfig":
        hw = profile(self.hardware)
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size}: speculative decoding in TensorRT-LLM "
                "supports no pipeline parallelism; use tensor_parallel_size"
            )
        if self.world_size > hw.max_devices:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} needs {self.world_size} devices; hardware "
                f"{self.hardware} has {hw.max_devices} per node"
            )
        ep, mtp = self.moe_expert_parallel_size, self.moe_tensor_parallel_size
        if ep is not None and mtp is not None and ep * mtp != self.tensor_parallel_size:
            raise ValueError(
                f"moe_expert_parallel_size={ep} x moe_tensor_parallel_size={mtp} = {ep * mtp} must equal "
                f"tensor_parallel_size={self.tensor_parallel_size}"
            )
        for key, size in (("moe_expert_parallel_size", ep), ("moe_tensor_parallel_size", mtp)):
            if size is not None and self.tensor_parallel_size % size:
                raise ValueError(f"{key}={size} must divide tensor_parallel_size={self.tensor_parallel_size}")
        if self.enable_attention_dp and self.tensor_parallel_size == 1:
            raise ValueError("enable_attention_dp needs tensor_parallel_size > 1 (one attention replica per rank)")
        if hw.kind == "cpu":
            gpu_only = [k for k in ("cuda_graph_config", "moe_config", "attention_dp_config") if getattr(self, k)]
            if gpu_only:
                raise ValueError(f"{gpu_only[0]} needs a GPU hardware profile; hardware is {self.hardware}")
            if self.kv_cache_config.dtype in ("fp8", "nvfp4"):
                raise ValueError(f"kv_cache_config.dtype={self.kv_cache_config.dtype} needs a GPU; the torch CPU "
                                 "runtime keeps K/V in the model dtype")
        elif self.kv_cache_config.dtype == "nvfp4" and not hw.supports_nvfp4:
            raise ValueError(f"kv_cache_config.dtype=nvfp4 needs FP4 tensor cores (Blackwell: b300); hardware "
                             f"{self.hardware} takes fp8")
        if self.moe_config and self.moe_config.backend == "TRTLLM" and not hw.supports_trtllm_moe:
            raise ValueError(f"moe_config.backend=TRTLLM runs TensorRT-LLM's trtllm-gen MoE kernels, SM100/SM103 "
                             f"(B200/B300) only; hardware {self.hardware} takes TRITON (the gpt-oss guide's for "
                             "Hopper), CUTLASS or AUTO")
        spec = self.speculative_config
        if spec is not None and spec.attention_backend == "TRTLLM" and not hw.supports_trtllm_dflash_attention:
            raise ValueError(
                f"speculative_config.attention_backend=TRTLLM needs SM100/SM103 (B200/B300); hardware {self.hardware} "
                "must use VANILLA"
            )
        pages = self.kv_cache_config.tokens_per_block
        if spec is not None and spec.attention_backend == "TRTLLM" and pages not in TRTLLM_GEN_PAGE_SIZES:
            # TensorRT-LLM raises as it binds the drafter to the KV pool, on the device, after loading the target
            # (_torch/speculative/dflash_attention.py validate_dflash_trtllm_gen_runtime)
            raise ValueError(
                f"kv_cache_config.tokens_per_block={pages}: speculative_config.attention_backend=TRTLLM takes pages "
                f"of {', '.join(map(str, sorted(TRTLLM_GEN_PAGE_SIZES)))} tokens"
            )
        if spec is not None and hw.kind == "gpu":  # served by TensorRT-LLM, whose DFlash must draft at every size
            check_drafting_continues(spec.draft_len_schedule, spec.max_concurrency, spec.max_draft_len,
                                     self.max_batch_size)
        if self.cuda_graph_config and self.cuda_graph_config.max_batch_size > self.max_batch_size:
            raise ValueError(
                f"cuda_graph_config.max_batch_size={self.cuda_graph_config.max_batch_size} exceeds "
                f"max_batch_size={self.max_batch_size}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def moe_ep(self) -> int:
        """Expert-parallel size, filled in as TRT-LLM's mapping does when only one MoE size is given."""
        if self.moe_expert_parallel_size is not None:
            return self.moe_expert_parallel_size
        if self.moe_tensor_parallel_size is not None:
            return self.tensor_parallel_size // self.moe_tensor_parallel_size
        return self.tensor_parallel_size

    @property
    def moe_tp(self) -> int:
        return self.tensor_parallel_size // self.moe_ep

    @property
    def drafter(self) -> str | None:
        return self.speculative_config.speculative_model if self.speculative_config else None


def _keys_at(loc: tuple) -> list[str]:
    """The schema's keys in the mapping at `loc` (a pydantic error location); [] where that is no model."""
    model: type[BaseModel] = BuildConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        subs = [a for a in get_args(field.annotation) or (field.annotation,)
                if isinstance(a, type) and issubclass(a, BaseModel)]
        if not subs:
            return []
        model = subs[0]
    return list(model.model_fields)


def _is_branch(part: Any) -> bool:
    """A pydantic location part naming a union member it tried ("dict[int,int]", "literal['auto']") or a mapping's
    key ("[key]"), not a YAML key."""
    return isinstance(part, str) and "[" in part


def _union_errors(errors: list[dict]) -> list[dict]:
    """Each union field's errors, as one: pydantic reports every member it tried, e.g. for draft_len_schedule
    {1: 7, a: 3} both "a: not an integer" and "should be 'auto'", which reads as if 'auto' were the fix. Where a
    member got past its type (the value is a mapping), its errors alone are kept; else one error lists them all."""
    plain: list[dict] = []
    unions: dict[tuple, list[dict]] = {}
    for err in errors:
        loc = err["loc"]
        cut = next((i for i, p in enumerate(loc) if _is_branch(p)), None)
        if cut is None:
            plain.append(err)
            continue
        note = " (in a key)" if "[key]" in loc else ""
        unions.setdefault(tuple(loc[:cut]), []).append(
            {**err, "loc": tuple(p for p in loc if not _is_branch(p)), "msg": err["msg"] + note})
    for key, members in unions.items():
        deep = [m for m in members if len(m["loc"]) > len(key)]
        plain += deep or [{**members[0], "msg": "; or: ".join(m["msg"] for m in members)}]
    return plain


def _format_error(e: ValidationError, source: str) -> str:
    lines = []
    suggested = set()  # a misspelt required key is also reported missing: the misspelling, named first, is the cause
    for err in sorted(_union_errors(e.errors()), key=lambda err: err["type"] != "extra_forbidden"):
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not part of the build config schema; see dflash_trt/config.py)"
            close = difflib.get_close_matches(str(err["loc"][-1]), _keys_at(err["loc"][:-1]), n=1, cutoff=0.75)
            if close:
                msg = f"unknown key; did you mean '{close[0]}'?"
                suggested.add((*err["loc"][:-1], close[0]))
        elif err["type"] == "missing":
            if tuple(err["loc"]) in suggested:
                continue
            msg = "required key is missing"
        # a check across keys (the build config's own) names them in its message
        lines.append(f"{source}: key '{key}': {msg}" if key else f"{source}: {msg}")
    return "\n".join(lines)


def _set_dotted(d: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {dotted!r}: {p!r} is not a mapping")
    d[parts[-1]] = value


def build_config_from_dict(raw: dict, source: str = "build config", overrides: dict | None = None) -> BuildConfig:
    """Validate `raw` (+ dotted-key `overrides`, e.g. {"speculative_config.max_draft_len": 7})."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: the top level must be a mapping of keys to values")
    raw = yaml.safe_load(yaml.safe_dump(raw))  # deep copy
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    k = overrides.get("speculative_config.max_draft_len")
    if k is not None:
        spec = raw.get("speculative_config")
        spec = spec if isinstance(spec, dict) else {}
        if not spec.get("speculative_model") and "speculative_config.speculative_model" not in overrides:
            raise ValueError(f"{source}: max_draft_len={k} was given but the config has no drafter "
                             "(speculative_config.speculative_model): add one, or drop the K override")
        for key in ("draft_len_schedule", "draft_len_schedule_without_amx"):
            schedule = spec.get(key)
            if isinstance(schedule, dict) and all(is_int(b) and is_int(n) for b, n in schedule.items()):
                # a malformed table is left to the schema's error, which names the key
                spec[key] = with_k(schedule, k)
    graphs = raw.get("cuda_graph_config")
    batch = overrides.get("max_batch_size")
    if batch is not None and isinstance(graphs, dict) and not graphs.get("batch_sizes") and is_int(
            graphs.get("max_batch_size")) and (graphs["max_batch_size"] == raw.get("max_batch_size")
                                               or graphs["max_batch_size"] > batch):
        # CUDA graphs captured up to the file's batch size follow an overridden one: left as they were, a larger
        # batch ran without graphs past the file's size (TensorRT-LLM runs those steps eagerly, unannounced) and a
        # smaller one failed the check below
        overrides = {**overrides, "cuda_graph_config.max_batch_size": batch}
    for key, value in overrides.items():
        _set_dotted(raw, key, value)
    try:
        return BuildConfig.model_validate(raw)
    except ValidationError as e:
        raise ValueError(_format_error(e, source)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error: plain YAML keeps the last one,
    so `max_batch_size: 8` further down a file would silently undo the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                continue
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found key {key!r} a second time (first on line {first.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep)


def load_build_config(path: str | Path, overrides: dict | None = None) -> tuple[BuildConfig, Path]:
    """Read and validate a build config YAML; returns it and the directory its relative paths start from."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: build config not found")
    try:
        with open(path, encoding="utf-8") as f:  # a stream, so YAML's marks name the file and not "<unicode string>"
            raw = yaml.load(f, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: invalid YAML ({e})") from e
    return build_config_from_dict(raw, str(path), overrides), path.resolve().parent


__all__ = ["BuildConfig", "SpeculativeConfig", "KvCacheConfig", "CudaGraphConfig", "MoeConfig", "AttentionDpConfig",
           "load_build_config", "build_config_from_dict", "EMBEDDED_PREFIX", "PROFILE_NAMES"]
