"""How a front end hands per-call options to a model and its blocks, described so that the core can route them without
knowing the front end: each host carries its description (stack.Host.call_options; ComfyUI's is
comfy_host/comfy_call_options.py) into what it builds; with none (the diffusers API), models and blocks take no such
options.

A block compiled once for many blocks must not be given options that differ per block (ComfyUI's block index) or that
ask it to run someone else's code (another node's patch); `shared` says what of a call's options it may be given.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Callable, Mapping


def _nothing_shared(options) -> dict:
    return {}


def _no_sigmas(options):
    return None


def _no_patches(options) -> tuple:
    return ()


@dataclasses.dataclass(frozen=True, eq=False)  # one per front end: compared by identity
class CallOptions:
    """keyword: the keyword argument that carries the options (None: there are none).
    shared(options): what of one call's options a shared compiled block may be given: {} (nothing), a smaller dict, or
      None when something in them needs every block to see all of them (the call then runs the block's own code).
    step_sigmas(options): an object that is new at every sampling step (ComfyUI's sigmas tensor), or None.
    patches(options): names of the patches in them that change what a model computes (a key of the UNet mirror's
      verification: calls with other patches are verified again).
    inert: entries no forward reads, left out of a precompiled frame's key ({name: None}), or reduced to what the
      forward does read ({name: function of the entry})."""

    keyword: str | None = None
    shared: Callable = _nothing_shared
    step_sigmas: Callable = _no_sigmas
    patches: Callable = _no_patches
    inert: Mapping = dataclasses.field(default_factory=lambda: types.MappingProxyType({}))

    def of(self, kwargs: dict) -> dict:
        """The options among a call's keyword arguments ({} where there are none)."""
        return (kwargs.get(self.keyword) if self.keyword else None) or {}

    def without(self, kwargs: dict) -> dict:
        """A call's keyword arguments less the options."""
        return {k: v for k, v in kwargs.items() if k != self.keyword}


NO_CALL_OPTIONS = CallOptions()  # a front end whose models take no per-call options (the diffusers API)
