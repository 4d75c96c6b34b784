"""The correctness oracle: transformers' ``glm5_next`` on tiny checkpoints with every parameter random.

Greedy reference decoding drives ``Glm5NextForConditionalGeneration.forward`` with its own cache and
**no attention mask**. transformers 5.23's ``generate()`` passes an all-ones 2-D ``attention_mask``,
which this model's indexer path does not treat as "no padding": the logits change by O(1) (checked:
the same prompt's prefill logits differ by 0.89 with and without an all-ones mask, while the
mask-free forward agrees with incremental decoding to 1e-6 and with model-spec's independent
re-implementation). The mask-free path is the model's math; ``generate()`` is not used here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glm5.engine import EngineArgs, LLMEngine, PromptInput
from glm5.sampling_params import SamplingParams
from glm5.tiny_checkpoint import make_tiny_checkpoint


def make_pair(path: Path, seed: int = 0, text_overrides: dict | None = None, **kw) -> tuple[Path, object]:
    """Write a tiny checkpoint and load transformers' model from it (fp32, eager, eval)."""
    from transformers import Glm5NextForConditionalGeneration

    ckpt = make_tiny_checkpoint(path, seed=seed, text_overrides=text_overrides, **kw)
    hf = Glm5NextForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32)
    hf.config.text_config._attn_implementation = "eager"
    return ckpt, hf.eval()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int, **mm) -> list[int]:
    """Greedy tokens from transformers: one prefill, then one cached decode step per token."""
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True, **mm)
    cache, tokens = out.past_key_values, []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(n - 1):
        tokens.append(nxt)
        out = hf(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
    tokens.append(nxt)
    return tokens


def engine(ckpt: Path, **kw) -> LLMEngine:
    args = dict(model=str(ckpt), device="cpu", dtype="float32", block_size=16, num_cache_blocks=256,
                max_num_seqs=16, max_num_batched_tokens=256, load_progress=False)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def engine_greedy(eng: LLMEngine, prompts: list[list[int] | PromptInput], n: int) -> list[list[int]]:
    return [o.token_ids for o in eng.generate(prompts, greedy(n))]


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


class ScriptedK:
    """A speculation policy that drafts ``schedule[i % len(schedule)]`` at its i-th choice (steps with 0 leave an
    MTP backlog); records the steps the engine timed as ``(batch, plain)``. ``pays=False``: it says speculation
    cannot pay, so full backlogs are dropped; ``holds`` (default: ``pays``) whether rows wait in backlogs at all
    (False: the MTP layer stops following the requests at their next k = 0 step)."""

    def __init__(self, schedule: list[int], pays: bool = True, holds: bool | None = None):
        self.schedule, self.i, self.pays, self.holds = schedule, 0, pays, holds
        self.may_probe: list[bool] = []   # what the engine allowed at each choice
        self.timed: list[tuple[int, bool]] = []

    def keeps_mtp(self, batch: int) -> bool:
        """``pays``: whether the engine keeps the MTP layer's history (drains full backlogs) or drops it."""
        return self.pays

    def holds_mtp(self, batch: int) -> bool:
        """``holds`` (default ``pays``): whether rows wait in backlogs at all."""
        return self.pays if self.holds is None else self.holds

    def choose(self, batch: int, may_probe: bool = True) -> int:
        self.may_probe.append(may_probe)
        self.i += 1
        return self.schedule[self.i % len(self.schedule)]

    def observe_step(self, results) -> None:
        pass

    def observe_time(self, seconds: float, batch: int, plain: bool, mtp_only: bool = False) -> None:
        self.timed.append((batch, plain))
