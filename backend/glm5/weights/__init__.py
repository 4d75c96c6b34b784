"""Checkpoint weights: canonical names/shapes, the safetensors loader, dummy weights, writer.

See :mod:`glm5.weights.names` for the canonical naming (the contract with the model code) and
:mod:`glm5.weights.loader` for what a checkpoint may look like.
"""

from glm5.weights.dummy import dummy_weights
from glm5.weights.fp8 import quantize_weights, weight_bytes
from glm5.weights.loader import (
    QUANTIZATION_MODES,
    CheckpointError,
    check_checkpoint,
    dequantize_fp8_blockwise,
    fp8_scale_shape,
    load_weights,
)
from glm5.weights.names import (
    FP32_WEIGHT_SUFFIXES,
    SCALE_SUFFIX,
    abbreviate_names,
    can_stay_fp8,
    checkpoint_key_targets,
    expected_weight_shapes,
    is_fp8_linear_weight,
    is_fp32_weight,
    is_mtp_name,
    mtp_weight_shapes,
)
from glm5.weights.save import save_weights

#: Alias kept for readability at call sites: ``FP32_WEIGHTS(name)`` is True for the fp32 set.
FP32_WEIGHTS = is_fp32_weight

__all__ = [
    "FP32_WEIGHTS",
    "FP32_WEIGHT_SUFFIXES",
    "QUANTIZATION_MODES",
    "SCALE_SUFFIX",
    "CheckpointError",
    "abbreviate_names",
    "can_stay_fp8",
    "check_checkpoint",
    "checkpoint_key_targets",
    "dequantize_fp8_blockwise",
    "dummy_weights",
    "expected_weight_shapes",
    "fp8_scale_shape",
    "is_fp8_linear_weight",
    "is_fp32_weight",
    "is_mtp_name",
    "load_weights",
    "mtp_weight_shapes",
    "quantize_weights",
    "save_weights",
    "weight_bytes",
]
