"""Per-step metadata of a packed forward pass.

One step processes many requests at once: each contributes a contiguous run of tokens to the packed
``input_ids`` (a prefill chunk, a single decode token, or k+1 speculative-verification tokens).
Blocks read these records instead of padded ``[batch, seq]`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SeqChunk:
    """One request's share of the packed batch."""

    start: int              # first row of this request in the packed tensors
    num_tokens: int         # rows this step
    context_len: int        # tokens already cached before this step = position of the first row
    block_table: torch.Tensor  # int64 [num_blocks_of_request] on the model device
    state_slot: int         # KDA state / kpool tail slot
    record_states: bool = False  # speculative verification: keep per-row states for rollback

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def total_len(self) -> int:
        """Tokens in the cache after this step."""
        return self.context_len + self.num_tokens


@dataclass
class DecodeMeta:
    """Device tensors of a pure decode step (one token per request, no recording), row-aligned with
    ``ForwardBatch.input_ids``. Everything a decode layer needs is a tensor here — no per-request
    Python loop and no host sync — so the step can be captured in a CUDA graph; padding rows of a
    graph bucket point at the cache's scratch block and slot."""

    state_slots: torch.Tensor    # int64 [N]
    block_tables: torch.Tensor   # int32 [N, max_blocks] (unused columns: any valid block id)
    slot_mapping: torch.Tensor   # int64 [N] latent row of each row's own token
    positions_host: list[int] | None = None  # host copy, for backends that plan on the host (FlashInfer)
    # the step's planned FlashInfer sparse-MLA wrapper (glm5_kernels.flashinfer_mla), when that backend runs;
    # one plan serves every MLA layer because the selection sizes depend only on the positions
    flashinfer: Any = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor          # int64 [T]
    positions: torch.Tensor          # int64 [T]
    seqs: list[SeqChunk]
    logits_indices: torch.Tensor     # int64 [L] rows whose logits are wanted
    # multimodal: rows of ``input_ids`` replaced by vision embeddings
    mm_embeds: torch.Tensor | None = None      # [M, H]
    mm_rows: torch.Tensor | None = None        # int64 [M]
    # per-row states of recording chunks, keyed (layer, state_slot); see SpecRecords
    records: dict = field(default_factory=dict)
    # index sharing across MTP draft steps: state_slot -> chosen pools of the first step, per MLA layer
    shared_pools: dict | None = None
    # set for pure decode steps on the batched path (see DecodeMeta)
    decode: DecodeMeta | None = None
    # logits rows that score prompt tokens: (chunk index, first logits row, rows, first position)
    prompt_logprob_rows: list[tuple[int, int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
