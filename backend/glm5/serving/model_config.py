"""Read, edit and write Triton ``config.pbtxt`` files as ``ModelConfig`` protobuf messages.

The runtime model repository that ``glm5 serve`` writes is the shipped one with a few
``parameters`` filled in (checkpoint path, ``python_path``, engine settings, media caps). Editing
the text with regular expressions breaks on any layout the pattern did not foresee (a parameter
written on several lines, a key inside a comment, escaped quotes); parsing the file with
protobuf's ``text_format`` into Triton's own ``ModelConfig`` message (shipped with
``tritonclient``) and serialising it back cannot, and rejects a malformed file with the line and
column of the problem.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

ModelConfig = model_config_pb2.ModelConfig

#: Backends whose models run our Python code and so need ``python_path``.
PYTHON_BACKENDS = frozenset({"glm5", "python"})


class ModelConfigError(ValueError):
    """A config.pbtxt does not parse; the message names the file and the position."""


def parse_config(text: str, *, source: str = "config.pbtxt") -> ModelConfig:
    """Parse config.pbtxt text into a ``ModelConfig`` message."""
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        raise ModelConfigError(f"{source}: {exc}; fix the file (protobuf text format of Triton's "
                               "ModelConfig)") from exc


def read_config(path: Path) -> ModelConfig:
    return parse_config(Path(path).read_text(), source=str(path))


def format_config(config: ModelConfig) -> str:
    """Serialise back to protobuf text format (what tritonserver reads)."""
    return text_format.MessageToString(config)


def write_config(config: ModelConfig, path: Path) -> None:
    Path(path).write_text(format_config(config))


def get_parameter(config: ModelConfig, key: str) -> str | None:
    """A ``parameters`` entry's ``string_value``, or None when the key is absent."""
    if key not in config.parameters:
        return None
    return config.parameters[key].string_value


def set_parameter(config: ModelConfig, key: str, value: str) -> None:
    """Set (or add) ``parameters { key: KEY value: { string_value: VALUE } }``."""
    config.parameters[key].string_value = str(value)


def runs_python(config: ModelConfig) -> bool:
    """True for models served by our Python code (the glm5 backend or a Python model)."""
    return config.backend in PYTHON_BACKENDS
