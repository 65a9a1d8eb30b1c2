"""The TensorRT plugins' AOT path without TensorRT: each kernel compiles to sm_90 PTX whose parameters
come in TensorRT's launch order (input pointers, extra int args, output pointers), and registering
without tensorrt says what to install. Runs in a subprocess: the kernel tests set TRITON_INTERPRET=1,
under which Triton cannot compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, re
from plugins.draft_attention.plugin import compile_kernel
from plugins.verify_block.plugin import compile_accept, compile_choice

def params(k):
    entry = k.ptx[k.ptx.index(".entry " + k.name):]
    entry = entry[: entry.index(")")]
    return ["ptr" if ".ptr" in p else re.search(r"\.param \.(\w+)", p).group(1) for p in entry.split(",")]

out = {
    "draft_attention": params(compile_kernel("bfloat16", 64, 8, 10, 64, 0.125, False, 0, True)),
    "draft_attention_sliding": params(compile_kernel("float16", 32, 8, 16, 128, 0.088, True, 128, False)),
    "verify_choice": params(compile_choice("bfloat16")),
    "verify_accept": params(compile_accept()),
}
# the torch op's other launch shapes (context splits + combine, fp32 with ieee dots) must compile too
from plugins.aot import compile_ptx
from dflash_trt.kernels.draft_attention_triton import _combine_kernel, draft_attention_kernel
t = {n: "*fp32" for n in ("Q", "KB", "VB", "KC", "VC", "SINKS", "OUT", "ML", "ACC")}
t.update({"ROWS": "*i64", "CTX": "*i64", "qk_scale": "fp32", "window": "i32"})
t.update({n: "i32" for n in ("s_qb", "s_qq", "s_qh", "s_kbb", "s_kbq", "s_kbh", "s_kcr", "s_kch", "s_kcs", "s_ob", "s_oq", "s_oh")})
t.update({"q_len": "i32", "num_splits": "i32"})  # runtime in the torch op's launches
c = dict(KVH=2, GROUPS=4, HEAD_DIM=64, BLOCK_M=32, BLOCK_N=64, BLOCK_Q=16, BLOCK_D=64,
         CAUSAL=True, HAS_WINDOW=True, HAS_SINKS=True, DOT_FP32=True)
out["split"] = params(compile_ptx(draft_attention_kernel, t, c))
out["combine"] = params(compile_ptx(_combine_kernel, t, dict(H=8, HEAD_DIM=64, BLOCK_Q=16, BLOCK_D=64, HAS_SINKS=True)))
out["not_specialized"] = [[p.name for p in k.params if p.do_not_specialize] for k in (draft_attention_kernel, _combine_kernel)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx_params():
    pytest.importorskip("triton", reason="the `kernels` extra (triton==3.7.1) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_draft_attention_ptx_takes_inputs_strides_output_in_tensorrt_order(ptx_params):
    # 8 inputs (q, k_block, v_block, k_cache, v_cache, cache_rows, ctx_lens, sinks), 12 int32 strides, 1 output
    want = ["ptr"] * 8 + ["u32"] * 12 + ["ptr"]
    for key in ("draft_attention", "draft_attention_sliding"):
        got = ptx_params[key]
        assert got[: len(want)] == want, (key, got)
        # anything after is Triton's own scratch pointers (unused by these kernels), never a data argument
        assert all(p == "ptr" for p in got[len(want):]), got


def test_split_context_variant_and_its_combine_kernel_compile(ptx_params):
    assert ptx_params["split"][:8] == ["ptr"] * 8 and ptx_params["combine"][0] == "ptr"


def test_the_torch_ops_block_length_and_split_count_compile_no_kernel_apart(ptx_params):
    """Triton compiles apart for an int argument equal to 1 or divisible by 16 unless told not to: the op launches
    K + 1 = 16 and split counts of 1, 16 and 32 mid-serving."""
    assert ptx_params["not_specialized"] == [["q_len", "num_splits"]] * 2


def test_verify_ptx_takes_inputs_sizes_outputs_in_tensorrt_order(ptx_params):
    assert ptx_params["verify_choice"][:7] == ["ptr"] * 4 + ["u32"] * 2 + ["ptr"]
    assert ptx_params["verify_accept"][:10] == ["ptr"] * 6 + ["u32"] * 2 + ["ptr"] * 2


def test_register_without_tensorrt_says_what_to_install():
    pytest.importorskip("triton")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("tensorrt is installed: the missing-package error cannot happen")
    except ImportError:
        pass
    from plugins.draft_attention import plugin as attention
    from plugins.verify_block import plugin as verify

    for module in (attention, verify):
        with pytest.raises(RuntimeError, match="install TensorRT"):
            module.register()
