"""dflash-trt: build, serve and benchmark DFlash speculative decoding."""

from dflash_trt.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
