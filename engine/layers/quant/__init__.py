"""Weight-only quantization of the linear layers and the LM head (`quantization=` in EngineArgs):
int8 per output channel, int4 group-wise, or a GGUF file's own blocks (spec.py)."""

from engine.layers.quant.apply import is_quantized, quantize_param
from engine.layers.quant.spec import METHODS, QuantSpec, parse_quantization

__all__ = ["METHODS", "QuantSpec", "is_quantized", "parse_quantization", "quantize_param"]
