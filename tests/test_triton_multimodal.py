"""End-to-end multimodal serving: the ``glm5_multimodal`` ensemble (preprocess -> glm5) and the glm5
model called directly with raw image/video bytes must give the same outputs; bad media get
specific errors. One real tritonserver (all three models) for the module."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from base64 import b64encode
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from glm5.serving.launcher import TritonServerProcess
from glm5_client import Glm5Client, Glm5ClientError

# MTP speculative decoding on: the multimodal paths must give the same greedy text with it, and its
# acceptance metrics must reach the metrics endpoint.
ENGINE_SETTINGS = {"cache_memory_gb": "0.05", "max_num_seqs": "8", "max_model_len": "2048",
                   "num_speculative_tokens": "2"}
# Tighter than the default (16): one setting must bind on the ensemble path (preprocess) and the
# direct path (glm5) alike. The other tests send at most two images.
MEDIA_CAPS = '{"max_images": 2}'
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_checkpoint_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("triton_mm") / "server.log"
    with TritonServerProcess(model_dir=str(tiny_checkpoint_dir), log_file=log, engine_overrides=ENGINE_SETTINGS,
                             media_caps=MEDIA_CAPS, ready_timeout_s=240) as srv:
        yield srv


def png_bytes(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(num_frames: int = 8, width: int = 64, height: int = 48, fps: int = 4) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        yy, xx = np.mgrid[0:height, 0:width]
        for i in range(num_frames):
            frame = np.stack([(xx * 4 + i * 8) % 256, (yy * 5) % 256, ((xx + yy + i) * 3) % 256], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def chat(text: str, n_images: int = 0, n_videos: int = 0) -> list[dict]:
    parts = [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def run(server, model: str, **kwargs) -> tuple[str, int]:
    with Glm5Client(server.grpc_url, model=model) as c:
        chunks = list(c.generate_stream(sampling=GREEDY, exclude_input_in_output=True, **kwargs))
    assert chunks and chunks[-1].final
    return "".join(ch.text for ch in chunks), sum(ch.num_output_tokens or 0 for ch in chunks)


def test_image_through_ensemble_equals_direct_model(server):
    imgs = [png_bytes(56, 84, 0), png_bytes(64, 64, 1)]
    msgs = chat("Describe both pictures.", n_images=2)
    direct = run(server, "glm5", messages=msgs, images=imgs)
    via_ensemble = run(server, "glm5_multimodal", messages=msgs, images=imgs)
    assert direct == via_ensemble
    assert direct[1] == GREEDY["max_tokens"]
    # The image matters: a different picture changes the engine input (and, for this random
    # model, the prompt length through its grid), so the answer is not just the text's.
    other = run(server, "glm5", messages=msgs, images=[png_bytes(56, 84, 7), imgs[1]])
    text_only = run(server, "glm5", messages=chat("Describe both pictures."))
    assert direct != text_only
    assert other[1] == GREEDY["max_tokens"]


def test_raw_prompt_with_placeholders_and_image(server):
    """Raw text prompts carry the placeholder themselves; ensemble and direct agree."""
    prompt = "[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>What is it?<|assistant|>\n"
    img = [png_bytes(48, 48, 3)]
    assert run(server, "glm5", prompt=prompt, images=img) == run(server, "glm5_multimodal", prompt=prompt, images=img)


def test_video_through_ensemble_equals_direct_model(server):
    vid = [mp4_bytes()]
    msgs = chat("What happens in the clip?", n_videos=1)
    direct = run(server, "glm5", messages=msgs, videos=vid)
    assert direct == run(server, "glm5_multimodal", messages=msgs, videos=vid)
    assert direct[1] == GREEDY["max_tokens"]


def test_image_base64_over_http_generate(server):
    """HTTP clients send base64 in `image`; the answer equals the gRPC raw-bytes answer."""
    img = png_bytes(56, 56, 5)
    msgs = chat("Look.", n_images=1)
    grpc_text, _ = run(server, "glm5", messages=msgs, images=[img])
    body = {"text_input": "", "messages": json.dumps(msgs), "image": [b64encode(img).decode()],
            "exclude_input_in_output": True, "parameters": GREEDY}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/glm5/generate", method="POST",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 (loopback test server)
        assert json.loads(r.read())["text_output"] == grpc_text


@pytest.mark.parametrize("model", ["glm5", "glm5_multimodal"])
def test_corrupt_image_is_rejected_and_server_keeps_serving(server, model):
    bad = b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 20
    with Glm5Client(server.grpc_url, model=model) as c:
        with pytest.raises(Glm5ClientError, match="(?i)image"):
            c.generate(messages=chat("?", n_images=1), images=[bad], sampling=GREEDY)
    assert run(server, model, messages=chat("fine now", n_images=1), images=[png_bytes(32, 32, 9)])[1] == 6


def test_placeholder_count_mismatch_is_rejected(server):
    with Glm5Client(server.grpc_url) as c, pytest.raises(Glm5ClientError, match="(?i)placeholder|image"):
        c.generate("no placeholder here", images=[png_bytes(32, 32, 2)], sampling=GREEDY)


def test_corrupt_image_over_http_is_400(server):
    body = {"text_input": "", "messages": json.dumps(chat("?", n_images=1)),
            "image": [b64encode(b"\xff\xd8\xff\xe0 not a jpeg").decode()], "parameters": GREEDY}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/glm5/generate", method="POST",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)  # noqa: S310
    assert info.value.code == 400


def test_stop_request_stops_a_request_running_in_the_ensemble(server):
    """Client cancellation does not reach a running ensemble step on Triton 2.51; a `stop` request
    to glm5 with the same request id and stop_key does (the ensemble passes its request id and the
    stop_key input to the glm5 step)."""
    import threading
    import time

    box: dict = {}

    def long_request() -> None:
        with Glm5Client(server.grpc_url, model="glm5_multimodal") as c:
            box["result"] = c.generate("a long story", request_id="ens-job-1", stop_key="ens-secret-0123456789",
                                       sampling={"max_tokens": 400, "temperature": 0, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.5)           # preprocess + a few decode steps
    with Glm5Client(server.grpc_url, model="glm5") as c:
        assert c.stop("ens-job-1", "ens-secret-0123456789")
    t.join(60)
    assert not t.is_alive()
    res = box["result"]
    assert res.finish_reason == "abort"
    assert 0 < (res.num_output_tokens or 0) < 400


def test_speculative_decoding_metrics_are_exported(server):
    import re
    import time

    run(server, "glm5", messages=chat("count to ten"))
    deadline = time.time() + 20
    while True:
        text = server.metrics_text()
        drafts = re.search(r'^glm5:spec_decode_num_draft_tokens_total\{[^}]*\} (\S+)', text, re.M)
        rates = re.findall(r'^glm5:spec_decode_acceptance_rate\{[^}]*position="(\d)"[^}]*\} (\S+)', text, re.M)
        if drafts and float(drafts.group(1)) > 0 and len(rates) == 2:
            break
        assert time.time() < deadline, "speculative metrics never appeared:\n" + text[-2000:]
        time.sleep(0.5)
    assert sorted(p for p, _ in rates) == ["0", "1"]
    assert all(0.0 <= float(v) <= 1.0 for _, v in rates)
    assert re.search(r'^glm5:spec_decode_mean_accepted_length\{[^}]*\} (\S+)', text, re.M)


def test_non_streaming_output_prepends_text_input_on_both_paths(server, tmp_path):
    """vllm_backend's rule: without streaming the prompt (``text_input``) is prepended; a chat request
    with an image must read the same through the direct model and through the ensemble."""
    image = png_bytes(60, 40, seed=5)
    texts = []
    for model in ("glm5", "glm5_multimodal"):
        with Glm5Client(server.grpc_url, model=model) as c:
            chunks = list(c.generate_stream("Describe it.", messages=chat("Describe it.", n_images=1),
                                            images=[image], sampling=GREEDY, stream=False))
        assert len(chunks) == 1 and chunks[0].final
        texts.append(chunks[0].text)
    assert texts[0] == texts[1]
    assert texts[0].startswith("Describe it.") and len(texts[0]) > len("Describe it.")


@pytest.mark.parametrize("model", ["glm5_multimodal", "glm5"])
def test_one_media_caps_setting_binds_on_the_ensemble_and_the_direct_path(server, model):
    """``media_caps`` reaches preprocess too: three images break max_images=2 on both paths."""
    imgs = [png_bytes(32, 32, i) for i in range(3)]
    with Glm5Client(server.grpc_url, model=model) as c:
        with pytest.raises(Glm5ClientError, match="max_images"):
            c.generate(messages=chat("Three?", n_images=3), images=imgs, sampling=GREEDY)
    assert run(server, model, messages=chat("Two.", n_images=2), images=imgs[:2])[1] == GREEDY["max_tokens"]

