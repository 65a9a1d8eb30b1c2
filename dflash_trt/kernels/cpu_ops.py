"""C kernels for the CPU decode step (cpu_ops.c), and their ctypes bindings.

At decode sizes torch spends more time dispatching the ~40 small ops of a decoder layer than computing them
(an 8-row SmolLM2 step took ~18 ms, of which the linears were ~9 ms). The kernels do RMSNorm with its residual
add, the rotary embedding with the K/V cache write, attention over the cache, the gated MLP's activation and
bf16 linears (AVX-512 or AVX2 dot products, or AMX tiles, whose weights are stored reordered: `kernel_weight`) and
the greedy argmax over logits, one call each; `llama_layers` runs every layer of a Llama-family model (or a DFlash
drafter's block) in one call, and `dflash_step` a drafter's whole step. They are compiled on first use with the
machine's C compiler (`cc` or $CC, -O3 -march=native; $DFLASH_TRT_MARCH names another -march, e.g. x86-64-v3 for
the instruction sets of an AVX2 laptop; one past this CPU's is refused) into $DFLASH_TRT_CACHE/cpu_ops, keyed by the
source, the compiler, the flags and the CPU's instruction sets, and called on the tensors' memory; where there is no
compiler, the build fails (a warning), or with DFLASH_TRT_CPU_KERNELS=0, `load()` returns None and torch's ops run
instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from dflash_trt.hardware import cpu_flags

_SOURCES = ("cpu_ops.c", "cpu_ops_body.h")
# -fno-trapping-math: without it GCC keeps loops whose selects feed arithmetic (exp_nonpositive's clamp: the
# softmax, silu) scalar unless AVX-512 masks can guard them; results are the same, only FP exception flags may differ.
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
# The "panels" layout's order of a panel's 16 features: AVX2's 16-bit unpacks widen elements 0-3 and 8-11 of a
# 32-byte load into one vector and 4-7, 12-15 into the other, so storing features 4-7 and 8-11 swapped gives
# features 0-7 and 8-15.
PANEL_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
_i64, _f32, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def cache_dir() -> Path:
    from dflash_trt.embedded import cache_dir as project_cache  # at call time: embedded imports the models

    return project_cache() / "cpu_ops"


def _march() -> str:
    """The -march the kernels are built for: $DFLASH_TRT_MARCH, else this CPU's."""
    return os.environ.get("DFLASH_TRT_MARCH", "native")


def _flags() -> tuple[str, ...]:
    march = _march()
    return tuple(f"-march={march}" if f == "-march=native" else f for f in _FLAGS)


# The compiler's macros for the x86 instruction sets the kernels' code may use -> /proc/cpuinfo's names for them
_ISA_FLAGS = {"__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__BMI2__": "bmi2",
              "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
              "__AVX512DQ__": "avx512dq", "__AVX512CD__": "avx512cd", "__AVX512BF16__": "avx512_bf16",
              "__AVX512VNNI__": "avx512_vnni", "__AVX512FP16__": "avx512_fp16", "__AVXVNNI__": "avx_vnni",
              "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16", "__AMX_INT8__": "amx_int8",
              "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512IFMA__": "avx512ifma",
              "__AVX512BITALG__": "avx512_bitalg", "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__GFNI__": "gfni",
              "__VAES__": "vaes", "__VPCLMULQDQ__": "vpclmulqdq", "__MOVBE__": "movbe", "__BMI__": "bmi1",
              "__LZCNT__": "abm"}


