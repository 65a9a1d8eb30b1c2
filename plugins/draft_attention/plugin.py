"""TensorRT AOT Python plugin `dflash::draft_attention` over dflash_trt/kernels/draft_attention_triton.py.

The same Triton kernel the torch op launches, compiled to PTX with the layer's constants (heads, block
size, head dim, scale, causal, window) baked in, one context split (num_splits = 1: a single kernel).
Inputs must be contiguous in the layouts of plugins/draft_attention/README.md. `import tensorrt`
happens in `register()` only. Oracle: dflash_trt.kernels.draft_attention.draft_attention_ref.
"""

from __future__ import annotations

from plugins.aot import TRITON_TYPES, CompiledKernel, compile_ptx, import_tensorrt

PLUGIN_ID = "dflash::draft_attention"
_LOG2E = 1.4426950408889634  # the kernel's softmax runs in base 2


def compile_kernel(dtype: str, heads: int, kv_heads: int, q_len: int, head_dim: int, scale: float, causal: bool,
                   window: int, has_sinks: bool, arch: int = 90) -> CompiledKernel:
    """PTX of the kernel for one drafter layer; runtime args left: 8 input pointers, 12 strides, 1 output pointer."""
    from dflash_trt.kernels.draft_attention_triton import _pow2, draft_attention_kernel

    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    t = "*" + TRITON_TYPES[dtype]
    groups = heads // kv_heads
    block_m, block_d = _pow2(groups * q_len), _pow2(head_dim)
    types = {"Q": t, "KB": t, "VB": t, "KC": t, "VC": t, "ROWS": "*i32", "CTX": "*i32", "SINKS": "*fp32", "OUT": t}
    types.update({s: "i32" for s in ("s_qb", "s_qq", "s_qh", "s_kbb", "s_kbq", "s_kbh", "s_kcr", "s_kch", "s_kcs",
                                     "s_ob", "s_oq", "s_oh")})
    constexprs = dict(
        qk_scale=scale * _LOG2E, window=window, q_len=q_len, num_splits=1, ML=None,
        KVH=kv_heads, GROUPS=groups, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_Q=_pow2(q_len), BLOCK_D=block_d, CAUSAL=causal, HAS_WINDOW=window > 0,
        HAS_SINKS=has_sinks, DOT_FP32=dtype == "float32",
    )
    return compile_ptx(draft_attention_kernel, types, constexprs, arch, num_warps=8 if block_m * block_d >= 8192 else 4)


def _const(dim, what: str) -> int:
    # a build-time constant dimension (heads, block size, head dim are fixed by the drafter)
    if not getattr(dim, "is_constant", False):
        raise ValueError(f"{PLUGIN_ID}: {what} must be a build-time constant dimension")
    return int(dim.constant_value())


def register(arch: int | None = None) -> None:
    """Register the plugin's shape function and AOT implementation with TensorRT (>= 10.9)."""
    trt, trtp = import_tensorrt()
    dtypes = {trt.float16: "float16", trt.bfloat16: "bfloat16", trt.float32: "float32"}

    @trtp.register(PLUGIN_ID)
    def _desc(q: trtp.TensorDesc, k_block: trtp.TensorDesc, v_block: trtp.TensorDesc, k_cache: trtp.TensorDesc,
              v_cache: trtp.TensorDesc, cache_rows: trtp.TensorDesc, ctx_lens: trtp.TensorDesc, sinks: trtp.TensorDesc,
              scale: float, causal: int, window: int, has_sinks: int) -> trtp.TensorDesc:
        return q.like()

    @trtp.aot_impl(PLUGIN_ID)
    def _aot(q: trtp.TensorDesc, k_block: trtp.TensorDesc, v_block: trtp.TensorDesc, k_cache: trtp.TensorDesc,
             v_cache: trtp.TensorDesc, cache_rows: trtp.TensorDesc, ctx_lens: trtp.TensorDesc, sinks: trtp.TensorDesc,
             scale: float, causal: int, window: int, has_sinks: int, outputs, tactic):
        n, h, d = (_const(q.shape_expr[i], w) for i, w in ((1, "block size"), (2, "query heads"), (3, "head_dim")))
        kvh = _const(k_block.shape_expr[2], "kv heads")
        device_arch = arch
        if device_arch is None:
            import torch

            major, minor = torch.cuda.get_device_capability()
            device_arch = 10 * major + minor
        kernel = compile_kernel(dtypes[q.dtype], h, kvh, n, d, scale, bool(causal), window, bool(has_sinks), device_arch)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = q.shape_expr[0] * kvh
        launch.block_x = kernel.num_warps * 32
        launch.shared_mem = kernel.shared
        s = k_cache.shape_expr[2]  # cache length: may be dynamic
        strides = [n * h * d, h * d, d, n * kvh * d, kvh * d, d, s * (kvh * d), s * d, d, n * h * d, h * d, d]
        extra = trtp.SymIntExprs(len(strides))
        for i, value in enumerate(strides):
            extra[i] = value if not isinstance(value, int) else trtp.SymInt32(value)
        return kernel.name, kernel.ptx, launch, extra

