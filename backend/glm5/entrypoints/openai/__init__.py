"""OpenAI-compatible API (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) served by an
ASGI app that forwards every request to the Triton ``glm5`` model over gRPC streaming; GLM tool-call
and reasoning parsers. Start it with ``glm5 serve --openai-port PORT``."""