def _check_march(compiler: str) -> None:
    """Raise where $DFLASH_TRT_MARCH enables instruction sets this CPU lacks: its code would stop the process with
    SIGILL at the first kernel call (a server's first request), where it is refused here for torch's ops."""
    march = _march()
    flags = cpu_flags()
    if march == "native" or not flags:
        return
    result = subprocess.run([compiler, f"-march={march}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                            text=True)
    macros = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define ")}
    missing = sorted(flag for macro, flag in _ISA_FLAGS.items() if macro in macros and flag not in flags)
    if missing:
        raise RuntimeError(f"DFLASH_TRT_MARCH={march} builds them with {', '.join(missing)}, which this CPU lacks "
                           "(its code would stop the process at the first call); unset it to build for this CPU")


def _library_path(compiler: str) -> Path:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest.update(" ".join((compiler, version, platform.machine(), _cpu_features(), *_flags())).encode())
    return cache_dir() / f"cpu_ops-{digest.hexdigest()[:16]}.so"


def _cpu_features() -> str:
    # -march=native code is only valid on CPUs with the same instruction sets: a cache shared between machines
    # (a network home) must not hand one machine's build to another.
    return " ".join(sorted(cpu_flags())) or platform.processor()


def build(compiler: str = "cc") -> Path:
    """Compile the kernels unless this exact build is cached; -> the shared library. Raises on a compiler error."""
    path = _library_path(compiler)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: concurrent first uses never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_flags(), str(Path(__file__).parent / "cpu_ops.c"), "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{result.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class CpuOps:
    """The compiled kernels, called on contiguous CPU tensors of one dtype (bfloat16 or float32)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {}
        for dtype, sfx in _SUFFIX.items():
            norm = getattr(library, f"rms_norm_{sfx}")
            norm.argtypes = [_p, _p, _p, _p, _p, _i64, _i64, _f32]
            norm.restype = None
            attn = getattr(library, f"decode_attention_{sfx}")
            attn.argtypes = [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _f32, _i64, _p, _p]
            attn.restype = None
            rope = getattr(library, f"qkv_rotary_write_{sfx}")
            rope.argtypes = [_p, _p, _p, _p, _p, _f32, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64]
            rope.restype = None
            silu = getattr(library, f"silu_mul_{sfx}")
            silu.argtypes = [_p, _p, _i64, _i64]
            silu.restype = None
            self._fns[dtype] = (norm, attn, rope, silu)
        self._layers = library.llama_layers_bf16
        self._layers.argtypes = [_p, _p, _i64, _p, _p, _i64, _p, _p, _i64, _p, _p, _p, _i64, _i64, _i64, _i64, _i64,
                                 _i64, _i64, _f32, _f32, _f32, _p, _p, _i64, _i64, _p, _p]
        self._layers.restype = ctypes.c_int
        self._dflash_step = library.dflash_step_bf16
        self._dflash_step.argtypes = ([_p, _i64, _i64, _p, _f32, _p, _p, _p, _p] + self._layers.argtypes[:22]
                                      + [_p, _i64])
        self._dflash_step.restype = ctypes.c_int
        self._linear = library.linear_bf16
        self._linear.argtypes = [_p, _p, _p, _p, _i64, _i64, _i64]
        self._linear.restype = ctypes.c_int
        self._linear_q8 = library.linear_q8
        self._linear_q8.argtypes = [_p, _p, _p, _p, _i64, _i64, _i64]
        self._linear_q8.restype = ctypes.c_int
        self._layout = library.linear_layout_bf16
        self._layout.argtypes = [_i64, _i64]
        self._layout.restype = ctypes.c_int
        self._head_argmax = library.head_argmax_bf16
        self._head_argmax.argtypes = [_p, _i64, _i64, _p, _p, _p, _p, _p, _p, _i64, _p, _p]
        self._head_argmax.restype = ctypes.c_int
        self._head_screen_values = library.head_screen_values
        self._head_screen_values.argtypes = [_p, _i64, _i64, _p, _p, _p, _i64, _p]
        self._head_screen_values.restype = ctypes.c_int
        self._head_screen_rows = library.head_screen_rows
        self._head_screen_rows.argtypes = []
        self._head_screen_rows.restype = _i64
        self._int8_dot_kind = library.int8_dot_kind
        self._int8_dot_kind.argtypes = []
        self._int8_dot_kind.restype = _i64
        self._argmax = {}
        for dtype, sfx in _SUFFIX.items():
            fn = getattr(library, f"argmax_rows_{sfx}")
            fn.argtypes = [_p, _i64, _i64, _p]
            fn.restype = None
            self._argmax[dtype] = fn

    def linear_layout(self, weight: torch.Tensor) -> str | None:
        """How linear() wants this [N, K] weight stored: "tiles" (AMX), "panels" (AVX2 and FMA without AVX-512, N a
        multiple of 16), "rows" (as torch holds it; AVX512-BF16, or AVX2 and FMA otherwise), or None where no kernel
        serves it (not bf16, K not a multiple of 32, or a CPU without any)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            return None
        return {0: None, 1: "rows", 2: "tiles", 3: "panels"}[self._layout(*weight.shape)]

    def has_linear(self, weight: torch.Tensor) -> bool:
        return self.linear_layout(weight) is not None

    def kernel_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight as linear() reads it: itself (rows), or a reordered copy of the same shape (tiles: per 64
        features and 32 inputs, the four 16 x 32 blocks AMX multiplies; panels: per 16 features, their 16 weights
        for each input in PANEL_ORDER; cpu_ops.c), or None where no kernel serves."""
        layout = self.linear_layout(weight)
        if layout is None:
            return None
        weight = weight.detach().contiguous()
        n, k = weight.shape
        if layout == "rows":
            return weight
        if layout == "panels":
            return weight.view(n // 16, 16, k)[:, PANEL_ORDER].transpose(1, 2).contiguous().view(n, k)
        return weight.view(n // 64, 4, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous().view(n, k)

    def plain_weight(self, kernel_weight: torch.Tensor) -> torch.Tensor:
        """kernel_weight()'s inverse: the [N, K] weight as torch holds it."""
        layout = self.linear_layout(kernel_weight)
        n, k = kernel_weight.shape
        if layout == "panels":  # PANEL_ORDER is its own inverse
            return kernel_weight.view(n // 16, k, 16).transpose(1, 2)[:, PANEL_ORDER].contiguous().view(n, k)
        if layout != "tiles":
            return kernel_weight
        return kernel_weight.view(n // 64, k // 32, 4, 16, 16, 2).permute(0, 2, 4, 1, 3, 5).contiguous().view(n, k)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ W [N, K]^T (+ bias), where weight = kernel_weight(W); every row's result is the same whichever
        rows share the call."""
        x = x.contiguous()
        n, k = weight.shape
        _check_input("linear", x, k, weight.dtype)
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        if not self._linear(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
                            out.data_ptr(), x.numel() // k, n, k):
            raise ValueError(f"linear: no kernel here serves a [{n}, {k}] weight (kernel_weight() gives None for it)")
        return out

    def linear_q8(self, x: torch.Tensor, weight: "Int8Weight", bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x [..., K] (bf16) @ the int8 weight's (s q)^T (+ bias) -> bf16 [..., N]; each row's result is the same
        whichever rows share the call. None where this build has no int8 kernel (AVX512-VNNI or AVX2)."""
        x = x.contiguous()
        n, k = weight.shape
        _check_input("linear_q8", x, k, torch.bfloat16)
        out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
        done = self._linear_q8(x.data_ptr(), ctypes.addressof(weight.struct),
                               bias.data_ptr() if bias is not None else None, out.data_ptr(), x.numel() // k, n, k)
        return out if done else None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) for x [..., V] (V >= 1): the first index of the maximum, a NaN counting as the
        maximum; one vectorised pass per row on the calling thread."""
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty(x.shape[:-1], dtype=torch.long)
        self._argmax[x.dtype](x.data_ptr(), x.numel() // n, n, out.data_ptr())
        return out

    def has_int8_kernels(self) -> bool:
        """Whether the int8 kernels (head_argmax, linear_q8) run here: AVX512-BF16 and AVX512-VNNI, or AVX2."""
        return self.int8_dot() is not None

    def int8_dot(self) -> str | None:
        """The int8 kernels' dot product: "vpdpbusd" (AVX512-VNNI; the input in two int8 levels), "vpmaddwd" (AVX2;
        the input in one int16 level, a quarter of VPDPBUSD's products an instruction), or None."""
        return {0: None, 1: "vpmaddwd", 2: "vpdpbusd"}[int(self._int8_dot_kind())]

    def head_screen_rows(self) -> int:
        """The most rows head_argmax screens here (beyond them the full head is faster): 8 with AVX512-VNNI, 4 with
        AVX2, 0 without either."""
        return int(self._head_screen_rows())

    def head_screen_values(self, x: torch.Tensor, screen: Int8Weight) -> torch.Tensor | None:
        """The values head_argmax screens with, fp32 [M, N] for bf16 x [M, K]: about x @ (scale q)^T (for tests); None
        where the screen declines."""
        x = x.contiguous()
        m, k = x.shape
        n = screen.shape[0]
        _check_input("head_screen_values", x, screen.shape[1], torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.float32)
        done = self._head_screen_values(x.data_ptr(), m, k, screen.q.data_ptr(), screen.qsum.data_ptr(),
                                        screen.scale.data_ptr(), n, out.data_ptr())
        return out if done else None

    def head_argmax(self, x: torch.Tensor, screen: Int8Weight, weight: torch.Tensor,
                    scratch: torch.Tensor) -> torch.Tensor | None:
        """argmax(linear(x, weight), -1) for bf16 x [M, K] through the head's int8 copy `screen` (layers/greedy_head.py;
        weight = kernel_weight(W); scratch: fp32, at least 3 M N / 2); None where the kernel declines (then nothing is
        decided: more than head_screen_rows() rows, a row that is not finite, logits past fp32's range, or no kernel
        for this CPU or head)."""
        x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        _check_input("head_argmax", x, screen.shape[1], torch.bfloat16)
        if scratch.dtype != torch.float32 or scratch.numel() < 3 * m * n // 2:
            raise ValueError(f"head_argmax: scratch needs {3 * m * n // 2} float32 values, "
                             f"got {scratch.numel()} {scratch.dtype}")
        out = torch.empty(m, dtype=torch.long)
        done = self._head_argmax(x.data_ptr(), m, k, screen.q.data_ptr(), screen.qsum.data_ptr(),
                                 screen.scale.data_ptr(), screen.err.data_ptr(), screen.wnorm.data_ptr(),
                                 weight.data_ptr(), n, scratch.data_ptr(), out.data_ptr())
        return out if done else None

    @staticmethod
    def supports(*tensors: torch.Tensor) -> bool:
        dtype = tensors[0].dtype
        return dtype in _SUFFIX and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """weight * rms_norm(x [+ residual]) over the last dim -> (normed, x + residual or None)."""
        x = x.contiguous()
        d = x.shape[-1]
        out = torch.empty_like(x)
        total = None
        if residual is not None:
            residual = residual.contiguous()
            total = torch.empty_like(x)
        self._fns[x.dtype][0](
            x.data_ptr(), residual.data_ptr() if residual is not None else None,
            total.data_ptr() if total is not None else None, weight.contiguous().data_ptr(), out.data_ptr(),
            x.numel() // d, d, eps,
        )
        return out, total

    def qkv_rotary_write(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int,
        head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """Fused q/k/v projections of N tokens (qkv [..., (H + 2 KVH) * D]) -> rotated q [N, H, D]; the rotated k
        and v are written into k/v_cache ([cache rows, KVH, max_len, D]) at (rows[i], positions[i]). cos/sin hold
        N rows of the rotary channels; head_norms = (q weight, k weight, eps) applies per-head RMSNorm first."""
        _, kv_heads, max_len, d = k_cache.shape
        qkv = qkv.reshape(-1, qkv.shape[-1]).contiguous()
        n, rot = qkv.shape[0], cos.shape[-1]
        if qkv.shape[1] != (heads + 2 * kv_heads) * d:
            raise ValueError(f"qkv_rotary_write: {qkv.shape[1]} projected channels for {heads}+2x{kv_heads} heads "
                             f"of {d}")
        _check_indices("qkv_rotary_write", n, rows=rows, positions=positions)
        cos, sin = cos.reshape(n, rot).contiguous(), sin.reshape(n, rot).contiguous()
        q_norm, k_norm, eps = head_norms if head_norms is not None else (None, None, 0.0)
        q = torch.empty(n, heads, d, dtype=qkv.dtype)
        self._fns[qkv.dtype][2](
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_norm.data_ptr() if q_norm is not None else None,
            k_norm.data_ptr() if k_norm is not None else None, eps, rows.data_ptr(), positions.data_ptr(),
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), n, heads, kv_heads, d, rot, max_len,
        )
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for fused [..., 2 * I] projections -> [..., I]."""
        gate_up = gate_up.contiguous()
        inner = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype)
        self._fns[gate_up.dtype][3](gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inner), inner)
        return out

    def llama_layers(
        self, x: torch.Tensor, table: "LayerTable", k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
        capture_layer_ids: tuple[int, ...] = (), tree: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Every decoder layer of a Llama-family model over x [B, Q, hidden] (bf16) in one call; the caches are the
        model's whole K/V tensors [layers, rows, KVH, max_len, D]. -> (the last layer's output, the captured layers'
        outputs concatenated in capture_layer_ids' order, or None); None where the library declines. tree: as
        cached_attention's."""
        x, cos, sin, args = self._layer_args(x, table, k_cache, v_cache, cos, sin, rows, positions, lens)
        b, n, hidden = x.shape
        # the kernel copies a layer's output to one slot: a layer named twice (z-lab's format allows it) is captured
        # once and repeated after (its other slots were left as torch.empty gave them)
        layers = list(dict.fromkeys(capture_layer_ids))
        slots = [-1] * k_cache.shape[0]
        for slot, layer in enumerate(layers):
            slots[layer] = slot
        capture = torch.tensor(slots, dtype=torch.int64)
        features = torch.empty(b, n, hidden * len(layers), dtype=x.dtype) if layers else None
        done = self._layers(*args, capture.data_ptr(), features.data_ptr() if features is not None else None,
                            len(layers), int(table.int8), _tree_pointer(tree, b * n),
                            None if table.windows is None else table.windows.data_ptr())
        if done and len(layers) < len(capture_layer_ids):
            order = [layers.index(layer) for layer in capture_layer_ids]
            features = features.view(b, n, len(layers), hidden)[:, :, order].reshape(b, n, -1)
        return (x, features) if done else None

    def dflash_step(
        self, features: torch.Tensor, context: "ContextTable", ctx_cos: torch.Tensor, ctx_sin: torch.Tensor,
        ctx_rows: torch.Tensor, ctx_positions: torch.Tensor, x: torch.Tensor, table: "LayerTable",
        k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
        positions: torch.Tensor, lens: torch.Tensor,
    ) -> torch.Tensor | None:
        """A DFlash drafter's step (bf16) in one call: the features [n_ctx, F] of newly committed tokens into every
        layer's cache at (ctx_rows, ctx_positions), then the block x [B, Q, hidden] through every layer and the final
        norm -> [B, Q, hidden]; None where the library declines. Arguments after x as llama_layers'."""
        features = features.reshape(-1, features.shape[-1]).contiguous()
        rot = cos.shape[-1]
        ctx_cos, ctx_sin = ctx_cos.reshape(-1, rot).contiguous(), ctx_sin.reshape(-1, rot).contiguous()
        x, cos, sin, args = self._layer_args(x, table, k_cache, v_cache, cos, sin, rows, positions, lens)
        out = torch.empty_like(x)
        done = self._dflash_step(
            features.data_ptr(), features.shape[0], features.shape[1], ctypes.addressof(context.pointers),
            context.hidden_eps, ctx_cos.data_ptr(), ctx_sin.data_ptr(), ctx_rows.data_ptr(), ctx_positions.data_ptr(),
            *args, out.data_ptr(), int(table.int8),
        )
        return out if done else None

    def _layer_args(
        self, x: torch.Tensor, table: "LayerTable", k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
        """-> (a contiguous copy of x: the residual stream C updates in place, cos and sin as [tokens, rot] rows,
        llama_layers_bf16's arguments up to `scale`, which dflash_step_bf16 takes too). The arguments hold the first
        three's pointers: the caller keeps them referenced until the call returns."""
        x = x.clone(memory_format=torch.contiguous_format)
        b, n, hidden = x.shape
        layers, _, kv_heads, max_len, d = k_cache.shape
        rot = cos.shape[-1]
        cos, sin = cos.reshape(-1, rot).contiguous(), sin.reshape(-1, rot).contiguous()
        return x, cos, sin, (
            x.data_ptr(), ctypes.addressof(table.pointers), layers, k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache[0].numel(), cos.data_ptr(), sin.data_ptr(), rot, rows.data_ptr(), positions.data_ptr(),
            lens.data_ptr(), b * n, hidden, table.heads, kv_heads, d, table.intermediate, max_len, table.eps,
            table.qk_eps, table.scale,
        )

    def cached_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
        scale: float, window: int | None = None, tree: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each query q[i] ([N, H, D]) attends over cache row rows[i] of k/v_cache ([cache rows, KVH, max_len, D]),
        keys [0, lens[i]) or the last `window` of them -> [N, H, D]. rows and lens: int64 [N]. tree (a draft tree's
        verify, QueryKeys.tree): int64 [N, 2] of (start, bits): keys t >= start visible only where bit t - start is
        set; a window then counts from the node's depth, as a chain of its ancestors would (cpu_ops_body.h). sinks
        ([H], gpt-oss): a logit per query head in each softmax's denominator that weighs no value."""
        q = q.contiguous()
        b, h, d = q.shape
        _, kvh, max_len, _ = k_cache.shape
        if h % kvh or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[-1] != d:
            raise ValueError(f"cached_attention: {h} query heads of {d} over {kvh} KV heads of {k_cache.shape[-1]}, "
                             "or a strided cache")
        if not q.dtype == k_cache.dtype == v_cache.dtype:  # read as the query's type: NaNs
            raise ValueError(f"cached_attention: {q.dtype} queries over a {k_cache.dtype}/{v_cache.dtype} cache")
        _check_indices("cached_attention", b, rows=rows, lens=lens)
        if sinks is not None:
            if sinks.shape != (h,):
                raise ValueError(f"cached_attention: sinks of shape {tuple(sinks.shape)} for {h} query heads")
            sinks = sinks.detach().float().contiguous()
        out = torch.empty_like(q)
        self._fns[q.dtype][1](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), rows.data_ptr(), lens.data_ptr(), out.data_ptr(),
            b, h, kvh, max_len, d, scale, window or 0, _tree_pointer(tree, b),
            None if sinks is None else sinks.data_ptr(),
        )
        return out


def _check_input(op: str, x: torch.Tensor, k: int, dtype: torch.dtype) -> None:
    """x [..., k] of the weight's type: the kernels read x.numel() // k rows of it as that type (a narrower x wrote
    past the output, an fp32 one read as bf16 gave NaNs)."""
    if x.shape[-1] != k or x.dtype != dtype:
        raise ValueError(f"{op}: x is {x.dtype} with {x.shape[-1]} inputs, the weight takes {dtype} with {k}")


def _check_indices(op: str, n: int, **indices: torch.Tensor) -> None:
    """The kernels read these as n contiguous int64 (a strided or int32 view was misread, reading past the cache);
    their values are the caller's to keep in range (reading them would cost each call a reduction)."""
    for name, t in indices.items():
        if t.dtype != torch.int64 or t.shape != (n,) or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous int64 [{n}], got {t.dtype} {tuple(t.shape)}"
                             f"{'' if t.is_contiguous() else ' (strided)'}")


def _tree_pointer(tree: torch.Tensor | None, queries: int) -> int | None:
    if tree is None:
        return None
    if tree.dtype != torch.int64 or tree.shape != (queries, 2) or not tree.is_contiguous():
        raise ValueError(f"tree must be a contiguous int64 [{queries}, 2], got {tuple(tree.shape)}")
    return tree.data_ptr()


class _Int8Struct(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("qsum", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


class Int8Weight:
    """An [N, K] weight in int8 with one scale per output feature (w ~ scale[:, None] * q), as cpu_ops.c's
    linear_q8 and head_argmax_bf16 read it: q per 16 features and 4 inputs ([N / 16][K / 4][16][4], VPDPBUSD's
    order; AVX2's VPMADDWD takes it a quarter at a time), qsum the sum of each feature's q; err and wnorm bound what
    the int8 copy misses (|w_j - s_j q_j| and |w_j|, rounded up). Quantized a chunk of features at a time in float64
    (a whole gpt-oss head at once would take 4.6 GB)."""

    CHUNK_VALUES = 2**24  # weights quantized at a time: each float64 copy of a chunk 128 MB, however wide the rows
    MAX_INPUTS = 65536  # cpu_ops.c's Q8_MAX_K: int32 sums of 255 x 127 a product hold 66,311 of them

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        if n % 16 or k % 4 or k > self.MAX_INPUTS:
            raise ValueError(f"Int8Weight: [{n}, {k}] is not whole blocks of 16 features and 4 inputs, at most "
                             f"{self.MAX_INPUTS:,}")
        self.shape = (n, k)
        self.scale, self.err, self.wnorm = torch.empty(n), torch.empty(n), torch.empty(n)
        self.qsum = torch.empty(n, dtype=torch.int32)
        q = torch.empty(n, k, dtype=torch.int8)
        up = 1 + 1e-6  # norms rounded up into fp32: a bound built on them may only grow
        chunk = max(16, self.CHUNK_VALUES // k)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            w = weight[rows].detach().double()
            scale = (w.abs().amax(dim=1) / 127).float()
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            qc = torch.round(w / scale.double()[:, None]).clamp(-127, 127)
            self.scale[rows] = scale
            self.err[rows] = ((w - qc * scale.double()[:, None]).norm(dim=1) * up).float()
            self.wnorm[rows] = (w.norm(dim=1) * up).float()
            self.qsum[rows] = qc.sum(dim=1).to(torch.int32)
            q[rows] = qc.to(torch.int8)
        self.q = q.view(n // 16, 16, k // 4, 4).transpose(1, 2).contiguous()
        self.struct = _Int8Struct(self.q.data_ptr(), self.qsum.data_ptr(), self.scale.data_ptr())

    def dequantized(self) -> torch.Tensor:
        """scale * q as an fp32 [N, K] tensor (what linear_q8 multiplies by, for references)."""
        n, k = self.shape
        return self.q.transpose(1, 2).reshape(n, k).float() * self.scale[:, None]


def _pointer(entry: torch.Tensor | Int8Weight | None) -> int | None:
    if entry is None:
        return None
    return ctypes.addressof(entry.struct) if isinstance(entry, Int8Weight) else entry.data_ptr()


class LayerTable:
    """The pointers llama_layers passes to C, 12 per layer (cpu_ops.c: W_IN_NORM .. W_K_NORM), and the layers'
    shapes. The projections are all bf16 kernel weights or all Int8Weight (int8: linear_q8 runs them). Holds
    references to its tensors, so the pointers stay valid while it lives."""

    PER_LAYER = 12

    def __init__(self, per_layer: list[list[torch.Tensor | Int8Weight | None]], heads: int, intermediate: int,
                 eps: float, qk_eps: float, scale: float, int8: bool = False,
                 windows: tuple[int | None, ...] = ()) -> None:
        if any(len(entries) != self.PER_LAYER for entries in per_layer):
            raise ValueError(f"LayerTable: {self.PER_LAYER} entries per layer expected")
        if windows and len(windows) != len(per_layer):
            raise ValueError(f"LayerTable: {len(windows)} sliding windows for {len(per_layer)} layers")
        # each layer's sliding window (0: none), or None where no layer slides
        self.windows = torch.tensor([w or 0 for w in windows], dtype=torch.int64) if any(windows) else None
        self.tensors = [t for entries in per_layer for t in entries]
        self.pointers = (ctypes.c_void_p * len(self.tensors))(*[_pointer(t) for t in self.tensors])
        self.heads, self.intermediate, self.eps, self.qk_eps, self.scale = heads, intermediate, eps, qk_eps, scale
        self.int8 = int8


class ContextTable:
    """The pointers dflash_step passes to C (cpu_ops.c: C_FC .. C_K_NORM): a drafter's fc, hidden norm and final
    norm, then per layer its k/v projection, bias and k norm; the projections in the format of the LayerTable it
    runs with. Holds references to its tensors."""

    def __init__(self, fc: torch.Tensor | Int8Weight, hidden_norm: torch.Tensor, final_norm: torch.Tensor,
                 per_layer: list[list[torch.Tensor | Int8Weight | None]], hidden_eps: float) -> None:
        self.tensors = [fc, hidden_norm, final_norm] + [t for entries in per_layer for t in entries]
        self.pointers = (ctypes.c_void_p * len(self.tensors))(*[_pointer(t) for t in self.tensors])
        self.hidden_eps = hidden_eps


def for_tensors(*tensors: torch.Tensor) -> CpuOps | None:
    """The kernels if they serve these tensors: CPU, one supported dtype, and no autograd (training keeps torch's
    differentiable ops)."""
    if torch.is_grad_enabled() or not CpuOps.supports(*tensors):
        return None
    return load()


SWITCHES = ("DFLASH_TRT_CPU_KERNELS", "DFLASH_TRT_AMX", "DFLASH_TRT_PANELS")
_OFF, _ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")


def switched_off(name: str) -> bool:
    """An off switch in the environment: 0, false, no or off, in any case (cpu_ops.c reads DFLASH_TRT_AMX and
    DFLASH_TRT_PANELS alike)."""
    return os.environ.get(name, "").lower() in _OFF


@functools.cache
def load() -> CpuOps | None:
    """The kernels, built if needed; None where they cannot be (DFLASH_TRT_CPU_KERNELS=0, or no compiler or a
    failed build, each warned about once). A switch set to a word neither on nor off is warned about: it stays on."""
    for name in SWITCHES:
        if os.environ.get(name, "").lower() not in _OFF + _ON:
            warnings.warn(f"dflash-trt: {name}={os.environ[name]!r} is neither off (0, false, no, off) nor on (1, "
                          "true, yes, on): left on", stacklevel=2)
    if switched_off("DFLASH_TRT_CPU_KERNELS"):
        return None
    return load_with(os.environ.get("CC", "cc"))


def load_with(compiler: str) -> CpuOps | None:
    """The kernels built by `compiler` (not cached in memory; load() is); None, with a warning, without it or if
    the build fails."""
    if shutil.which(compiler) is None:  # silent, a slim image or a Mac without build tools ran at half the speed
        warnings.warn(f"dflash-trt: no C compiler {compiler!r} found (cc, or $CC): torch's ops run instead of the CPU "
                      "kernels, about half as fast; install gcc or clang, or set CC", stacklevel=2)
        return None
    try:
        _check_march(compiler)
        return CpuOps(ctypes.CDLL(str(build(compiler))))
    except (RuntimeError, OSError) as error:
        warnings.warn(f"dflash-trt: the CPU kernels are unavailable, torch's ops run instead: {error}", stacklevel=2)
        return None
