"""The vLLM-style offline API (``from glm5 import LLM, SamplingParams``) on the tiny checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from glm5 import LLM, SamplingParams
from glm5.engine import EngineArgs, LLMEngine

ARGS = dict(device="cpu", dtype="float32", block_size=16, num_cache_blocks=128, max_model_len=1024,
            load_progress=False)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_dir):
    return LLM(model=str(tiny_checkpoint_dir), **ARGS)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_generate_text_and_token_prompts_like_vllm(llm, tiny_checkpoint_dir):
    prompts = ["The capital of France is", {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}]
    outs = llm.generate(prompts, greedy(6))
    ref = LLMEngine(EngineArgs(model=str(tiny_checkpoint_dir), enable_prefix_caching=False, **ARGS)).generate(
        ["The capital of France is", [5, 6, 7, 8, 9, 10, 11]], greedy(6))
    assert len(outs) == 2
    for o, r in zip(outs, ref):
        c = o.outputs[0]
        assert c.token_ids == r.token_ids and len(c.token_ids) == 6
        assert c.text == r.text and isinstance(c.text, str)
        assert c.finish_reason == "length"
        assert o.prompt_token_ids == r.prompt_token_ids and o.finished
        assert o.num_cached_tokens == 0
    assert outs[0].prompt == "The capital of France is" and outs[1].prompt is None
    assert outs[1].prompt_token_ids == [5, 6, 7, 8, 9, 10, 11]
    assert outs[0].outputs[0].text, "the tiny tokenizer decodes the tokens"
    one = llm.generate("The capital of France is", greedy(6))   # a single prompt: still a list
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_successive_generate_calls_share_the_prefix_cache(llm):
    history = list(range(40, 80))
    first = llm.generate({"prompt_token_ids": history}, greedy(8))[0]
    follow = history + first.outputs[0].token_ids + [81, 82, 83]
    second = llm.generate({"prompt_token_ids": follow}, greedy(4))[0]
    previous = len(history) + len(first.outputs[0].token_ids)
    assert second.num_cached_tokens == previous - 1 >= 0.9 * previous
    assert second.outputs[0].num_cached_tokens == second.num_cached_tokens
    alone = LLM(model=llm.llm_engine.args.model, enable_prefix_caching=False, **ARGS)
    assert alone.generate({"prompt_token_ids": follow}, greedy(4))[0].outputs[0].token_ids == \
        second.outputs[0].token_ids


def test_per_prompt_sampling_params_and_chat(llm):
    sps = [greedy(3), SamplingParams(temperature=0.8, seed=7, max_tokens=5, ignore_eos=True)]
    outs = llm.generate(["a b c", "d e f"], sps)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    again = llm.generate(["d e f"], sps[1])
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids, "seeded sampling is reproducible"
    chat = llm.chat([{"role": "user", "content": "hello"}], greedy(4))
    assert len(chat) == 1 and len(chat[0].outputs[0].token_ids) == 4 and len(chat[0].prompt_token_ids) > 3
    two = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]], greedy(2))
    assert len(two) == 2


def test_offline_api_errors_name_the_problem(llm, tiny_checkpoint_dir):
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_sequences"):
        LLM(model=str(tiny_checkpoint_dir), max_num_sequences=3)
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(1), greedy(1)])
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        llm.generate({"prompt": "x", "prompt_token_ids": [1]})
    with pytest.raises(ValueError, match="prompt keys \\['text'\\]"):
        llm.generate({"text": "x"})
    with pytest.raises(ValueError, match="a prompt must be a string"):
        llm.generate([[1, 2, 3]])


def test_import_glm5_stays_light():
    code = "import sys, glm5; assert 'torch' not in sys.modules, 'import glm5 pulled in torch'; print(glm5.__all__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "LLM" in out.stdout
