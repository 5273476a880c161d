from engine.layers.attention.backend import AttentionBackend
from engine.layers.attention.layer import Attention
from engine.layers.attention.metadata import AttentionMetadata, DecodeBucket, PrefillChunk
from engine.layers.attention.selector import get_backend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "DecodeBucket", "PrefillChunk", "get_backend"]
