"""Video preprocessing and video prompts equal transformers' Glm5NextVideoProcessor / Glm5NextProcessor.

Synthetic videos are written in the test with PyAV (``av``, PyPI) and decoded with decord.

transformers' video processor imports torchvision, which cannot be installed beside the CPU torch
build this project uses (PyPI's torchvision links CUDA torch). The oracle therefore runs in a
subprocess that imports a real, working torchvision when there is one and otherwise a minimal
stand-in (written below) providing the few tensor ops the Glm5Next video path calls: bicubic
antialiased ``resize`` of uint8 frames (``torch.nn.functional.interpolate``, exactly what
torchvision's tensor kernel calls on CPU), zero ``pad``, ``normalize``, ``grayscale_to_rgb``.
Everything else -- frame sampling, canvas sizing, normalisation constants, patch order, grids,
timestamps and prompt expansion -- is transformers' own code. Our outputs were also checked equal
(max abs diff 0.0) against the real torchvision 0.29.1 with torch 2.14.1 during development.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from glm5.multimodal import MediaCaps, MultiModalProcessor, ProcessorSettings, preprocess_video, sample_frame_indices

TOL = 1e-5

_STANDIN_FILES = {
    "torchvision/__init__.py": '__version__ = "0.0.0+standin"\nfrom . import io, transforms  # noqa: F401\n',
    "torchvision/io.py": "",
    "torchvision/transforms/__init__.py": textwrap.dedent('''
        import enum

        class InterpolationMode(enum.Enum):
            NEAREST = "nearest"
            NEAREST_EXACT = "nearest-exact"
            BILINEAR = "bilinear"
            BICUBIC = "bicubic"
            BOX = "box"
            HAMMING = "hamming"
            LANCZOS = "lanczos"

        from . import functional, v2  # noqa: E402,F401
    '''),
    "torchvision/transforms/functional.py": textwrap.dedent('''
        import numpy as np
        import torch
        from . import InterpolationMode  # noqa: F401

        def pil_to_tensor(pic):
            array = np.array(pic, copy=True)
            if array.ndim == 2:
                array = array[:, :, None]
            return torch.from_numpy(array).permute(2, 0, 1).contiguous()
    '''),
    "torchvision/transforms/v2/__init__.py": "from . import functional  # noqa: F401\n",
    "torchvision/transforms/v2/functional.py": textwrap.dedent('''
        import torch
        from torch.nn.functional import interpolate
        from .. import InterpolationMode
        from ..functional import pil_to_tensor  # noqa: F401

        def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
            # torchvision's tensor kernel for BICUBIC on CPU: uint8 goes to interpolate natively.
            assert interpolation == InterpolationMode.BICUBIC, interpolation
            shape = image.shape
            channels, height, width = shape[-3:]
            new_h, new_w = size
            if (new_h, new_w) == (height, width):
                return image
            flat = image.reshape(-1, channels, height, width)
            out = interpolate(flat, size=[new_h, new_w], mode="bicubic", align_corners=False, antialias=antialias)
            return out.reshape(shape[:-3] + (channels, new_h, new_w))

        def pad(image, padding, fill=0, padding_mode="constant"):
            left, top, right, bottom = padding
            return torch.nn.functional.pad(image, (left, right, top, bottom), value=fill)

        def normalize(tensor, mean, std, inplace=False):
            if not inplace:
                tensor = tensor.clone()
            mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)
            return tensor.sub_(mean).div_(std)

        def grayscale_to_rgb(image):
            return image if image.shape[-3] == 3 else image.repeat_interleave(3, dim=-3)
    '''),
}

_ORACLE = textwrap.dedent('''
    import pickle, sys
    standin, src, dst = sys.argv[1], sys.argv[2], sys.argv[3]
    try:
        import torchvision.transforms.v2.functional  # a real, working torchvision wins
        import torchvision
        resize_impl = "torchvision " + torchvision.__version__
    except Exception:
        for name in [m for m in sys.modules if m.startswith("torchvision")]:
            del sys.modules[name]
        sys.path.insert(0, standin)
        import torchvision
        resize_impl = "stand-in"
    import numpy as np
    from transformers import PreTrainedTokenizerFast
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
    from transformers.video_utils import VideoMetadata

    job = pickle.load(open(src, "rb"))
    def metadata(frames, fps):
        return VideoMetadata(total_num_frames=len(frames), fps=fps, duration=len(frames) / fps, video_backend="decord")
    result = {"resize_impl": resize_impl, "videos": [], "samples": [], "prompts": []}
    video_proc = Glm5NextVideoProcessor(**job["video_kwargs"])
    for frames, fps in job["videos"]:
        out = video_proc(videos=[frames], video_metadata=[metadata(frames, fps)], return_metadata=True,
                         return_tensors="pt")
        result["videos"].append((out["pixel_values_videos"].numpy(), out["video_grid_thw"].numpy(),
                                 np.asarray(out["video_metadata"][0].frames_indices)))
    for total, fps in job["samples"]:
        md = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
        result["samples"].append(np.asarray(video_proc.sample_frames(md)))
    if job.get("checkpoint"):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(job["checkpoint"])
        processor = Glm5NextProcessor(
            image_processor=Glm5NextImageProcessorPil(**job["image_kwargs"]), tokenizer=tokenizer,
            video_processor=Glm5NextVideoProcessor(**job["prompt_video_kwargs"]),
        )
        import io
        from PIL import Image
        for text, images, videos in job["prompts"]:
            kwargs = {}
            if images:
                kwargs["images"] = [Image.open(io.BytesIO(b)) for b in images]
            if videos:
                kwargs["videos"] = [f for f, _ in videos]
                kwargs["video_metadata"] = [metadata(f, fps) for f, fps in videos]
            out = processor(text=[text], return_tensors="np", **kwargs)
            result["prompts"].append({k: np.asarray(out[k]) for k in out if k != "video_metadata"})
    pickle.dump(result, open(dst, "wb"))
''')


def run_hf_oracle(workdir: Path, job: dict) -> dict:
    """Run transformers' Glm5Next processors on ``job`` in a subprocess (see module docstring)."""
    standin = workdir / "tv_standin"
    for rel, text in _STANDIN_FILES.items():
        path = standin / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    script = workdir / "hf_oracle.py"
    script.write_text(_ORACLE)
    src, dst = workdir / "job.pkl", workdir / "result.pkl"
    src.write_bytes(pickle.dumps(job))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(script), str(standin), str(src), str(dst)], capture_output=True, text=True, errors="replace",
        timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return pickle.loads(dst.read_bytes())


