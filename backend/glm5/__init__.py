"""GLM-5.3-Flash (glm5_next) inference engine: config, weights, model, cache, scheduler, serving glue."""

__version__ = "0.1.0"


def generate(*args, **kwargs):
    """Offline generation; see :func:`glm5.entrypoints.generate.generate`."""
    from glm5.entrypoints.generate import generate as _generate

    return _generate(*args, **kwargs)
