"""GLM-5.3-Flash (glm5_next) inference engine: config, weights, model, cache, scheduler, serving glue."""

__version__ = "0.1.0"
