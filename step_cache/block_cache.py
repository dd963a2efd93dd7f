"""A step cache for DiTs: on reused steps only the first blocks run, and the rest of the block stacks is replaced by
the residual they added at the last full step (DeepCache's idea on a DiT's block stack, as in Δ-DiT/FORA; the
adaptive mode decides per step from the first blocks' output, as first-block caching, TeaCache and EasyCache do).

The cut is per stack, so no family needs its glue code mirrored: on a full step each stack's skipped part records
`residual = output of its last block - input of its first skipped block`, per carried stream. On a reused step every
skipped block hands its inputs through unchanged and the stack's last block returns them plus that residual; whatever
the model does between stacks (Flux concatenates text and image tokens) runs as usual on the approximated states.

Steps and runs follow `DeepCacheSchedule` (every call at one sigma shares its step's decision; a rising sigma or a
new run key starts a new run and drops every residual). Residuals and the adaptive reference are kept per branch
(ComfyUI's cond_or_uncond and the streams' shapes), so batched and separate cond/uncond calls each reuse their own.

Adaptive mode: after block `cache_depth - 1` the image stream's mean absolute change since the last full step,
relative to its mean magnitude, is compared with `threshold`. Reading that number is one GPU->host sync per step:
the GPU finishes the first blocks while the host waits, then the host queues the rest (one block's launch time).
Calibrated mode decides so at the first run of a schedule (run key and sigma) and replays its decisions on later runs
of that schedule, with no sync (MagCache's observation: the change curve is the model's and its schedule's far more
than the prompt's).
"""
from dataclasses import dataclass

import torch

from ..parallel.agreement import in_whole_group_call, summed_over_the_call
from .config import DeepCacheConfig, DeepCacheConfigError
from .schedule import DeepCacheSchedule


@dataclass(frozen=True)
class BlockRole:
    block_stack: object    # families.BlockStack
    stack_index: int
    skippable: bool        # at or after block `cache_depth` of the cached stacks
    first_skipped: bool    # the first skippable block of its stack: its inputs start the stack's residual
    last: bool             # the last block of its stack: it adds the residual on reused steps


def block_roles(stacks: list, depth: int) -> list[BlockRole]:
    """Roles of the cached stacks' blocks in run order; `stacks` is [(block stack, number of blocks)]."""
    total = sum(n for _, n in stacks)
    if not 1 <= depth < total:
        raise DeepCacheConfigError(f"cache_depth={depth} is out of range for this model: its cached blocks number "
                                   f"{total}, so cache_depth must be in 1..{total - 1} (how many of the first blocks "
                                   "run on every step)")
    roles, position = [], 0
    for index, (block_stack, n) in enumerate(stacks):
        first_skippable = max(depth - position, 0)
        for i in range(n):
            roles.append(BlockRole(block_stack, index, i >= first_skippable, i == first_skippable, i == n - 1))
        position += n
    return roles


