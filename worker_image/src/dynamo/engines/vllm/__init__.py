"""The vLLM engine (`dynamo-worker --engine vllm`): vLLM's AsyncLLM under our runtime.

Importing this package needs no vLLM (it is imported inside the engine's methods); serving
needs the venv `hack/vllm-venv` makes.
"""

from dynamo.engines.vllm.engine import VllmEngine

__all__ = ["VllmEngine"]
