"""GLM-5.3-Flash (glm5_next) inference engine: config, weights, model, cache, scheduler, serving glue.

Offline use, vLLM style: ``from glm5 import LLM, SamplingParams`` (:mod:`glm5.entrypoints.llm`).
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "generate"]


def generate(*args, **kwargs):
    """Offline generation; see :func:`glm5.entrypoints.generate.generate`."""
    from glm5.entrypoints.generate import generate as _generate

    return _generate(*args, **kwargs)


def __getattr__(name: str):
    # imported on first use, so that ``import glm5`` (CLI start-up, the Triton stub) stays light
    if name == "LLM":
        from glm5.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from glm5.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'glm5' has no attribute {name!r}")