def relative_change(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Mean absolute change over mean magnitude; over every process's part where a call is split (Parallel Model),
    so that they all decide as the call run whole would."""
    sums = summed_over_the_call(torch.stack([(value.float() - reference.float()).abs().sum(),
                                             reference.float().abs().sum()]))
    change, magnitude = sums.tolist()
    return change / max(magnitude, 1e-12 * reference.numel())


class BlockStepCache:
    """The per-call state machine; `BlockwiseForward` calls `begin`, `block` for each cached block, then `end`."""

    def __init__(self, config: DeepCacheConfig, stacks: list, percent_to_sigma=None, learned: dict | None = None):
        self.config = config
        self.roles = block_roles(stacks, config.cache_depth)
        self.schedule = DeepCacheSchedule(config, percent_to_sigma)
        self._residuals: dict = {}   # (branch, stack index) -> {stream: tensor or None}
        self._entries: dict = {}     # (branch, stack index) -> {stream: tensor} at the first skipped block (full steps)
        self._references: dict = {}  # branch -> probe at the last full step (adaptive)
        # (run key, sigma) -> full, decided by measure (calibrated: replayed); a host may share one over the forwards it
        # builds for the same model and settings, so that a LoRA or prompt change, which runs the node chain again,
        # replays instead of measuring again
        self._learned: dict = {} if learned is None else learned
        self._call = None
        self.changes: list = []      # the adaptive mode's measured change at each decided step of the current run

    @property
    def stats(self):
        return self.schedule.stats

    @property
    def last_stats(self):
        return self.schedule.last_stats

    def reset(self, new_weights: bool = False) -> None:
        """End the current run (logging its summary) and drop every residual; the next call starts a new run. After
        `new_weights` the calibrated decisions go too: they were measured on the old weights."""
        self.schedule.reset()
        self._drop()
        if new_weights:
            self._learned.clear()

    def _drop(self) -> None:
        self._residuals.clear()
        self._entries.clear()
        self._references.clear()

    def begin(self, read_step) -> None:
        """Start a call whose step is decided when a block first needs it (the first skipped block, or the adaptive
        probe): `read_step()` -> (sigma, run key, branch, why the call cannot be cached or None); one sigma per call,
        as ComfyUI's per-sample sigmas agree within a batch. Reading a sigma from the GPU waits for the previous step
        to finish; this late, the host has queued the first blocks by then."""
        self._call = {"read": read_step}

    def _decided(self) -> dict:
        call = self._call
        if "read" in call:
            sigma, run_key, branch, unsupported = call["read"]()  # may raise: the call then stays undecided
            del call["read"]
            call.update(self._decide(sigma, run_key, branch, unsupported))
        return call

    def _decide(self, sigma: float, run_key, branch, unsupported: str | None) -> dict:
        decision = self.schedule.decide(sigma, run_key)
        if decision.new_run:
            self._drop()
            self.changes = []
        # Within a call split over the group every process measures, as one run whole would: their decisions learned
        # so far may differ (a worker restarted), and a replaying process would skip the measure's all-reduce.
        replay = self.config.mode == "calibrated" and not in_whole_group_call()
        learned = self._learned.get((run_key, sigma)) if replay else None
        open_step = decision.new_step and not decision.full  # this call decides the step
        if open_step and learned is not None:  # replayed: nothing measured, no sync
            self.schedule.settle(full=learned)
        pending = self.config.measured and open_step and learned is None and unsupported is None
        reuse = not decision.full and not learned and not pending and unsupported is None
        if reuse and not self._recorded(branch):
            reuse, unsupported = False, "no residual recorded for this batch layout"
        return {"branch": branch, "reuse": reuse, "pending": pending, "full_step": decision.full or bool(learned),
                "unsupported": unsupported, "step": (run_key, sigma)}

    def block(self, position: int, args: tuple, kwargs: dict, run):
        """Block `position` of the cached stacks: run it (`run()`), or stand in for it on a reused step."""
        role = self.roles[position]
        if not role.skippable:
            out = run()
            if position == self.config.cache_depth - 1 and self.config.measured:
                self._probe(self._decided(), role.block_stack.named(out)[role.block_stack.probed])
            return out
        call = self._decided()
        slot = (call["branch"], role.stack_index)
        if call["reuse"]:
            carried = role.block_stack.carried(args, kwargs)
            if not role.last:
                return role.block_stack.output({name: carried.get(name) for name in role.block_stack.returned})
            residual = self._residuals[slot]
            return role.block_stack.output({name: None if r is None else carried[name] + r for name, r in residual.items()})
        if role.first_skipped:  # copies: Flux's blocks add to their inputs in place (`img += ...`)
            self._entries[slot] = {name: None if value is None else value.clone()
                                   for name, value in role.block_stack.carried(args, kwargs).items()}
        out = run()
        if role.last:
            entry = self._entries.pop(slot)
            self._residuals[slot] = {name: None if value is None else value - entry[name]
                                     for name, value in role.block_stack.named(out).items()}
            self.stats.note_kept(self.kept_bytes())
        return out

    def kept_bytes(self) -> int:
        """What the cache holds between steps: per branch (cond, uncond), each stack's residual (one activation per
        stream it carries) and the adaptive probe's reference (one image-stream activation)."""
        kept = [t for residual in self._residuals.values() for t in residual.values() if t is not None]
        kept += list(self._references.values())
        return sum(t.nbytes for t in kept)

    def _recorded(self, branch) -> bool:
        """Whether the last full step left a residual for every stack that has skipped blocks."""
        return all((branch, role.stack_index) in self._residuals for role in self.roles if role.last and role.skippable)

    def _probe(self, call, probe: torch.Tensor) -> None:
        """Adaptive mode: the first blocks' output (its image stream) decides the step (and, on full steps, becomes
        the reference)."""
        branch = call["branch"]
        if call["pending"]:
            reference = self._references.get(branch)
            change = relative_change(probe, reference) if (
                reference is not None and reference.shape == probe.shape) else None
            self.changes.append(change)
            reuse = change is not None and self._recorded(branch) and change < self.config.threshold
            self.schedule.settle(full=not reuse)
            if change is not None and self.config.mode == "calibrated":
                self._learn(call["step"], full=not reuse)
            call["reuse"], call["pending"] = reuse, False
        if not call["reuse"]:
            self._references[branch] = probe.detach().clone()

    def _learn(self, step, full: bool) -> None:
        """Keep a measured decision for later runs of its schedule; a few schedules' worth (a user's sizes and step
        counts), the oldest dropped first."""
        if len(self._learned) >= 4096:
            del self._learned[next(iter(self._learned))]
        self._learned[step] = full

    def end(self, completed: bool = True) -> None:
        """Close the call. One that failed before its step was decided leaves no trace in the run."""
        undecided = "read" in self._call
        call = None if undecided and not completed else self._decided()
        self._call = None
        if call is None:
            return
        if call["unsupported"] is not None:
            self.schedule.note_call("full" if call["full_step"] else "fallback", call["unsupported"])
        else:
            self.schedule.note_call("shallow" if call["reuse"] else "full")
