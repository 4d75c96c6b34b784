"""gRPC/HTTP client for the glm5 Triton model: sync + asyncio API, CLI and load client."""

from .client import (AsyncGlm5Client, GenerateRequest, GenerationChunk, GenerationResult, Glm5Client,
                     Glm5ClientError, collect)

__all__ = ["AsyncGlm5Client", "GenerateRequest", "GenerationChunk", "GenerationResult", "Glm5Client",
           "Glm5ClientError", "collect"]
