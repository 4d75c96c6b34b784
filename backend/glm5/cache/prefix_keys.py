"""Content keys of the prefix cache: chained block keys and state-snapshot keys.

A cached block is found by what it holds, not by who wrote it. Block ``k`` of a token stream
(positions ``k*bs .. (k+1)*bs - 1``) gets the key ``sha256(key of block k-1 | its token ids | the
media in it)``, so equal keys mean equal *prefixes*, not just equal blocks (nano-vllm's and
vLLM's chained hash; SHA-256 as vLLM's default, so that collisions need not be guarded by
comparing tokens). Media items enter as the content hash of their pixels and the position of
their first placeholder: two different images behind the same ``<|image|>`` placeholder ids give
different keys.

*Lookahead*: with MTP on, the MTP layer's cache row at position ``p`` is computed from token
``p + 1`` (its input is the embedding of the next token), so a block's cached content depends on
one token past its end. Keys then also cover that token (``lookahead = 1``): a block is reused only
by a request whose next token matches as well. The same holds for snapshot keys.

A snapshot at position ``P`` (the request's state after its first ``P`` tokens) is keyed by the
chain of the ``P // bs`` full blocks before it plus the remaining ``P % bs`` tokens (+ lookahead).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

ROOT_KEY = hashlib.sha256(b"glm5 prefix cache v1").digest()

#: ``get(start, end)``: token ids at positions ``start .. end-1`` of a request.
TokenGetter = Callable[[int, int], list[int]]


@dataclass(frozen=True)
class MediaSpan:
    """One image or video of a prompt: its content hash and the positions of its placeholders."""

    start: int          # first placeholder position
    end: int            # one past the last placeholder position
    content_hash: str


def media_bytes(spans: list[MediaSpan], lo: int, hi: int) -> bytes:
    """What the media overlapping positions ``lo .. hi-1`` contribute to a key."""
    return b"".join(f"{s.content_hash}@{s.start};".encode() for s in spans if s.start < hi and s.end > lo)


def token_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


def block_key(parent: bytes, tokens: list[int], media: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(b"B")
    h.update(token_bytes(tokens))
    h.update(media)
    return h.digest()


def snapshot_key(chain: bytes, position: int, tokens: list[int], media: bytes = b"") -> bytes:
    """Key of a state snapshot at ``position``: ``chain`` = key of its full blocks, ``tokens`` = the
    rest up to the position (plus lookahead)."""
    h = hashlib.sha256(chain)
    h.update(b"S")
    h.update(position.to_bytes(8, "little"))
    h.update(token_bytes(tokens))
    h.update(media)
    return h.digest()


@dataclass
class TokenChain:
    """The chained block keys of one request, extended as its tokens become known.

    ``keys[k]`` is the key of blocks ``0 .. k``; it needs ``(k+1)*block_size + lookahead`` tokens.
    """

    block_size: int
    lookahead: int = 0
    media: list[MediaSpan] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    def update(self, get: TokenGetter, num_tokens: int) -> None:
        """Compute the keys of every block whose tokens (and lookahead) are among the first ``num_tokens``."""
        bs = self.block_size
        for k in range(len(self.keys), (num_tokens - self.lookahead) // bs):
            lo, hi = k * bs, (k + 1) * bs + self.lookahead
            self.keys.append(block_key(self.prefix(k), get(lo, hi), media_bytes(self.media, lo, hi)))

    def prefix(self, k: int) -> bytes:
        """Key of the first ``k`` blocks (the root key for none)."""
        return ROOT_KEY if k == 0 else self.keys[k - 1]

    def block_tokens_span(self, k: int) -> tuple[int, int]:
        """Positions covered by block ``k``'s key (its tokens plus lookahead)."""
        return k * self.block_size, (k + 1) * self.block_size + self.lookahead

    def snapshot_key(self, get: TokenGetter, position: int) -> bytes:
        """Key of a snapshot at ``position``; needs the keys of its full blocks and ``position + lookahead`` tokens."""
        k = position // self.block_size
        lo, hi = k * self.block_size, position + self.lookahead
        return snapshot_key(self.prefix(k), position, get(lo, hi), media_bytes(self.media, lo, hi))
