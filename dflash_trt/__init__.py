"""dflash-trt: build, serve and benchmark DFlash speculative decoding.

    from dflash_trt import SamplingParams, open_engine

    llm = open_engine("engines/smollm2-135m-cpu")            # a `dflash-trt build` directory
    out = llm.generate([llm.encode("Why is the sky blue?", chat=True)], SamplingParams(max_new_tokens=64))
    print(out[0].text, out[0].tau)
"""

from dflash_trt.sampling_params import SamplingParams
from dflash_trt.structured_output import StructuredOutput

__all__ = ["EngineConfig", "LLMEngine", "QueueFullError", "RequestOutput", "SamplingParams", "StreamChunk",
           "StructuredOutput", "open_engine"]
__version__ = "0.1.0"

# torch loads on first use of these, not on `import dflash_trt` (the CLI's --help stays quick)
_LAZY = {"EngineConfig": "dflash_trt.engine.llm_engine", "LLMEngine": "dflash_trt.engine.llm_engine",
         "RequestOutput": "dflash_trt.engine.llm_engine", "StreamChunk": "dflash_trt.engine.llm_engine",
         "open_engine": "dflash_trt.engine_dir", "QueueFullError": "dflash_trt.engine.scheduler"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dflash_trt' has no attribute {name!r}")
