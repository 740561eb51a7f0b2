"""Multimodal support: media loaders, the async encoder cache and embedding transfer."""

from dynamo.common.multimodal.async_encoder_cache import AsyncEncoderCache
from dynamo.common.multimodal.audio_loader import AudioLoader
from dynamo.common.multimodal.embedding_transfer import (
    EMBEDDING_RECEIVER_FACTORIES,
    EMBEDDING_SENDER_FACTORIES,
    AbstractEmbeddingReceiver,
    AbstractEmbeddingSender,
    LocalEmbeddingReceiver,
    LocalEmbeddingSender,
    NixlReadEmbeddingReceiver,
    NixlReadEmbeddingSender,
    NixlWriteEmbeddingReceiver,
    NixlWriteEmbeddingSender,
    TransferRequest,
)
from dynamo.common.multimodal.image_loader import ImageLoader
from dynamo.common.multimodal.video_loader import VideoLoader

__all__ = [
    "EMBEDDING_RECEIVER_FACTORIES",
    "EMBEDDING_SENDER_FACTORIES",
    "AbstractEmbeddingReceiver",
    "AbstractEmbeddingSender",
    "AsyncEncoderCache",
    "AudioLoader",
    "ImageLoader",
    "LocalEmbeddingReceiver",
    "LocalEmbeddingSender",
    "NixlReadEmbeddingReceiver",
    "NixlReadEmbeddingSender",
    "NixlWriteEmbeddingReceiver",
    "NixlWriteEmbeddingSender",
    "TransferRequest",
    "VideoLoader",
]
