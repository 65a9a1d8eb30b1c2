"""A decoding step reads back from the device once, and copies host data there only through device_copy: on a GPU
every read (`int(t)`, `bool(t)`, `t.tolist()`, `t.cpu()`, ...; an op whose output's size its values decide:
`nonzero`, `unique`, a boolean mask) and every copy from pageable host memory
(`torch.tensor(x, device=...)`, `t.to(device)`) waits for every kernel queued before it, so the host cannot run ahead
of the GPU.

The torch path the runtime takes on CUDA runs here with the CPU kernels off; the drafter's block attention, a
Triton kernel there that reads nothing back, runs uncounted through its torch reference, and `dflash::verify_block`'s
reference stands in for its Triton launch (both read the batch's sampling facts through target_probs, once)."""

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.kernels import cpu_ops
from dflash_trt.kernels.verify_block import verify_block_ref
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.sampling_params import SamplingParams

READS = {"__int__", "__index__", "__float__", "__bool__", "item", "tolist", "numpy", "cpu"}
# Ops whose output's size depends on the values: the host must read how many there are before it goes on
SIZED_BY_VALUES = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere"}


def _sized_by_values(name: str, args: tuple) -> bool:
    if name == "where":
        return len(args) == 1  # where(cond) is nonzero(cond)
    if name == "__getitem__":  # a boolean mask picks a number of elements only its values say
        key = args[1]
        return any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in (key if isinstance(key, tuple)
                                                                                    else (key,)))
    return name in SIZED_BY_VALUES


class DeviceReads(TorchFunctionMode):
    """While active, counts the host's reads of tensor values (`count`; a tensor `.cpu()` returned is the host's copy,
    and reading that counts no further) and the tensors made from host data, moved by `.to(device)` or indexed by a
    list outside dflash_trt/device_copy.py (`copies`: a GPU would copy them from pageable memory). A torch function
    mode, not patched torch functions: with torch.tensor patched during an engine run, a transformers model later in
    the same process computed other logits (the oracle of other tests; why is not pinned down)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.copies = 0
        self._host: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS and id(args[0]) not in self._host:
            self.count += 1
        elif _sized_by_values(name, args) and traceback.extract_stack(limit=2)[0].name != "verify_block_ref":
            self.count += 1  # (the reference's own grouping of rows by rule is not what the Triton kernel runs)
        elif _copies(name, args, kwargs) and not any(f.filename.endswith("device_copy.py")
                                                    for f in traceback.extract_stack(limit=6)):
            self.copies += 1
        if name == "verify_block.default":  # a custom op's body runs unseen: the reference's reads as the Triton one's
            with self:
                out = verify_block_ref(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if name == "cpu":
            self._host.add(id(out))
        return out


def _copies(name: str, args: tuple, kwargs: dict) -> bool:
    if name in ("__getitem__", "__setitem__"):  # a list index is made into a tensor and copied over
        key = args[1]
        return any(isinstance(k, list) for k in (key if isinstance(key, tuple) else (key,)))
    moves = "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])
    return name == "tensor" or (name == "to" and moves)


@pytest.fixture
def reads(monkeypatch) -> DeviceReads:
    """The torch path CUDA takes: no CPU kernels."""
    monkeypatch.setattr(cpu_ops, "for_tensors", lambda *tensors, **kw: None)
    return DeviceReads()


def _reads_per_step(tiny_dirs, reads: DeviceReads, rows: int, sampling: dict | None = None, target_dir=None,
                    **cfg) -> tuple[list[int], str]:
    """Each step's reads while `rows` requests decode together (after their prompts and a first step), greedy or
    sampled by `sampling` (SamplingParams fields), and the runner's step that ran."""
    config = EngineConfig(max_batch_size=rows, max_draft_len=3, pack_weights=False, screen_head=False, **cfg)
    target = load_target(target_dir or tiny_dirs["qwen3"], config.torch_dtype)
    drafter = None if target_dir else load_drafter(tiny_dirs["qwen3_drafter"], target.config, config.torch_dtype)
    engine = LLMEngine(target, None, drafter, config)
    kinds = []
    for kind in ("decode_step", "spec_step", "tree_step"):
        real = getattr(engine.runner, kind)

        def step(*args, _real=real, _kind=kind, **kwargs):
            kinds.append(_kind)
            return _real(*args, **kwargs)
        setattr(engine.runner, kind, step)
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **(sampling or {}))
    for _ in range(rows):
        engine.add_request(torch.randint(3, 90, (9,), generator=g).tolist(), params)
    while len(kinds) < 2:  # prompts, a first step (the rotary table grows once)
        engine.step()
    counts = []
    while engine.has_unfinished():
        reads.count = reads.copies = 0
        with reads:
            engine.step()
        counts.append(reads.count)
        assert reads.copies == 0
    return counts, kinds[-1]


MATCH = {"temperature": 0.8, "top_p": 0.9, "seed": 1}
REJECTION = {"temperature": 0.8, "top_k": 20, "seed": 1, "acceptance": "rejection"}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("sampling", [None, MATCH])
def test_a_plain_step_reads_its_tokens_alone(tiny_dirs, reads, rows, sampling):
    counts, kind = _reads_per_step(tiny_dirs, reads, rows, sampling, speculative=False)
    assert kind == "decode_step" and set(counts) == {1}


@pytest.mark.parametrize("rows", [1, 3])
def test_a_chain_step_reads_its_emitted_tokens_alone(tiny_dirs, reads, rows):
    counts, kind = _reads_per_step(tiny_dirs, reads, rows)
    assert kind == "spec_step" and set(counts) == {1}


@pytest.mark.parametrize("sampling", [MATCH, REJECTION])
def test_a_sampled_chain_step_reads_what_the_batch_samples_by_and_its_emitted_tokens(tiny_dirs, reads, sampling):
    counts, kind = _reads_per_step(tiny_dirs, reads, 3, sampling)
    assert kind == "spec_step" and set(counts) == {2}


@pytest.mark.parametrize("sampling", [None, MATCH])
def test_a_tree_step_reads_the_drafters_choices_and_the_targets(tiny_dirs, reads, sampling):
    counts, kind = _reads_per_step(tiny_dirs, reads, 1, sampling, draft_tree={1: 5})
    assert kind == "tree_step" and set(counts) == {2}



@pytest.mark.parametrize("sampling", [{"repetition_penalty": 1.3}, {**MATCH, "presence_penalty": 0.5}])
def test_a_penalised_chain_step_reads_its_drafts_once_for_every_row(tiny_dirs, reads, sampling):
    """Position j's penalties count the drafts before it as output: the drafts are read back once a step, not once
    for each row that shapes its logits."""
    one, kind = _reads_per_step(tiny_dirs, reads, 1, sampling)
    three, _ = _reads_per_step(tiny_dirs, reads, 3, sampling)
    assert kind == "spec_step" and set(one) == set(three) and len(set(three)) == 1


def test_a_gpt_oss_step_reads_its_expert_routes_once_a_layer(tiny_dirs, reads, tmp_path):
    """The MoE layers group their tokens by expert on the host: one read of a layer's routes (it read them once, then
    once more for every expert a token was routed to)."""
    from tests.models.test_gpt_oss import make_gpt_oss

    target_dir = make_gpt_oss(tmp_path / "gpt_oss", layers=4)
    counts, kind = _reads_per_step(tiny_dirs, reads, 3, target_dir=target_dir, speculative=False)
    assert kind == "decode_step" and set(counts) == {4 + 1}  # each layer's routes, then the step's tokens
