"""What every process running a part of one model call must decide alike, decided from the whole call: within a
call split over every process of the group (`whole_group_call`), `summed_over_the_call` sums a few numbers over them
(one small all-reduce); anywhere else it gives them back as they are. The adaptive step cache's measure of change
sums this way, so each process reuses a step exactly when the model run whole in one process would."""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

_WHOLE_GROUP = contextvars.ContextVar("overdrive_whole_group_call", default=False)


@contextlib.contextmanager
def whole_group_call(active: bool = True):
    """Marks the model call run inside it as one part of a call that every process of the group runs a part of."""
    token = _WHOLE_GROUP.set(active)
    try:
        yield
    finally:
        _WHOLE_GROUP.reset(token)


def in_whole_group_call() -> bool:
    """Whether the current model call is one process's part of a call split over the whole group."""
    return _WHOLE_GROUP.get() and dist.is_initialized()


def summed_over_the_call(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over every process's part of the current call (as they are where the call is not split)."""
    if in_whole_group_call():
        values = values.clone()
        dist.all_reduce(values)
    return values
