"""The unified engine contract: engines, their registration metadata, helpers, and the
`Worker` that serves an engine."""

from dynamo.common.backend.engine import (
    BaseEngine,
    DiffusionEngine,
    EngineConfig,
    GenerateChunk,
    GenerateRequest,
    LLMEngine,
    LlmRegistration,
    RawEngine,
    RawRequest,
    RawResponseChunk,
)
from dynamo.common.backend.logits_processing import (
    ForcedTokenSequenceSpec,
    LogitsProcessorSpec,
    PythonProcessorSpec,
)
from dynamo.common.backend.model_input import ModelInput
from dynamo.common.backend.publisher import ComponentSnapshot, KvEventSource, PushSource, ZmqSource
from dynamo.common.backend.worker import Worker
from dynamo.common.backend.worker_config import WorkerConfig

__all__ = [
    "BaseEngine",
    "ComponentSnapshot",
    "DiffusionEngine",
    "EngineConfig",
    "ForcedTokenSequenceSpec",
    "GenerateChunk",
    "GenerateRequest",
    "KvEventSource",
    "LLMEngine",
    "LlmRegistration",
    "LogitsProcessorSpec",
    "ModelInput",
    "PushSource",
    "PythonProcessorSpec",
    "RawEngine",
    "RawRequest",
    "RawResponseChunk",
    "Worker",
    "WorkerConfig",
    "ZmqSource",
]
