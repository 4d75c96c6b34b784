"""Load a GLM-5.3-Flash safetensors checkpoint into canonical in-engine tensors.

Two passes. The *plan* pass reads only shard headers: it resolves every checkpoint key (either the
original layout that ``save_pretrained`` writes or HF's packed in-memory layout, with or without
``model.`` / ``model.language_model.`` prefixes) to the canonical tensor it feeds, pairs fp8 weights
with their ``weight_scale_inv`` and checks names and shapes against the config. Every problem is
collected, so a bad checkpoint fails once with a :class:`CheckpointError` that lists all of them
(instead of the user fixing one and discovering the next). The *load* pass then reads one tensor
at a time through ``safe_open`` (memory-mapped), dequantizes or keeps fp8, casts and stacks experts
straight into the preallocated result, so peak host memory stays near the size of the result.

fp8 (``quantization``): ``"none"`` dequantizes every block-scaled e4m3 weight to the model dtype;
``"auto"`` keeps what the checkpoint has: each fp8 weight stays ``float8_e4m3fn`` with its fp32
``[ceil(out/128), ceil(in/128)]`` scales beside it under ``<name>_scale_inv`` (no model-dtype copy);
``"fp8"`` keeps those and also quantizes every other projection of the text model
(:func:`glm5.weights.names.is_fp8_linear_weight`) to the same format at load, as vLLM's online fp8 does.
Only e4m3 with 128 x 128 blocks is kept as fp8 (the kernels' format); anything else is dequantized (and,
with ``"fp8"``, requantized), with a log line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from glm5_kernels.fp8_ref import BLOCK as KERNEL_FP8_BLOCK
from glm5_kernels.fp8_ref import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block

from glm5.config import ModelConfig
from glm5.distributed.sharding import ShardIndex, WeightSharding
from glm5.weights.files import FP8_CODES, ST_DTYPES, TensorInfo, find_weight_files, read_header
from glm5.weights.names import (
    SCALE_SUFFIX,
    KeyTarget,
    Shape,
    abbreviate_names,
    checkpoint_key_targets,
    expected_weight_shapes,
    can_stay_fp8,
    is_fp8_linear_weight,
    is_fp32_weight,
    is_mtp_name,
    source_shape,
    strip_prefix,
)

logger = logging.getLogger(__name__)

DEFAULT_FP8_BLOCK = (128, 128)
#: ``quantization`` values: what the loader does with fp8 weights (module docstring).
QUANTIZATION_MODES = ("auto", "fp8", "none")
_SCALE_DTYPES = frozenset({"F32", "BF16", "F16"})


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; ``problems`` holds one line per problem found."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path = str(path)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            f"checkpoint {self.path} cannot be loaded ({len(self.problems)} problem"
            f"{'s' if len(self.problems) != 1 else ''}):\n{lines}\n"
            "Fix: re-download or re-export the listed files/tensors, or point at a checkpoint whose "
            "config.json matches its weights.")


# ---------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------
def fp8_scale_shape(weight_shape: Shape, block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> Shape:
    """Shape of ``weight_scale_inv`` for a block-quantized weight: one scale per (partial) block."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8_blockwise(w8: torch.Tensor, scale_inv: torch.Tensor,
                             block: tuple[int, int] = DEFAULT_FP8_BLOCK,
                             offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``W = W8.float() * s`` with one scale per ``block`` tile of the last two dims (edge tiles may
    be partial). Returns fp32 on ``w8``'s device.

    ``offset``: where ``w8`` starts in the full weight (a tensor-parallel shard); ``scale_inv`` then holds the
    scale rows/columns of the blocks the shard touches (:func:`fp8_scale_index`), and a shard that does not
    start on the block grid still gets each element's own block scale."""
    if offset == (0, 0):
        return dequantize_fp8_block(w8, scale_inv, block)
    rows, cols = w8.shape[-2], w8.shape[-1]
    r0, c0 = offset[0] % block[0], offset[1] % block[1]
    s = scale_inv.to(device=w8.device, dtype=torch.float32)
    s = s.repeat_interleave(block[0], dim=-2)[..., r0:r0 + rows, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., c0:c0 + cols]
    return w8.to(torch.float32) * s


