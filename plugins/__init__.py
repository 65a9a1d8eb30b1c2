"""TensorRT Python plugin definitions (tensorrt.plugin register + aot_impl) over the kernels in dflash_trt/kernels."""