def make_video(fps: float, num_frames: int, width: int, height: int, *, fmt: str = "mp4",
               codec: str = "libx264", seed: int = 0) -> bytes:
    """A synthetic clip (moving textured pattern) encoded in memory with PyAV."""
    import av
    from fractions import Fraction

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * 5) % 256, (yy * 3) % 256, ((xx + yy) * 2) % 256], axis=-1).astype(np.int32)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = np.clip(np.roll(base, 2 * i, axis=1) + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def decode_all(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame and the average fps, as transformers' decord loader reports them."""
    import decord

    reader = decord.VideoReader(io.BytesIO(data), ctx=decord.cpu(0))
    return reader.get_batch(list(range(len(reader)))).asnumpy(), float(reader.get_avg_fps())


# (fps, frames, width, height, container, codec)
VIDEOS = [
    (10, 25, 64, 48, "mp4", "libx264"),        # 2.5 s: walk keeps frames, odd count padded
    (30, 95, 90, 40, "matroska", "libx264"),   # wide, 3.2 s
    (3, 20, 40, 72, "avi", "mpeg4"),           # slower than 2 fps: every frame kept
    (24, 13, 320, 240, "mp4", "libx264"),      # 0.54 s: a single sampled frame, repeated
    (1, 9, 36, 28, "mp4", "libx264"),          # 1 fps source, fewer frames than wanted -> linspace
    (25, 60, 1280, 720, "mp4", "libx264"),     # 720p: resized down to the budget
    (29.97, 40, 100, 60, "webm", "libvpx-vp9"), # NTSC rate, VP9
]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, tiny_checkpoint_dir) -> dict:
    work = tmp_path_factory.mktemp("video_oracle")
    clips = [make_video(fps, n, w, h, fmt=fmt, codec=codec, seed=i)
             for i, (fps, n, w, h, fmt, codec) in enumerate(VIDEOS)]
    decoded = [decode_all(c) for c in clips]
    tiny = ProcessorSettings.from_checkpoint(tiny_checkpoint_dir)
    prompt_clip = make_video(10, 31, 70, 50, seed=99)
    from PIL import Image

    image_buf = io.BytesIO()
    Image.fromarray(np.full((30, 50, 3), 120, np.uint8)).save(image_buf, "PNG")
    prompt_image = image_buf.getvalue()
    image_buf = io.BytesIO()
    Image.fromarray(np.arange(90 * 40 * 3, dtype=np.uint8).reshape(90, 40, 3)).save(image_buf, "JPEG")
    second_image = image_buf.getvalue()
    prompts = [
        ("[gMASK]<sop><|user|>\nCompare <|begin_of_image|><|image|><|end_of_image|> with "
         "<|begin_of_image|><|image|><|end_of_image|>.<|assistant|>", [prompt_image, second_image], []),
        ("[gMASK]<sop><|user|>\n<|begin_of_video|><|video|><|end_of_video|>What happens?<|assistant|>",
         [], [prompt_clip]),
        ("[gMASK]<sop><|user|>\nA<|begin_of_image|><|image|><|end_of_image|>B"
         "<|begin_of_video|><|video|><|end_of_video|> 1 2<|assistant|>", [prompt_image], [prompt_clip]),
    ]
    job = {
        "video_kwargs": {},
        "videos": decoded,
        "samples": SAMPLE_GRID,
        "checkpoint": str(tiny_checkpoint_dir),
        "image_kwargs": {"min_image_tokens": tiny.image_min_tokens, "max_image_tokens": tiny.image_max_tokens},
        "prompt_video_kwargs": {"min_image_tokens": tiny.video_min_tokens, "max_image_tokens": tiny.video_max_tokens,
                                "max_frames": tiny.video_max_frames, "fps": tiny.video_fps},
        "prompts": [(text, images, [decode_all(v) for v in videos]) for text, images, videos in prompts],
    }
    result = run_hf_oracle(work, job)
    result["clips"] = clips
    result["prompt_inputs"] = prompts
    return result


# (total frames, fps): short, long, fractional rates, fewer frames than 2 fps wants, huge counts.
SAMPLE_GRID = [
    (1, 1.0), (2, 1.0), (5, 10.0), (13, 24.0), (25, 10.0), (100, 29.97), (301, 30.0), (7, 0.5),
    (48, 23.976), (1000, 60.0), (12345, 25.0), (250_000, 59.94), (90_000, 5.0), (4097, 1.0), (3, 2.0),
]


@pytest.mark.parametrize("index", range(len(VIDEOS)))
def test_video_matches_transformers(oracle, index: int) -> None:
    ours = preprocess_video(oracle["clips"][index], MediaCaps())
    ref_pixels, ref_grid, ref_indices = oracle["videos"][index]
    assert ours.frame_indices.tolist() == ref_indices.tolist()
    assert ours.video_grid_thw.tolist() == ref_grid.tolist()
    assert ours.pixel_values_videos.shape == ref_pixels.shape
    assert float(np.abs(ours.pixel_values_videos - ref_pixels).max()) <= TOL, oracle["resize_impl"]
    grid_t, grid_h, grid_w = ours.video_grid_thw[0]
    assert ours.num_tokens == grid_t * grid_h * grid_w // 4
    assert len(ours.timestamps) == grid_t
    assert ours.timestamps == [i / ours.metadata.fps for i in ref_indices[::2]]


def test_frame_sampling_matches_transformers(oracle) -> None:
    settings = ProcessorSettings()
    for (total, fps), ref in zip(SAMPLE_GRID, oracle["samples"]):
        ours = sample_frame_indices(total, fps, target_fps=settings.video_fps, max_frames=settings.video_max_frames)
        assert ours.tolist() == ref.tolist(), (total, fps)
        assert len(ours) % 2 == 0


def test_prompt_ids_match_transformers(oracle, tiny_checkpoint_dir) -> None:
    """Image-only, video-only and mixed prompts: ids, type ids and tensors equal Glm5NextProcessor's."""
    processor = MultiModalProcessor.from_checkpoint(tiny_checkpoint_dir)
    for (text, images, videos), ref in zip(oracle["prompt_inputs"], oracle["prompts"]):
        ours = processor.process(text, images=images, videos=videos)
        assert ours.token_ids == ref["input_ids"][0].tolist()
        assert ours.mm_token_type_ids.tolist() == ref["mm_token_type_ids"][0].tolist()
        if videos:
            assert ours.video_grid_thw.tolist() == ref["video_grid_thw"].tolist()
            assert float(np.abs(ours.pixel_values_videos - ref["pixel_values_videos"]).max()) <= TOL
        if images:
            assert ours.image_grid_thw.tolist() == ref["image_grid_thw"].tolist()
            assert float(np.abs(ours.pixel_values - ref["pixel_values"]).max()) <= TOL
        # The id-space path (prompt already tokenized) gives the same ids.
        ids = processor.encode(text)
        assert processor.process(ids, images=images, videos=videos).token_ids == ours.token_ids


def test_prompt_structure_has_timestamped_frame_blocks(tiny_checkpoint_dir) -> None:
    processor = MultiModalProcessor.from_checkpoint(tiny_checkpoint_dir)
    clip = make_video(4, 18, 60, 40, seed=5)  # 4.5 s at 4 fps -> 9 frames sampled -> padded to 10 -> 5 slices
    out = processor.process("<|begin_of_video|><|video|><|end_of_video|>", videos=[clip])
    tokens = processor.tokens
    grid_t, grid_h, grid_w = out.video_grid_thw[0]
    per_slice = grid_h * grid_w // 4
    assert grid_t == 5
    ids = out.token_ids
    assert ids[0] == tokens.begin_of_video and ids[-1] == tokens.end_of_video
    assert ids.count(tokens.begin_of_image) == grid_t == ids.count(tokens.end_of_image)
    assert ids.count(tokens.image) == grid_t * per_slice
    text = processor.tokenizer.decode(ids, skip_special_tokens=False)
    seconds = out.video_timestamps[0]
    assert seconds == [int(i) / 4 for i in out.video_frame_indices[0][::2]]
    assert seconds[0] == 0.0 and all(a < b for a, b in zip(seconds, seconds[1:]))
    pos = 0
    for t in seconds:  # each slice's label follows its frame block, in order
        pos = text.index(f"<|end_of_image|>{t:.1f} seconds", pos) + 1
    assert set(out.mm_token_type_ids.tolist()) == {0, 2}


def test_long_video_is_subsampled_to_the_frame_cap() -> None:
    clip = make_video(8, 96, 64, 48, seed=7)  # 12 s -> 24 frames wanted at 2 fps
    out = preprocess_video(clip, MediaCaps(max_video_frames=10))
    assert len(out.frame_indices) == 10
    assert out.frame_indices[0] == 0 and out.frame_indices[-1] == 95  # spread over the whole clip
    assert out.video_grid_thw[0, 0] == 5


def test_video_token_budget_shrinks_the_canvas() -> None:
    clip = make_video(10, 40, 320, 240, seed=8)  # 4 s -> 8 frames -> 4 slices
    full = preprocess_video(clip, MediaCaps())
    small = preprocess_video(clip, MediaCaps(max_visual_tokens=64))
    assert full.num_tokens > 64 >= small.num_tokens
    assert small.video_grid_thw[0, 0] == full.video_grid_thw[0, 0] == 4
