"""Weight-only quantization of the linear layers and the LM head (`quantization=` in EngineArgs)."""

from engine.layers.quant.int8 import METHODS, int8_linear, quantize_int8

__all__ = ["METHODS", "int8_linear", "quantize_int8"]
