"""LoRA adapter acquisition: `file://`, `s3://`, `hf://` and custom sources, with a cache."""

from dynamo.common.lora.adapter import adapter_digest
from dynamo.common.lora.downloader import LoRADownloader
from dynamo.common.lora.errors import LoRADownloadError
from dynamo.common.lora.manager import LoRAInfo, LoRAManager, LoRASourceProtocol, get_lora_manager
from dynamo.common.lora.once import OnceLock

__all__ = [
    "LoRADownloadError",
    "LoRADownloader",
    "LoRAInfo",
    "LoRAManager",
    "LoRASourceProtocol",
    "OnceLock",
    "adapter_digest",
    "get_lora_manager",
]
