"""Training-free sparse self-attention for video DiTs: a query frame attends to the frames within `window` of it and
to the clip's first `sink` frames, not to the rest. Most of a video DiT's attention weight stays near the query's own
frame, and the first frame anchors the clip's look (Sparse VideoGen's temporal heads, Radial Attention's window and
sink); the first sampling steps, which set the layout, stay dense (`dense_steps`).

On CUDA the mask runs as PyTorch's FlexAttention with a BlockMask, compiled by Inductor into a block-sparse Triton
kernel that skips the key blocks outside the mask instead of computing and masking them; elsewhere (the CPU tests) as
SDPA with the same boolean mask. A `Plan` per (settings, shape, device) holds the mask; the dense and sparse phases
switch by copying the dense or sparse block tables into the same tensors (and a flag the mask reads), so one compiled
kernel, and a CUDA graph recorded over it, serve both phases. The first sparse call of a shape logs the mask's density
and its error against dense attention on that call's inputs.
"""
from __future__ import annotations

import dataclasses
import logging
import threading

import torch
import torch.nn.functional as F

from ..core.cuda_streams import capturing
from ..core.errors import OverdriveError
from .reference import relative_error

log = logging.getLogger("overdrive")

BLOCK = 128  # FlexAttention's query and key block
# Where the mask keeps more than this share of the query-key pairs (a short clip), attention stays dense: a
# block-sparse kernel that skips little is slower than the dense kernels.
MAX_DENSITY = 0.8
# A BlockMask's tables: copied whole between the dense and sparse phases.
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
          "full_q_num_blocks", "full_q_indices")


class VideoSparsityError(OverdriveError, ValueError):
    """Bad sparse-attention settings: the message names the setting and the fix."""


@dataclasses.dataclass(frozen=True)
class VideoSparsity:
    window: int = 1            # frames on each side of a query's frame that it attends to
    sink: int = 1              # the clip's first frames, which every query attends to
    dense_steps: float = 0.25  # the share of sampling steps, from the first, that run dense attention

    def __post_init__(self):
        if self.window < 0 or self.sink < 0:
            raise VideoSparsityError(f"window ({self.window}) and sink ({self.sink}) count frames: 0 or more")
        if not 0.0 <= self.dense_steps <= 1.0:
            raise VideoSparsityError(f"dense_steps is a share of the sampling steps in [0, 1], got {self.dense_steps}")

    @property
    def mask(self) -> tuple:
        """What the mask depends on (not the phase schedule): the key of its plans and phases."""
        return self.window, self.sink

    def keeps(self, query_frame: torch.Tensor, key_frame: torch.Tensor) -> torch.Tensor:
        return ((query_frame - key_frame).abs() <= self.window) | (key_frame < self.sink)

    def density(self, frames: int) -> float:
        """The share of query-key pairs the mask keeps over a clip of `frames` frames. Plain integers: the attention
        override that asks runs inside compiled blocks, where a tensor's value would be a data-dependent guard."""
        sink = min(self.sink, frames)
        kept = 0
        for query in range(frames):
            low, high = max(0, query - self.window), min(frames - 1, query + self.window)
            kept += high - low + 1 + sink - max(0, min(sink - 1, high) - low + 1)
        return kept / frames ** 2


