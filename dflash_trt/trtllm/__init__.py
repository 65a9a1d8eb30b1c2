"""TensorRT-LLM backend: the LLM-API config an engine carries (trtllm/config.yaml) and the launcher.

`tensorrt_llm` is never imported at module level: it cannot be installed from PyPI, and everything
else in dflash_trt must work without it.
"""
