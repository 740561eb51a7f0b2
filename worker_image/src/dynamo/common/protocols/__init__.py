"""Request/response types for media generation, shared across backends."""

from dynamo.common.protocols.video_protocol import NvCreateVideoRequest, NvVideosResponse, VideoData

__all__ = ["NvCreateVideoRequest", "NvVideosResponse", "VideoData"]