class Plan:
    """The mask of one setting over `tokens` tokens of `per_frame` tokens a frame, on `device`, in its current phase."""

    def __init__(self, sparsity: VideoSparsity, tokens: int, per_frame: int, device: torch.device):
        # `sparsity`: its mask only (the phase comes from set_dense)
        self.sparsity, self.tokens, self.per_frame, self.device = sparsity, tokens, per_frame, device
        self.dense = False
        self.reported = False
        self.failed = False
        self._flag = torch.zeros(1, dtype=torch.bool, device=device)  # read by the mask: True in the dense phase
        self._block_mask = self._tables = self._token_mask = None

    def _mask_mod(self):
        flag, per_frame, keeps = self._flag, self.per_frame, self.sparsity.keeps

        def mask_mod(batch, head, query, key):
            return flag[0] | keeps(query // per_frame, key // per_frame)
        return mask_mod

    def block_mask(self):
        """FlexAttention's BlockMask, made once; its tables hold the current phase's. On CUDA its making is compiled,
        block by block: made eagerly it holds the whole token-by-token mask at once (tens of GiB at 720p)."""
        with _LOCK:  # one BlockMask per plan: a graph recorded over a second one would read stale tables
            if self._block_mask is None:
                from torch.nn.attention.flex_attention import create_block_mask
                made = {}
                for dense in (True, False):
                    self._flag.fill_(dense)
                    made[dense] = create_block_mask(self._mask_mod(), None, None, self.tokens, self.tokens,
                                                    device=self.device, BLOCK_SIZE=BLOCK,
                                                    _compile=self.device.type == "cuda")
                self._tables = {dense: {name: getattr(mask, name).clone() for name in TABLES}
                                for dense, mask in made.items()}
                self._block_mask = made[False]
                self._write(self.dense)
            return self._block_mask

    def token_mask(self) -> torch.Tensor | None:
        """SDPA's boolean mask in the sparse phase, None in the dense one (the path off CUDA)."""
        if self.dense:
            return None
        if self._token_mask is None:
            frame = torch.arange(self.tokens, device=self.device) // self.per_frame
            self._token_mask = self.sparsity.keeps(frame[:, None], frame[None, :])
        return self._token_mask

    def set_dense(self, dense: bool) -> None:
        if dense != self.dense:
            self.dense = dense
            if self._block_mask is not None:
                self._write(dense)

    def _write(self, dense: bool) -> None:
        # In place, on the current stream, before the call's kernels: a recorded graph reads these tensors by address.
        self._flag.fill_(dense)
        for name, table in self._tables[dense].items():
            getattr(self._block_mask, name).copy_(table)


# Plans live as long as the process: a CUDA graph recorded over one reads its tables by address. A few MiB each at
# 720p (its tables three times: live, dense, sparse), one per mask, size and device.
_PLANS: dict = {}
_DENSE: dict = {}  # mask (window, sink) -> whether the model call about to run is in the dense phase
_LOCK = threading.RLock()
_FLEX = None


def plan_for(sparsity: VideoSparsity, tokens: int, per_frame: int, device: torch.device) -> Plan:
    key = (sparsity.mask, tokens, per_frame, device)
    with _LOCK:
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = Plan(sparsity, tokens, per_frame, device)
            plan.set_dense(_DENSE.get(sparsity.mask, False))
        return plan


def set_dense(sparsity: VideoSparsity, dense: bool) -> None:
    """The phase of the model calls that follow, for every size of `sparsity`'s mask (set before each model call:
    ComfyUI samples one model at a time)."""
    with _LOCK:
        _DENSE[sparsity.mask] = dense
        for plan in _PLANS.values():
            if plan.sparsity.mask == sparsity.mask:
                plan.set_dense(dense)


def applies(sparsity: VideoSparsity, q: torch.Tensor, k: torch.Tensor, grid) -> int:
    """Tokens a frame where the mask applies to this call ((batch, heads, tokens, head dim) q and k over `grid`, the
    model's (frames, height, width) token grid): self-attention over the whole grid, sparse enough to pay; else 0."""
    if grid is None or len(grid) != 3:
        return 0
    frames, per_frame = int(grid[0]), int(grid[1]) * int(grid[2])
    tokens = frames * per_frame
    if q.shape[2] != tokens or k.shape[2] != tokens or sparsity.density(frames) > MAX_DENSITY:
        return 0
    return per_frame


@torch.library.custom_op("overdrive::video_attention", mutates_args=())
def video_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, per_frame: int, window: int,
                    sink: int) -> torch.Tensor:
    """(batch, heads, tokens, head dim) q, k, v -> (batch, tokens, heads, head dim), contiguous, as
    overdrive::attention; the mask as the current phase has it."""
    plan = plan_for(VideoSparsity(window, sink), q.shape[2], per_frame, q.device)
    if q.is_cuda and not plan.failed:  # both phases: a CUDA graph recorded in one replays the other's tables
        out = _flex_or_dense(plan, q, k, v)
    else:
        out = _masked_or_dense(plan, q, k, v)
    if not plan.reported and not plan.dense and not capturing():
        _report(plan, q, k, v, out)
    return out.transpose(1, 2).contiguous()


@video_attention.register_fake
def _(q, k, v, per_frame, window, sink):
    batch, heads, tokens, dim = q.shape
    return q.new_empty((batch, tokens, heads, v.shape[-1]))


def _flex_or_dense(plan: Plan, q, k, v) -> torch.Tensor:
    global _FLEX
    try:
        if _FLEX is None:
            from torch.nn.attention.flex_attention import flex_attention
            _FLEX = torch.compile(flex_attention, dynamic=False)
        return _FLEX(q, k, v, block_mask=plan.block_mask())
    except Exception as error:  # noqa: BLE001 - a generation never fails because of an optimization
        if capturing():
            raise  # the recorder runs the block without a graph, and this call again
        return _dense_from_now(plan, q, k, v, error)


def _masked_or_dense(plan: Plan, q, k, v) -> torch.Tensor:
    """Off CUDA: SDPA with the boolean mask (the reference the tests compare), all of it at once."""
    if plan.failed:
        return F.scaled_dot_product_attention(q, k, v)
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=plan.token_mask())
    except Exception as error:  # noqa: BLE001 - a generation never fails because of an optimization
        return _dense_from_now(plan, q, k, v, error)


def _dense_from_now(plan: Plan, q, k, v, error) -> torch.Tensor:
    plan.failed = True
    log.warning("Overdrive sparse video attention failed at %s (%s: %s); this size runs dense attention, your "
                "generation continues.", tuple(q.shape), type(error).__name__, str(error)[:200])
    return F.scaled_dot_product_attention(q, k, v)


def _report(plan: Plan, q, k, v, out) -> None:
    plan.reported = True
    error = relative_error(out, F.scaled_dot_product_attention(q, k, v))
    log.info("Overdrive sparse video attention %s, %d frames of %d tokens: window %d, sink %d, density %.0f%%, error "
             "%.1f%% against dense attention on this call's inputs%s", tuple(q.shape), plan.tokens // plan.per_frame,
             plan.per_frame, plan.sparsity.window, plan.sparsity.sink,
             100 * plan.sparsity.density(plan.tokens // plan.per_frame), 100 * error,
             "" if q.is_cuda else " (SDPA with the mask: off CUDA)")
