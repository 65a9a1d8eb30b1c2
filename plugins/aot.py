"""Compile a Triton kernel to PTX for a TensorRT AOT plugin (no GPU needed: the target is explicit).

TensorRT launches an AOT plugin kernel with (inputs..., extra int args..., outputs...): every other
kernel argument must be compiled in as a constexpr (which removes it from the PTX parameter list).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass


def import_tensorrt():
    """(tensorrt, tensorrt.plugin), or a RuntimeError saying what to install."""
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as error:
        raise RuntimeError(
            "tensorrt is not importable: install TensorRT >= 10.9 from NVIDIA (the PyPI packages are stubs)"
        ) from error
    return trt, trtp


@dataclass
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared: int  # bytes of dynamic shared memory


def compile_ptx(kernel, types: dict[str, str], constexprs: dict, arch: int = 90, num_warps: int = 4) -> CompiledKernel:
    """kernel: a @triton.jit function; types: Triton type of each runtime argument ("*bf16", "i32", ...)."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn = getattr(kernel, "fn", kernel)
    params = list(inspect.signature(fn).parameters)
    missing = [p for p in params if p not in types and p not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constexpr value for {missing}")
    signature = {p: ("constexpr" if p in constexprs else types[p]) for p in params}
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return CompiledKernel(compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.num_warps, compiled.metadata.shared)


TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64"}
