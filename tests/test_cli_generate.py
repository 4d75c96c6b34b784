"""Chat rendering, chat requests through the engine, the ``glm5 generate`` CLI and ``glm5.generate``."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

import glm5
from glm5 import cli
from glm5.engine import LLMEngine, PromptInput
from glm5.sampling_params import SamplingParams
from glm5.tokenizer import load_tokenizer, render_chat

sys.path.insert(0, str(Path(__file__).parent))
from oracle import engine  # noqa: E402

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-cache-blocks", "64"]


def run_cli(ckpt: Path, *args: str, capsys) -> str:
    assert cli.main(["--log-level", "WARNING", "generate", "--model", str(ckpt), *ENGINE_FLAGS, *args]) == 0
    return capsys.readouterr().out


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_render_chat_roles_and_media_parts(tiny_checkpoint_dir: Path) -> None:
    tok = load_tokenizer(tiny_checkpoint_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"},
                                     {"type": "video"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "And now?"},
    ]
    text = render_chat(tok, messages)
    assert text == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\n<|begin_of_image|><|image|><|end_of_image|>"
                    "What is this?<|begin_of_video|><|video|><|end_of_video|><|assistant|>\nA cat.<|user|>\n"
                    "And now?<|assistant|>\n")
    # OpenAI-style parts map to the same prompt; no generation prompt when asked
    openai = [messages[0], {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}, {"type": "input_text", "text": "What is this?"},
        {"type": "video_url", "video_url": {"url": "data:,"}}]}, *messages[2:]]
    assert render_chat(tok, openai) == text
    assert render_chat(tok, messages, add_generation_prompt=False) == text[: -len("<|assistant|>\n")]
    # special tokens are single ids in the rendered prompt
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<|image|>")) == 1
    with pytest.raises(ValueError, match="role"):
        render_chat(tok, [{"role": "robot", "content": "hi"}])
    with pytest.raises(ValueError, match="type"):
        render_chat(tok, [{"role": "user", "content": [{"type": "audio"}]}])


def test_chat_request_runs_through_engine(tiny_checkpoint_dir: Path) -> None:
    eng = engine(tiny_checkpoint_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, café 😀"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    chat = eng.generate([PromptInput(messages=messages)], params)[0]
    ids = eng.tokenizer.encode(render_chat(eng.tokenizer, messages), add_special_tokens=False)
    assert chat.prompt_token_ids == ids
    assert chat.token_ids == eng.generate([ids], params)[0].token_ids
    assert len(chat.token_ids) == 6

    # a chat with an image part: the placeholder is expanded to the image's merged patches
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 90)).save(buf, format="PNG")
    img_msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    out = eng.generate([PromptInput(messages=img_msgs, images=[buf.getvalue()])], params)[0]
    image_id = eng.tokenizer.convert_tokens_to_ids("<|image|>")
    assert out.prompt_token_ids.count(image_id) > 1 and len(out.token_ids) == 6
    assert eng.stats().vision_calls == 1


def test_cli_chat_json_matches_engine(tiny_checkpoint_dir: Path, capsys) -> None:
    ckpt = tiny_checkpoint_dir
    out = last_json(run_cli(ckpt, "Hi there", "--chat", "--system", "Be brief.", "--temperature", "0",
                            "--max-tokens", "5", "--ignore-eos", "--json", capsys=capsys))
    eng = engine(ckpt)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = eng.tokenizer.encode(render_chat(eng.tokenizer, msgs), add_special_tokens=False)
    ref = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert out["num_prompt_tokens"] == len(ids)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text
    assert out["finish_reason"] == "length" and out["num_output_tokens"] == 5
    assert out["ttft_s"] is not None and out["output_tokens_per_s"] > 0


def test_cli_stream_prints_text_as_it_arrives(tiny_checkpoint_dir: Path, monkeypatch, capsys) -> None:
    ckpt = tiny_checkpoint_dir
    events: list[tuple[str, str]] = []

    class Recorder(io.StringIO):
        def write(self, s: str) -> int:
            events.append(("write", s))
            return super().write(s)

    real_step = LLMEngine.step

    def step(self):
        events.append(("step", ""))
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    monkeypatch.setattr(sys, "stdout", Recorder())
    assert cli.main(["--log-level", "WARNING", "generate", "--model", str(ckpt), *ENGINE_FLAGS, "Café naïve",
                     "--temperature", "0", "--max-tokens", "10", "--ignore-eos", "--stream"]) == 0
    monkeypatch.undo()
    streamed = "".join(s for kind, s in events if kind == "write")
    ref = engine(ckpt).generate(["Café naïve"], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    assert streamed == ref.text + "\n"
    kinds = [k for k, s in events if k == "step" or s]
    last_step = max(i for i, k in enumerate(kinds) if k == "step")
    writes_before_last_step = [i for i, k in enumerate(kinds) if k == "write" and i < last_step]
    assert len(writes_before_last_step) >= 2, "text was not printed while generation was still running"


def test_cli_prompts_file_and_sampling_flags(tiny_checkpoint_dir: Path, tmp_path: Path, capsys) -> None:
    ckpt = tiny_checkpoint_dir
    f = tmp_path / "prompts.txt"
    f.write_text("The quick brown fox\n\n"
                 + json.dumps({"prompt_ids": [5, 6, 7, 8]}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "日本語"}]}) + "\n"
                 + json.dumps({"prompt": "def main():"}) + "\n", encoding="utf-8")
    flags = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "30", "--min-p", "0.01", "--seed", "11",
             "--max-tokens", "6", "--min-tokens", "2", "--repetition-penalty", "1.1", "--logprobs", "2"]
    out = last_json(run_cli(ckpt, "--prompts-file", str(f), "--json", *flags, capsys=capsys))
    assert len(out["outputs"]) == 4
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=30, min_p=0.01, seed=11, max_tokens=6, min_tokens=2,
                            repetition_penalty=1.1, logprobs=2)
    prompts = [PromptInput(text="The quick brown fox"), PromptInput(token_ids=[5, 6, 7, 8]),
               PromptInput(messages=[{"role": "user", "content": "日本語"}]), PromptInput(text="def main():")]
    eng = engine(ckpt)
    for got, prompt in zip(out["outputs"], prompts):
        ref = eng.generate([prompt], params)[0]  # seeded: the same tokens alone as in the CLI's batch
        assert got["token_ids"] == ref.token_ids and got["text"] == ref.text
        assert 2 <= len(got["token_ids"]) <= 6
        assert len(got["logprobs"]) == len(got["token_ids"])
        assert all(len(lp["top"]) == 2 and lp["token_id"] == t for lp, t in zip(got["logprobs"], got["token_ids"]))
    # without --json: one line per prompt (text, or the ids when a request produced no text)
    plain = run_cli(ckpt, "--prompts-file", str(f), *flags, capsys=capsys)
    assert len(plain.rstrip("\n").split("\n")) >= 4


def test_cli_stop_flag(tiny_checkpoint_dir: Path, capsys) -> None:
    ckpt = tiny_checkpoint_dir
    full = last_json(run_cli(ckpt, "--prompt-ids", "5,6,7,8", "--temperature", "0", "--max-tokens", "12",
                             "--ignore-eos", "--json", capsys=capsys))
    text = full["text"]
    stop = next((text[i:i + 2] for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2]
                 and text.find(text[i:i + 2]) == i), None)
    assert stop is not None, f"no usable stop string in {text!r}"
    out = last_json(run_cli(ckpt, "--prompt-ids", "5,6,7,8", "--temperature", "0", "--max-tokens", "12",
                            "--ignore-eos", "--stop", stop, "--json", capsys=capsys))
    assert out["text"] == text[: text.find(stop)] and out["finish_reason"] == "stop"


def test_generate_api(tiny_checkpoint_dir: Path) -> None:
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True)
    outs = glm5.generate(["Hello", [5, 6, 7]], params, model=str(tiny_checkpoint_dir), device="cpu",
                         dtype="float32", block_size=16, num_cache_blocks=32, load_progress=False)
    eng = engine(tiny_checkpoint_dir)
    assert [o.token_ids for o in outs] == [eng.generate([p], params)[0].token_ids for p in ("Hello", [5, 6, 7])]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 5 for o in outs)
    assert outs[1].prompt_token_ids == [5, 6, 7]
