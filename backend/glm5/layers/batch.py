"""Per-step metadata of a packed forward pass.

One step processes many requests at once: each contributes a contiguous run of tokens to the packed
``input_ids`` (a prefill chunk, a single decode token, or k+1 speculative-verification tokens).
Blocks read these records instead of padded ``[batch, seq]`` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def host_to_device(values: list | torch.Tensor, device: torch.device | str,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a host list, or a CPU tensor) on ``device`` without waiting for the GPU; ``dtype`` as
    ``torch.tensor`` infers it unless given (a tensor keeps its own unless given).

    ``torch.tensor(values, device=cuda)`` copies from pageable memory, which returns only after every kernel
    queued before it has run: a hidden host sync. In a speculative round at batch 1 eight such calls per step
    held the host until the GPU was idle, then the GPU waited for the host's next launch (bench/results/limits.md).
    Here the values go to pinned memory and are copied asynchronously (the caching host allocator keeps the
    pinned block until the copy is done). A tensor that is pinned already is copied from as it is: the caller
    must not change it afterwards."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    dev = torch.device(device)
    if dev.type != "cuda":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host, started without waiting for the GPU.

    ``tensor.tolist()`` on a CUDA tensor returns only after every kernel queued before it has run, so the host
    cannot prepare the next launch while the GPU works. Here the values go into pinned memory asynchronously
    behind an event; :meth:`tolist` waits for that event only (once), and the device tensor stays available
    (``device_tensor``) to consumers on the GPU that need no host copy at all."""

    def __init__(self, tensor: torch.Tensor):
        self.device_tensor = tensor
        self._event = None
        self._list: list | None = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def tolist(self) -> list:
        if self._list is None:
            if self._event is not None:
                self._event.synchronize()
            self._list = self._host.tolist()
        return self._list


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
    """Device tensors of a batched decode step (one token per request, or a speculative step's verification
    rows), row-aligned with ``ForwardBatch.input_ids``. Everything a decode layer needs is a tensor here — no
    per-request Python loop and no host sync — so the step can be captured in a CUDA graph; padding rows of a
    graph bucket point at the cache's scratch block and slot."""

    state_slots: torch.Tensor    # int64 [N]
    block_tables: torch.Tensor   # int32 [N, max_blocks] (unused columns: any valid block id)
    slot_mapping: torch.Tensor   # int64 [N] latent row of each row's own token
    positions_host: list[int] | None = None  # host copy, for backends that plan on the host (FlashInfer)
    # the step's planned FlashInfer sparse-MLA wrapper (glm5_kernels.flashinfer_mla), when that backend runs;
    # one plan serves every MLA layer because the selection sizes depend only on the positions
    flashinfer: Any = None
    # speculative verification: every request has ``rows_per_seq`` consecutive rows (its last token and its
    # drafts, positions in order); KDA layers then run the rows as one recurrence per request without writing
    # the state, and every layer leaves what the commit needs in ``verify`` (glm5.layers.speculative)
    rows_per_seq: int = 1
    verify: Any = None
    # index sharing across MTP draft steps (index_share_for_mtp_iteration): MLA layer -> [N, pools] index
    # scores to reuse instead of scoring (``index_scores``), or a dict to fill with this step's (``scores_out``)
    index_scores: dict | None = None
    scores_out: dict | None = None


@dataclass
class SeqTensors:
    """Per-request device tensors of a packed (prefill / verification) step, built once from host values and
    shared by every layer: the requests' cumulative row offsets, their state slots and fla's varlen chunk list
    of the causal conv (64-row chunks). Built by :func:`host_to_device`, so making them does not wait for the
    GPU."""

    cu_seqlens: torch.Tensor        # int64 [N + 1]
    state_slots: torch.Tensor       # int64 [N]
    conv_chunk_indices: torch.Tensor  # int64 [chunks, 2]: (request, chunk within it), as fla prepares them
    max_len: int                    # longest request's rows this step (host)

    @classmethod
    def build(cls, seqs: list[SeqChunk], device: torch.device, chunk: int = 64) -> "SeqTensors":
        lens = [s.num_tokens for s in seqs]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        chunks = [v for i, n in enumerate(lens) for j in range(-(-n // chunk)) for v in (i, j)]
        flat = host_to_device(cu + [s.state_slot for s in seqs] + chunks, device)
        n = len(seqs)
        return cls(cu_seqlens=flat[: n + 1], state_slots=flat[n + 1: 2 * n + 1],
                   conv_chunk_indices=flat[2 * n + 1:].view(-1, 2), max_len=max(lens, default=0))


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
    _seq_tensors: SeqTensors | None = field(default=None, repr=False)

    def seq_tensors(self, device: torch.device) -> SeqTensors:
        """:class:`SeqTensors` of :attr:`seqs` on ``device``, built on first use in the step."""
        if self._seq_tensors is None:
            self._seq_tensors = SeqTensors.build(self.seqs, device)
        return self._seq_tensors

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
