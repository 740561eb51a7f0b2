"""Video generation protocol models: required fields, defaults, JSON round trip."""

from __future__ import annotations

import pydantic
import pytest

from dynamo.common.protocols import NvCreateVideoRequest, NvVideosResponse, VideoData
from dynamo.common.protocols.video_protocol import VideoNvExt

pytestmark = pytest.mark.unit


def test_request_requires_prompt_and_model() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        NvCreateVideoRequest.model_validate({"prompt": "a cat"})
    assert info.value.errors()[0]["loc"] == ("model",)


def test_request_parses_frontend_json_with_nvext() -> None:
    request = NvCreateVideoRequest.model_validate_json(
        '{"prompt": "a cat", "model": "wan", "seconds": 4, "size": "1280x720",'
        ' "response_format": "b64_json", "stream": false,'
        ' "nvext": {"fps": 16, "num_inference_steps": 30, "seed": 7, "boundary_ratio": 0.9,'
        ' "guidance_scale_2": 3.0, "annotations": ["progress"]}}'
    )
    assert request.seconds == 4
    assert request.nvext == VideoNvExt(
        fps=16,
        num_inference_steps=30,
        seed=7,
        boundary_ratio=0.9,
        guidance_scale_2=3.0,
        annotations=["progress"],
    )
    assert request.input_reference is None
    assert request.output_format is None


def test_optional_request_fields_default_to_none() -> None:
    request = NvCreateVideoRequest(prompt="p", model="m")
    assert request.model_dump(exclude_none=True) == {"prompt": "p", "model": "m"}


def test_response_defaults_and_serialization() -> None:
    response = NvVideosResponse(
        id="video-1",
        model="wan",
        created=1_700_000_000,
        data=[VideoData(output_format="mp4", url="s3://bucket/video-1.mp4")],
    )
    assert response.object == "video"
    assert response.status == "completed"
    assert response.progress == 100
    assert response.error is None
    assert response.inference_time_s is None
    dumped = response.model_dump()
    assert dumped["data"] == [
        {"output_format": "mp4", "url": "s3://bucket/video-1.mp4", "b64_json": None}
    ]
    assert NvVideosResponse.model_validate_json(response.model_dump_json()) == response


def test_response_data_lists_are_not_shared() -> None:
    first = NvVideosResponse(id="a", model="m", created=1)
    second = NvVideosResponse(id="b", model="m", created=1)
    first.data.append(VideoData(output_format="mp4", b64_json="AAAA"))
    assert second.data == []


def test_video_data_requires_output_format() -> None:
    with pytest.raises(pydantic.ValidationError):
        VideoData.model_validate({"url": "http://x"})
