"""The engine: scheduler, model runner, synchronous and threaded front ends."""

from glm5.engine.args import EngineArgs
from glm5.engine.async_engine import AsyncLLMEngine, RequestStream
from glm5.engine.errors import EngineDeadError, RequestFailedError
from glm5.engine.llm_engine import LLMEngine
from glm5.engine.outputs import CompletionOutput, EngineStats, PromptInput, RequestOutput

__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineArgs", "EngineDeadError", "EngineStats", "LLMEngine",
           "PromptInput", "RequestFailedError", "RequestOutput", "RequestStream"]