def fp8_scale_index(index: tuple[slice, ...], block: tuple[int, int] = DEFAULT_FP8_BLOCK) -> tuple[slice, ...]:
    """The slice of ``weight_scale_inv`` holding the block scales of the weight slice ``index`` (one full
    ``slice`` per dim with explicit start/stop on the last two dims)."""
    *lead, rows, cols = index
    return (*lead, slice(rows.start // block[0], -(-rows.stop // block[0])),
            slice(cols.start // block[1], -(-cols.stop // block[1])))


def _fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    q: Any = cfg.raw.get("quantization_config") or {}
    b = q.get("weight_block_size") if isinstance(q, dict) else None
    return (int(b[0]), int(b[1])) if b else DEFAULT_FP8_BLOCK


# ---------------------------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------------------------
@dataclass
class _Part:
    target: KeyTarget
    info: TensorInfo
    scale: TensorInfo | None = None


@dataclass
class _Recipe:
    name: str
    shape: Shape
    parts: list[_Part] = field(default_factory=list)


# Copies of lm_head / embed_tokens that some MTP exports carry; the engine shares the main ones.
_REDUNDANT_MTP_RE = re.compile(r"^layers\.(\d+)\.(shared_head\.head\.weight|embed_tokens\.weight)$")


def _plan(path: Path, cfg: ModelConfig, allow_missing_mtp: bool) -> tuple[list[_Recipe], list[Path]]:
    problems: list[str] = []
    try:
        files, weight_map, index = find_weight_files(path)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(path, [str(e)]) from e

    # ---- headers ------------------------------------------------------------------------------
    infos: dict[str, TensorInfo] = {}
    bad_files: set[str] = set()
    readable: list[Path] = []
    for f in files:
        if not f.is_file():
            n = sum(1 for v in (weight_map or {}).values() if v == f.name)
            problems.append(f"missing shard file: {f.name} (named in {index.name if index else 'the index'} "
                            f"for {n} tensors)")
            bad_files.add(f.name)
            continue
        try:
            header = read_header(f)
        except ValueError as e:
            problems.append(f"corrupt safetensors file {f.name}: {e}")
            bad_files.add(f.name)
            continue
        readable.append(f)
        for key, info in header.items():
            if key in infos:
                problems.append(f"tensor {key} is stored twice ({infos[key].file.name} and {f.name})")
                continue
            infos[key] = info

    unavailable: set[str] = set()  # canonical names whose keys sit in a missing/corrupt shard
    if weight_map is not None:
        dangling = {k for k, v in weight_map.items() if v not in bad_files and k not in infos}
        for k in sorted(dangling):
            problems.append(f"index points at missing key: {k} (index says it is in {weight_map[k]}, which "
                            "does not contain it)")
        unlisted = sorted(k for k in infos if k not in weight_map)
        if unlisted:
            logger.warning("%d tensors are in shards but not in the index (loaded anyway): %s",
                           len(unlisted), abbreviate_names(unlisted, 10))
        for k, v in weight_map.items():
            if v in bad_files or k in dangling:
                unavailable.update(t.name for t in checkpoint_key_targets(_weight_key(k)))

    # ---- fp8 scales ---------------------------------------------------------------------------
    block = _fp8_block(cfg)
    scales: dict[str, TensorInfo] = {}
    scale_trouble: set[str] = set()  # fp8 weights whose scale exists but is itself a problem
    unexpected: list[str] = []
    for key in [k for k in infos if k.endswith(SCALE_SUFFIX)]:
        sinfo = infos.pop(key)
        base = key[: -len(SCALE_SUFFIX)]
        w = infos.get(base)
        if w is None:
            if weight_map is not None and weight_map.get(base) in bad_files:
                continue
            unexpected.append(key)
        elif w.dtype not in FP8_CODES:
            problems.append(f"scale {key} belongs to {base}, which is {w.dtype}, not fp8; drop the scale or store "
                            "the weight as float8_e4m3fn")
        elif sinfo.dtype not in _SCALE_DTYPES:
            scale_trouble.add(base)
            problems.append(f"wrong dtype: fp8 scale {key} is {sinfo.dtype}; block scales are float32 (F32); "
                            "re-export the checkpoint's weight_scale_inv tensors as float32")
        elif sinfo.shape != fp8_scale_shape(w.shape, block):
            scale_trouble.add(base)
            problems.append(f"wrong shape: fp8 scale {key}: got {tuple(sinfo.shape)}, expected "
                            f"{fp8_scale_shape(w.shape, block)} (one scale per {block[0]}x{block[1]} block of "
                            f"{tuple(w.shape)})")
        else:
            scales[base] = sinfo
    for key, w in infos.items():
        if w.dtype in FP8_CODES and key not in scales and key not in scale_trouble:
            problems.append(f"fp8 weight without its scale: {key} is {w.dtype} but {key}{SCALE_SUFFIX} is absent")

    # ---- map keys to canonical names ----------------------------------------------------------
    expected = expected_weight_shapes(cfg, include_mtp=True)
    recipes: dict[str, _Recipe] = {}
    mtp_declared = set(cfg.text.mtp_layer_ids)
    undeclared_mtp: list[str] = []
    for key, info in infos.items():
        targets = checkpoint_key_targets(key)
        if any(t.name not in expected for t in targets):
            m = _REDUNDANT_MTP_RE.match(strip_prefix(key))
            if m and int(m.group(1)) in mtp_declared:
                logger.info("ignoring %s: the MTP layer shares the main embed_tokens / lm_head", key)
                continue
            lm = re.match(r"^layers\.(\d+)\.", targets[0].name)
            if lm and int(lm.group(1)) >= cfg.text.num_hidden_layers and int(lm.group(1)) not in mtp_declared:
                undeclared_mtp.append(key)
            else:
                unexpected.append(key)
            continue
        for t in targets:
            r = recipes.setdefault(t.name, _Recipe(t.name, expected[t.name]))
            r.parts.append(_Part(t, info, scales.get(key)))

    wrong: list[str] = []
    missing: set[str] = set()
    for r in recipes.values():
        kinds = {p.target.kind for p in r.parts}
        if len(kinds) > 1 or (kinds != {"expert"} and len(r.parts) > 1):
            problems.append(f"tensor {r.name} is provided more than once: "
                            f"{', '.join(sorted(p.info.key for p in r.parts))}; keep one key layout")
            continue
        for p in r.parts:
            want = source_shape(p.target, r.shape)
            if p.info.shape != want:
                wrong.append(f"wrong shape: {r.name} (key {p.info.key}): got {tuple(p.info.shape)}, expected {want}")
        if kinds == {"expert"}:
            n_exp = r.shape[0]
            seen: dict[int, _Part] = {}
            for p in r.parts:
                if p.target.index >= n_exp:
                    unexpected.append(p.info.key)
                elif p.target.index in seen:
                    problems.append(f"expert {p.target.index} of {r.name} is stored twice")
                else:
                    seen[p.target.index] = p
            for e in range(n_exp):
                if e not in seen and r.name not in unavailable:
                    missing.add(f"{r.name.rsplit('.', 1)[0]}.{e}.{r.name.rsplit('.', 1)[1]}.weight")
            r.parts = [seen[e] for e in sorted(seen)]
    problems.extend(wrong)

    # ---- missing ------------------------------------------------------------------------------
    mtp_names = {n for n in expected if is_mtp_name(n, cfg)}
    if mtp_names and not any(n in recipes or n in unavailable for n in mtp_names):
        if allow_missing_mtp:
            logger.info("checkpoint has no MTP layer (layers %s); loading without it (speculative decoding "
                        "must stay off)", cfg.text.mtp_layer_ids)
            for n in mtp_names:
                expected.pop(n)
        else:
            problems.append(
                f"MTP layer(s) {cfg.text.mtp_layer_ids} declared by the config (num_nextn_predict_layers="
                f"{cfg.text.num_nextn_predict_layers}) are absent from the checkpoint; pass "
                "allow_missing_mtp=True (speculative decoding off) or use a checkpoint with layers."
                f"{cfg.text.mtp_layer_ids[0]}.*")
            for n in mtp_names:
                expected.pop(n)
    if ("lm_head.weight" not in recipes and "lm_head.weight" not in unavailable and cfg.text.tie_word_embeddings
            and "embed_tokens.weight" in recipes):
        logger.info("lm_head.weight absent and tie_word_embeddings=true: sharing embed_tokens.weight")
        emb = recipes["embed_tokens.weight"]
        recipes["lm_head.weight"] = _Recipe("lm_head.weight", expected["lm_head.weight"], list(emb.parts))
    missing |= {n for n in expected if n not in recipes and n not in unavailable}
    if bad_files and weight_map is None:
        missing.clear()  # without an index the corrupt file's contents are unknown: listing would mislead
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_summarize_missing(missing, expected)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {abbreviate_names(unexpected)}")
    if undeclared_mtp:
        problems.append(
            f"unexpected tensors ({len(undeclared_mtp)}) beyond num_hidden_layers={cfg.text.num_hidden_layers}: "
            f"{abbreviate_names(undeclared_mtp)}; if these are MTP layers set num_nextn_predict_layers in "
            "config.json")
    if problems:
        raise CheckpointError(path, problems)
    ordered = [recipes[n] for n in expected if n in recipes]
    return ordered, readable


def _summarize_missing(missing: set[str], expected: dict[str, Shape]) -> str:
    """Abbreviated missing-name list where an entirely absent layer / vision tower is one entry."""
    def group(name: str) -> str:
        m = re.match(r"^(layers\.\d+)\.", name)
        return m.group(1) if m else ("visual" if name.startswith("visual.") else "")

    sizes: dict[str, int] = {}
    for n in expected:
        sizes[group(n)] = sizes.get(group(n), 0) + 1
    counts: dict[str, int] = {}
    for n in missing:
        counts[group(n)] = counts.get(group(n), 0) + 1
    whole = {g for g, c in counts.items() if g and c == sizes.get(g)}
    rest = [n for n in missing if group(n) not in whole]
    parts = []
    if whole:
        parts.append(abbreviate_names([f"{g}.*" for g in whole]) + " (entirely absent)")
    if rest:
        parts.append(abbreviate_names(rest))
    return ", ".join(parts)


def _weight_key(key: str) -> str:
    """Map a scale key to its weight key (so it resolves to the same canonical tensor)."""
    return key[: -len(SCALE_SUFFIX)] if key.endswith(SCALE_SUFFIX) else key


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
class _Reader:
    """Open shard handles (memory-mapped) and per-part reads, dequantizing fp8 or keeping it."""

    def __init__(self, stack: contextlib.ExitStack, device: torch.device, block: tuple[int, int]):
        self._stack = stack
        self._handles: dict[Path, Any] = {}
        self.device = device
        self.block = block
        self.dequantized = 0
        self.kept = 0
        self.quantized = 0
        self.bytes_read = 0

    def _h(self, file: Path) -> Any:
        h = self._handles.get(file)
        if h is None:
            h = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            self._handles[file] = h
        return h

    def keepable(self, part: _Part, shard: ShardIndex | None = None) -> bool:
        """True if ``part`` is fp8 in the kernels' format (e4m3, 128 x 128 blocks) and what is read of it — its
        canonical chunk (packed keys), the rank's ``shard`` — starts and ends on scale-block boundaries, so it can
        stay fp8 with its own scales."""
        if part.scale is None or part.info.dtype != "F8_E4M3" or self.block != (KERNEL_FP8_BLOCK, KERNEL_FP8_BLOCK):
            return False
        shape, index = part.info.shape, _source_index(part, shard)
        for d, blk in ((len(shape) - 2, self.block[0]), (len(shape) - 1, self.block[1])):
            sl = index[d]
            if sl.start % blk or (sl.stop % blk and sl.stop != shape[d]):
                return False
        return True

    def read(self, part: _Part, shard: ShardIndex | None = None) -> torch.Tensor:
        """The canonical-side tensor of ``part`` (its chunk, for packed keys; the rank's ``shard`` of it, a range
        of one dim), on ``self.device``; fp8 dequantized. Only that slice is read from the file (``safe_open``
        slicing), with the scale rows/columns of the blocks it touches."""
        h = self._h(part.info.file)
        index = _source_index(part, shard)
        self.bytes_read += _slice_bytes(part.info, index)
        w = h.get_slice(part.info.key)[index]
        if part.scale is None:
            return w.to(self.device)
        s = self._h(part.scale.file).get_slice(part.scale.key)[fp8_scale_index(index, self.block)]
        self.dequantized += 1
        return dequantize_fp8_blockwise(w.to(self.device), s, self.block, (index[-2].start, index[-1].start))

    def read_fp8(self, part: _Part, shard: ShardIndex | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W8 float8_e4m3fn, scale fp32)`` of a :meth:`keepable` part (its chunk, for packed keys; the rank's
        ``shard``): the weight slice and exactly the scale blocks it covers."""
        assert part.scale is not None
        index = _source_index(part, shard)
        self.bytes_read += _slice_bytes(part.info, index)
        w8 = self._h(part.info.file).get_slice(part.info.key)[index].to(self.device)
        s = self._h(part.scale.file).get_slice(part.scale.key)[fp8_scale_index(index, self.block)]
        self.kept += 1
        return w8.contiguous(), s.to(device=self.device, dtype=torch.float32).contiguous()

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Online fp8: ``w`` (any float dtype) to e4m3 + 128 x 128 block scales, on ``self.device``."""
        self.quantized += 1
        return quantize_fp8_block(w.to(self.device))


def _source_index(part: _Part, shard: ShardIndex | None) -> tuple[slice, ...]:
    """Explicit slices (every dim) of the checkpoint tensor behind ``part`` restricted to ``shard``: a packed
    key's chunk, then the shard's range (clamped to the real rows: vocab padding is added by the caller)."""
    t, shape = part.target, part.info.shape
    sl = [slice(0, n) for n in shape]
    if t.kind == "chunk":
        size = shape[t.dim] // t.count
        sl[t.dim] = slice(t.index * size, (t.index + 1) * size)
    if shard is not None and shard.dim is not None:
        d = shard.dim
        base, full = sl[d].start, sl[d].stop - sl[d].start
        sl[d] = slice(base + min(shard.start, full), base + min(shard.stop, full))
    return tuple(sl)


def _slice_bytes(info: TensorInfo, index: tuple[slice, ...]) -> int:
    n = ST_DTYPES[info.dtype][1]
    for s in index:
        n *= s.stop - s.start
    return n


def _shard_parts(r: _Recipe, shard: ShardIndex) -> tuple[list[_Part], ShardIndex | None]:
    """The parts a rank reads for recipe ``r`` and the shard of each part: the rank's experts (expert
    parallelism), every expert's slice (the shard moved to the per-expert dims), or the one part's shard."""
    if r.parts[0].target.kind == "expert":
        if shard.indices is not None:
            return [r.parts[e] for e in shard.indices], None
        return list(r.parts), None if shard.dim is None else ShardIndex(shard.dim - 1, shard.start, shard.stop)
    return [r.parts[0]], shard if shard.dim is not None else None


def _check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization={quantization!r}: use auto (keep the checkpoint's fp8 weights in fp8), fp8 "
                         "(also quantize the other projections at load) or none (dequantize to the model dtype)")


def _load_fp8(reader: _Reader, r: _Recipe, online: bool,
              shard: ShardIndex | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Recipe ``r`` (this rank's ``shard`` of it) as ``(W8, scale)`` when it stays fp8, else None (it then loads
    in the model dtype).

    A whole tensor stays fp8 when the checkpoint stores it in the kernels' fp8 format; with ``online`` every
    :func:`is_fp8_linear_weight` tensor is fp8 (quantized here when the checkpoint's copy is not). A stacked
    expert tensor is fp8 only as a whole: with some experts fp8 and some not, ``online`` quantizes the rest,
    otherwise the stack is dequantized (one warning). A tensor-parallel shard keeps the checkpoint's fp8 only when
    it falls on the 128 block grid (the real model's do); otherwise it is dequantized, or with ``online``
    re-quantized on its own grid."""
    kind = r.parts[0].target.kind
    if not can_stay_fp8(r.name):
        return None
    shard = shard or ShardIndex()
    parts, inner = _shard_parts(r, shard)
    keep = [reader.keepable(p, inner) for p in parts]
    if not online and not all(keep):
        if any(keep):
            logger.warning("%s: %d of %d parts are fp8, the rest are not; dequantizing all of it (quantization=fp8 "
                           "would quantize the rest instead)", r.name, sum(keep), len(keep))
        return None
    if online and not is_fp8_linear_weight(r.name) and not all(keep):
        return None
    if kind != "expert":
        part = parts[0]
        return reader.read_fp8(part, inner) if keep[0] else reader.quantize(reader.read(part, inner))
    local = shard.local_shape(r.shape)
    w8 = torch.empty(local, dtype=FP8_DTYPE, device=reader.device)
    sc = torch.empty(fp8_scale_shape(local), dtype=torch.float32, device=reader.device)
    for e, (part, k) in enumerate(zip(parts, keep)):
        we, se = reader.read_fp8(part, inner) if k else reader.quantize(reader.read(part, inner))
        w8[e].copy_(we)
        sc[e].copy_(se)
    return w8, sc


def load_weights(path: str | Path, cfg: ModelConfig | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, progress: bool = True,
                 allow_missing_mtp: bool = False, quantization: str = "none",
                 sharding: WeightSharding | None = None) -> dict[str, torch.Tensor]:
    """Load every canonical tensor of the checkpoint at ``path`` onto ``device``.

    ``cfg`` defaults to the checkpoint's own ``config.json``. Tensors are cast to ``dtype`` except
    the fp32 set (:func:`glm5.weights.is_fp32_weight`). fp8 block-quantized weights are dequantized
    (``quantization="none"``) or kept as fp8 with their scales under ``<name>_scale_inv``
    (``"auto"``; ``"fp8"`` also quantizes the other projections): see the module docstring. Routed
    experts come back stacked (fp8 stacks with stacked ``[E, ...]`` scales). With
    ``allow_missing_mtp=True`` a checkpoint without the config's MTP layers loads (and the MTP names
    are absent from the result); MTP tensors that are present are always returned. Raises
    :class:`CheckpointError` listing every problem if the checkpoint does not match ``cfg``.

    ``sharding`` (tensor / expert parallelism): load only this rank's slice of every tensor
    (:mod:`glm5.distributed.sharding`) — each slice is read from the file on its own, fp8 scales with it, so a
    sharded weight is never whole in host memory; under expert parallelism only the rank's experts are opened.
    The progress bar (rank 0) counts the bytes this rank reads.
    """
    _check_quantization(quantization)
    path = Path(path)
    if cfg is None:
        cfg = ModelConfig.from_pretrained(path if path.is_dir() else path.parent)
    t0 = time.perf_counter()
    recipes, files = _plan(path, cfg, allow_missing_mtp)
    if sharding is not None:
        recipes = [r for r in recipes if sharding.held(r.name)]
    dev = torch.device(device)
    out: dict[str, torch.Tensor] = {}
    total = 0
    show = progress and (sharding is None or sharding.ranks.is_driver)
    with contextlib.ExitStack() as stack:
        reader = _Reader(stack, dev, _fp8_block(cfg))
        bar = tqdm(total=sum(_recipe_bytes(r, sharding) for r in recipes), desc=f"loading {path.name or path}",
                   unit="B", unit_scale=True, unit_divisor=1024, disable=not show, leave=False)
        for r in recipes:
            want = torch.float32 if is_fp32_weight(r.name) else dtype
            shard = sharding.index(r.name, r.shape) if sharding is not None else ShardIndex()
            before = reader.bytes_read
            fp8 = None if quantization == "none" else _load_fp8(reader, r, quantization == "fp8", shard)
            if fp8 is not None:
                out[r.name], out[r.name + SCALE_SUFFIX] = fp8
                total += fp8[0].numel() + fp8[1].numel() * 4
            else:
                out[r.name] = t = _load_recipe(reader, r, shard, want, dev)
                total += t.numel() * t.element_size()
            bar.update(reader.bytes_read - before)
        bar.close()
    fp8_note = ", ".join(f"{what} {n} fp8 tensors" for what, n in (
        ("kept", reader.kept), ("quantized", reader.quantized), ("dequantized", reader.dequantized)) if n)
    logger.info("loaded %d tensors (%.2f GiB, %s, quantization=%s) from %d file(s) in %s in %.1fs%s%s", len(out),
                total / 2**30, dtype, quantization, len(files), path, time.perf_counter() - t0,
                f"; {fp8_note}" if fp8_note else "",
                f"; rank {sharding.ranks.rank}/{sharding.ranks.world_size} shard" if sharding is not None else "")
    return out


def _load_recipe(reader: _Reader, r: _Recipe, shard: ShardIndex, want: torch.dtype, dev: torch.device) -> torch.Tensor:
    """One canonical tensor (this rank's ``shard`` of it) in dtype ``want``; vocab padding rows are zeros."""
    local = shard.local_shape(r.shape)
    parts, inner = _shard_parts(r, shard)
    if r.parts[0].target.kind == "expert":
        t = torch.empty(local, dtype=want, device=dev)
        for j, part in enumerate(parts):     # the rank's experts in its physical order, or each expert's slice
            t[j].copy_(reader.read(part, inner))
        return t
    t = reader.read(parts[0], inner).to(dtype=want)
    if tuple(t.shape) != local:              # a vocab-parallel shard past the last row: zero padding
        pad = torch.zeros(local, dtype=want, device=dev)
        pad.narrow(shard.dim, 0, t.shape[shard.dim]).copy_(t)
        t = pad
    return t.contiguous() if r.parts[0].target.kind == "chunk" or shard.dim is not None else t


def _recipe_bytes(r: _Recipe, sharding: WeightSharding | None) -> int:
    """Bytes the load of ``r`` reads (this rank's slice of every part; fp8 scales not counted)."""
    if sharding is None:
        return sum(p.info.nbytes for p in r.parts)
    shard = sharding.index(r.name, r.shape)
    if shard.indices is not None:
        return sum(r.parts[e].info.nbytes for e in shard.indices)
    return math.prod(shard.local_shape(r.shape)) * ST_DTYPES[r.parts[0].info.dtype][1]


def check_checkpoint(path: str | Path, cfg: ModelConfig | None = None, allow_missing_mtp: bool = False) -> int:
    """Validate a checkpoint from its headers only (no tensor data read); returns the tensor count.

    Raises :class:`CheckpointError` exactly as :func:`load_weights` would.
    """
    path = Path(path)
    if cfg is None:
        cfg = ModelConfig.from_pretrained(path if path.is_dir() else path.parent)
    recipes, _ = _plan(path, cfg, allow_missing_mtp)
    return len(recipes)
