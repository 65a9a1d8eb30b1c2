"""TensorRT AOT Python plugins for block verification over dflash_trt/kernels/verify_block_triton.py.

Two plugins, one per Triton kernel (an AOT plugin returns one kernel):
`dflash::verify_choice` (choice_kernel: per block position the target's argmax, or its inverse-CDF
sample for MATCH rows) and `dflash::verify_accept` (accept_kernel: accepted prefix, bonus, and the
REJECTION rule's ratio test and residual draw). A greedy-only network feeds the logits as `probs` and
`draft_probs` (never read on GREEDY rows). `import tensorrt` happens in `register()` only.
Oracle: dflash_trt.kernels.verify_block.verify_block_ref.
"""

from __future__ import annotations

from plugins.aot import TRITON_TYPES, CompiledKernel, compile_ptx, import_tensorrt

CHOICE_ID = "dflash::verify_choice"
ACCEPT_ID = "dflash::verify_accept"


def compile_choice(logits_dtype: str, block_v: int = 2048, arch: int = 90) -> CompiledKernel:
    """Runtime args left: LOGITS, PROBS, U, MODES; V, K1; CHOICE."""
    from dflash_trt.kernels.verify_block_triton import choice_kernel

    types = {"LOGITS": "*" + TRITON_TYPES[logits_dtype], "PROBS": "*fp32", "U": "*fp32", "MODES": "*i32",
             "V": "i32", "K1": "i32", "CHOICE": "*i64"}
    return compile_ptx(choice_kernel, types, {"BLOCK_V": block_v}, arch, num_warps=8)


def compile_accept(block_k: int = 16, block_v: int = 2048, arch: int = 90) -> CompiledKernel:
    """Runtime args left: DRAFT, CHOICE, PROBS, DPROBS, U, MODES; V, K; NUM_ACCEPTED, BONUS."""
    from dflash_trt.kernels.verify_block_triton import accept_kernel

    types = {"DRAFT": "*i64", "CHOICE": "*i64", "PROBS": "*fp32", "DPROBS": "*fp32", "U": "*fp32", "MODES": "*i32",
             "V": "i32", "K": "i32", "NUM_ACCEPTED": "*i64", "BONUS": "*i64"}
    return compile_ptx(accept_kernel, types, {"BLOCK_K": block_k, "BLOCK_V": block_v}, arch, num_warps=4)


def register(arch: int = 90) -> None:
    """Register both plugins with TensorRT (>= 10.9)."""
    import numpy as np

    trt, trtp = import_tensorrt()
    dtypes = {trt.float16: "float16", trt.bfloat16: "bfloat16", trt.float32: "float32"}

    @trtp.register(CHOICE_ID)
    def _choice_desc(logits: trtp.TensorDesc, probs: trtp.TensorDesc, uniforms: trtp.TensorDesc,
                     modes: trtp.TensorDesc) -> trtp.TensorDesc:
        return uniforms.like().astype(trt.int64)  # [B, K + 1]

    @trtp.aot_impl(CHOICE_ID)
    def _choice_aot(logits, probs, uniforms, modes, outputs, tactic):
        kernel = compile_choice(dtypes[logits.dtype], arch=arch)
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y = logits.shape_expr[0], logits.shape_expr[1]
        launch.block_x, launch.shared_mem = kernel.num_warps * 32, kernel.shared
        extra = trtp.SymIntExprs(2)
        extra[0], extra[1] = logits.shape_expr[2], logits.shape_expr[1]
        return kernel.name, kernel.ptx, launch, extra

    @trtp.register(ACCEPT_ID)
    def _accept_desc(drafts: trtp.TensorDesc, choice: trtp.TensorDesc, probs: trtp.TensorDesc,
                     draft_probs: trtp.TensorDesc, uniforms: trtp.TensorDesc, modes: trtp.TensorDesc):
        out = modes.like().astype(trt.int64)  # [B]
        return out, out.like()

    @trtp.aot_impl(ACCEPT_ID)
    def _accept_aot(drafts, choice, probs, draft_probs, uniforms, modes, outputs, tactic):
        k = drafts.shape_expr[1]
        block_k = 16 if not k.is_constant else max(16, int(2 ** np.ceil(np.log2(max(1, k.constant_value())))))
        kernel = compile_accept(block_k=block_k, arch=arch)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = drafts.shape_expr[0]
        launch.block_x, launch.shared_mem = kernel.num_warps * 32, kernel.shared
        extra = trtp.SymIntExprs(2)
        extra[0], extra[1] = probs.shape_expr[2], k
        return kernel.name, kernel.ptx, launch, extra
