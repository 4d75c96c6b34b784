"""gRPC/HTTP client for the glm5 Triton model."""
