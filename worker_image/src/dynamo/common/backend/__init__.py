"""The unified engine contract: engines, their registration metadata, and helpers.

The `Worker` that serves an engine arrives with the worker runtime.
"""

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
from dynamo.common.backend.worker import WorkerConfig

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
    "WorkerConfig",
    "ZmqSource",
]
