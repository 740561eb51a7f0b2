"""Memory-bounded caches for worker-side data (multimodal encoder embeddings)."""

from dynamo.common.memory.multimodal_embedding_cache_manager import (
    CachedEmbedding,
    CacheMutation,
    MultimodalEmbeddingCacheManager,
)

__all__ = ["CacheMutation", "CachedEmbedding", "MultimodalEmbeddingCacheManager"]
