"""``preprocess``: multimodal preprocessing step of the ``glm5_multimodal`` ensemble.

Turns (prompt text or chat messages, encoded image files, encoded video files) into the prompt
token ids with expanded vision placeholders and the patchified pixel tensors, using
``glm5.multimodal`` (the same code the glm5 model runs in-process for raw bytes), so that the
ensemble and the direct path produce identical engine inputs. Media caps (pixels, frames, bytes)
come from the ``media_caps`` parameter; a violated cap or undecodable file is an ``INVALID_ARG``
error naming the item.

Outputs are always produced (shape ``[0, ...]`` when a modality is unused) because the next step
maps all of them.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys

# A launcher that gives up on a stalled load sends SIGUSR1 for every thread's stack
# (glm5.serving.server_diagnosis); registered before the imports below so a stall inside them shows too.
try:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
except (AttributeError, ValueError, OSError, RuntimeError):  # no usable stderr: no stacks, still load
    pass


def _extend_sys_path(value: str | None) -> None:
    for entry in reversed([p for p in (value or "").split(os.pathsep) if p]):
        if entry in sys.path:
            sys.path.remove(entry)
        sys.path.insert(0, entry)


_extend_sys_path(os.environ.get("GLM5_PYTHON_PATH"))

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


class TritonPythonModel:
    """Stateless preprocessing; one response per request."""

    def initialize(self, args: dict[str, str]) -> None:
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
        _extend_sys_path(params.get("python_path"))
        from glm5.serving.stub_logging import stacks_if_slow

        with stacks_if_slow():  # a load that never finishes leaves its stacks in the server log
            self._initialize(params)

    def _initialize(self, params: dict[str, str]) -> None:
        from glm5.multimodal import MediaCaps, MediaError, MultiModalProcessor
        from glm5.serving import request as rq

        model_dir = params.get("model") or ""
        if not model_dir:
            raise pb_utils.TritonModelException(
                "preprocess needs parameters { key: \"model\" value: { string_value: \"/path/to/checkpoint\" } }")
        from glm5.tokenizer import load_tokenizer, render_chat

        # The same setting and parser as the glm5 model (glm5 serve writes one value into both).
        caps = MediaCaps.from_json(params.get("media_caps"))
        self._rq = rq
        self._render_chat = render_chat
        self._bad = (rq.RequestError, MediaError, ValueError)
        # Same tokenizer and processor (and the same calls) as the engine's in-process path, so
        # the ensemble and the direct glm5 model feed identical token ids and pixels to the model.
        self.tokenizer = load_tokenizer(model_dir)
        self.processor = MultiModalProcessor.from_checkpoint(model_dir, caps=caps, tokenizer=self.tokenizer)

    def _media(self, request: object, name: str) -> list[bytes]:
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is None:
            return []
        return [self._rq.decode_media_item(b, name=name, index=i) for i, b in enumerate(t.as_numpy().reshape(-1))]

    def _one(self, request: object) -> object:
        rq = self._rq
        t = pb_utils.get_input_tensor_by_name(request, "text_input")
        text = t.as_numpy().reshape(-1)[0].decode("utf-8", errors="replace") if t is not None else ""
        m = pb_utils.get_input_tensor_by_name(request, "messages")
        messages = rq.parse_messages(m.as_numpy().reshape(-1)[0]) if m is not None else None
        images, videos = self._media(request, "image"), self._media(request, "video")
        if messages is not None:
            text = self._render_chat(self.tokenizer, messages)
        elif not text:
            raise rq.RequestError("text_input is empty; send a prompt (or messages)")
        if images or videos:
            out = self.processor.process(text, images=images, videos=videos)
            tensors = {
                "input_ids": np.asarray(out.token_ids, dtype=np.int64).reshape(-1),
                "pixel_values": _as(out.pixel_values, np.float32, 2),
                "image_grid_thw": _as(out.image_grid_thw, np.int64, 2, width=3),
                "pixel_values_videos": _as(out.pixel_values_videos, np.float32, 2),
                "video_grid_thw": _as(out.video_grid_thw, np.int64, 2, width=3),
            }
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            tensors = {"input_ids": np.asarray(ids, dtype=np.int64).reshape(-1),
                       "pixel_values": _as(None, np.float32, 2), "image_grid_thw": _as(None, np.int64, 2, 3),
                       "pixel_values_videos": _as(None, np.float32, 2), "video_grid_thw": _as(None, np.int64, 2, 3)}
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except self._bad as exc:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
            except Exception as exc:  # noqa: BLE001 (one bad request must not stop the model)
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"preprocess failed: {type(exc).__name__}: {exc}",
                                               pb_utils.TritonError.INTERNAL)))
        return responses


def _as(x: object, dtype: type, ndim: int, width: int | None = None) -> np.ndarray:
    """A contiguous array of ``dtype``; ``None`` becomes an empty ``[0, width or 0]`` array."""
    if x is None:
        return np.zeros((0, width or 0), dtype=dtype)
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy() if dtype == np.float32 else x.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(x, dtype=dtype))
    if arr.ndim != ndim:
        arr = arr.reshape(-1, width) if width else arr.reshape(arr.shape[0], -1)
    return arr
