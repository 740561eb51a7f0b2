"""Video generation types (`/v1/videos`), matching the Rust frontend's JSON shapes."""

from __future__ import annotations

from pydantic import BaseModel, Field

# Handler defaults; the request leaves these fields unset when the client omits them.
DEFAULT_VIDEO_SIZE = "832x480"
DEFAULT_RESPONSE_FORMAT = "url"


class VideoNvExt(BaseModel):
    """NVIDIA extensions for video generation requests."""

    annotations: list[str] | None = None
    """Annotations for SSE stream events."""
    fps: int | None = None
    """Frames per second."""
    num_frames: int | None = None
    """Number of frames to generate (overrides fps * seconds when set)."""
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    boundary_ratio: float | None = None
    """Denoising step fraction at which two-expert models switch experts."""
    guidance_scale_2: float | None = None
    """Guidance scale of the second expert."""


class NvCreateVideoRequest(BaseModel):
    """Request for video generation (/v1/videos endpoint)."""

    prompt: str
    model: str
    input_reference: str | None = None
    """Optional image that guides generation (image-to-video)."""
    seconds: int | None = None
    """Clip duration in seconds."""
    size: str | None = None
    """`WIDTHxHEIGHT`; handlers default to 832x480."""
    user: str | None = None
    response_format: str | None = None
    """`url` or `b64_json`; handlers default to `url`."""
    output_format: str | None = None
    stream: bool | None = None
    nvext: VideoNvExt | None = None


class VideoData(BaseModel):
    """Video data in response: a URL or base64-encoded bytes."""

    output_format: str
    """Container format of the video, e.g. `mp4`."""
    url: str | None = None
    b64_json: str | None = None


class NvVideosResponse(BaseModel):
    """Response structure for video generation."""

    id: str
    object: str = "video"
    model: str
    status: str = "completed"
    progress: int = 100
    created: int
    """Unix timestamp (seconds) of creation."""
    data: list[VideoData] = Field(default_factory=list)
    error: str | None = None
    inference_time_s: float | None = None
