"""Full and shallow forwards of an openaimodel-style UNet (ComfyUI's UNetModel), duck-typed: no ComfyUI import.

Design: this module *mirrors* UNetModel.forward (ComfyUI 0.7.0's; tests/test_deepcache.py checks full steps against
the model's own forward) instead of mutating the model. Every block is
still called through ComfyUI's own `forward_timestep_embed` and `timestep_embedding`, injected by the adapter, so
what happens inside blocks (attention patches and replacements, quantized or otherwise swapped layers, weight
casting) is ComfyUI's code. The two paths are methods of a small nn.Module that holds the UNet, so each can be
compiled on its own (torch.compile, or overdrive.compiler.CompiledMethod(paths, "full_forward"/"shallow_forward")):
one graph each, the cached feature being an ordinary tensor input of the shallow graph. Nothing shared is mutated
during a call, so no lock is needed around the model.

A mirror can drift from a newer ComfyUI's forward. Three guards keep that loud rather than silent:
  * `inspect` refuses (the runner then runs the model's own forward for that call) any call carrying something
    the mirror does not implement: ControlNet/T2I `control` residuals, `transformer_options["patches"]` keys it does
    not know, diffusion-model wrappers (ComfyUI >= 0.3), unknown extra model inputs;
  * the runner compares full_forward against the model's own forward on the first full call of each kind
    (DeepCacheConfig.verify) and switches DeepCache off for the model, with an error in the log, if they differ;
  * the model must have the openaimodel attributes, checked at construction.

Shallow path with depth d (N = len(input_blocks) = len(output_blocks)): input_blocks[:d] run and push their skips,
then output_blocks[N-d:] run starting from the cached `h` that entered output_blocks[N-d] at the last full step,
then `out`. transformer_options["block"] carries the real block ids and "transformer_index" is advanced past the
skipped transformers, so per-block patches see the same indices as in a full forward.
"""
import torch
import torch.nn as nn

from ..core.errors import OverdriveError
from .clock import STEP_CLOCK, StepClock
from .config import DeepCacheConfigError
from .paths import CallInfo
from ..core.weights_watch import WeightsWatch

# transformer_options["patches"] keys implemented by the mirrored forward itself.
FORWARD_PATCHES = ("input_block_patch", "input_block_patch_after_skip", "output_block_patch")
# Keys consumed inside blocks (by ComfyUI's own code, which both paths call): safe on kept blocks.
INNER_PATCHES = ("attn1_patch", "attn2_patch", "attn1_output_patch", "attn2_output_patch", "middle_patch",
                 "forward_timestep_embed_patch")
KNOWN_PATCHES = frozenset(FORWARD_PATCHES + INNER_PATCHES)
# Extra model inputs (kwargs of UNetModel.forward) the mirror passes on.
KNOWN_KWARGS = frozenset(("num_video_frames", "image_only_indicator", "time_context"))
REQUIRED_ATTRIBUTES = ("input_blocks", "middle_block", "output_blocks", "out", "time_embed", "model_channels",
                       "num_classes")
TRANSFORMER_CLASS_NAMES = frozenset(("SpatialTransformer", "SpatialVideoTransformer"))


class UnsupportedUNetError(OverdriveError, TypeError):
    """The module is not an openaimodel-style UNet DeepCache can run."""


def _count_transformers(block) -> int:
    """How often forward_timestep_embed advances transformer_index in this block (its direct transformer layers)."""
    if block is None:
        return 0
    return sum(1 for layer in block.children()
               if any(cls.__name__ in TRANSFORMER_CLASS_NAMES for cls in type(layer).__mro__))


def _has_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _inert(patch_list) -> bool:
    """Entries that only ride along in transformer_options["patches"] (e.g. QuantizeModel's device follower) and
    never run inside the forward declare `forward_inert = True`."""
    return all(getattr(p, "forward_inert", False) for p in patch_list)


def _bind(x, timesteps=None, context=None, y=None, control=None, transformer_options=None, **kwargs):
    """UNetModel.forward's signature."""
    return x, timesteps, context, y, control, transformer_options, kwargs


class OpenAIUNetPaths(nn.Module):
    """Full ("record the feature at the cache point") and shallow ("reuse it") forwards of one UNetModel.

    forward_timestep_embed: comfy.ldm.modules.diffusionmodules.openaimodel.forward_timestep_embed
    timestep_embedding: comfy.ldm.modules.diffusionmodules.util.timestep_embedding
    """

    def __init__(self, unet: nn.Module, depth: int, forward_timestep_embed, timestep_embedding):
        super().__init__()
        missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(unet, a)]
        if missing:
            raise UnsupportedUNetError(f"{type(unet).__name__} is not an openaimodel-style UNet (missing {missing})")
        n_in, n_out = len(unet.input_blocks), len(unet.output_blocks)
        if n_in != n_out or n_in == 0:
            raise UnsupportedUNetError(f"{type(unet).__name__} has {n_in} input blocks and {n_out} output blocks; "
                                       "DeepCache needs one output block per input block (one skip each)")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= n_in:
            raise DeepCacheConfigError(f"cache_depth={depth!r} is out of range for this UNet: it has {n_in} skip "
                                       f"branches (input/output block pairs), so cache_depth must be in 1..{n_in}")
        self.unet = unet
        self._weights = WeightsWatch(unet)  # cheap per-step check that the weights are the same
        self.depth = depth
        self.forward_timestep_embed = forward_timestep_embed
        self.timestep_embedding = timestep_embedding
        self.refresh()

    @property
    def skip_branches(self) -> int:
        return len(self.unet.input_blocks)

    def refresh(self) -> None:
        """Recount the transformers a shallow step skips (call after replacing whole blocks)."""
        unet, d = self.unet, self.depth
        n = len(unet.input_blocks)
        self.skipped_transformers = (sum(_count_transformers(b) for b in list(unet.input_blocks)[d:])
                                     + _count_transformers(unet.middle_block)
                                     + sum(_count_transformers(b) for b in list(unet.output_blocks)[:n - d]))

    # -- the two paths (compile these) ---------------------------------------------------------------------------
    def _embed(self, x, timesteps, y, transformer_options):
        unet = self.unet
        transformer_options["original_shape"] = list(x.shape)
        transformer_options["transformer_index"] = 0
        assert (y is not None) == (unet.num_classes is not None), \
            "must specify y if and only if the model is class-conditional"
        t_emb = self.timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype)
        emb = unet.time_embed(t_emb)
        if unet.num_classes is not None:
            assert y.shape[0] == x.shape[0]
            emb = emb + unet.label_emb(y)
        return emb

    def _video_kwargs(self, kwargs):
        frames = kwargs.get("num_video_frames", getattr(self.unet, "default_num_video_frames", None))
        return dict(time_context=kwargs.get("time_context", None), num_video_frames=frames,
                    image_only_indicator=kwargs.get("image_only_indicator", None))

    def _input_block(self, index, h, emb, context, transformer_options, patches, video):
        transformer_options["block"] = ("input", index)
        h = self.forward_timestep_embed(self.unet.input_blocks[index], h, emb, context, transformer_options, **video)
        for p in patches.get("input_block_patch", ()):
            h = p(h, transformer_options)
        skip = h
        for p in patches.get("input_block_patch_after_skip", ()):
            h = p(h, transformer_options)
        return h, skip

    def _output_block(self, index, h, hs, emb, context, transformer_options, patches, video):
        transformer_options["block"] = ("output", index)
        hsp = hs.pop()
        for p in patches.get("output_block_patch", ()):
            h, hsp = p(h, hsp, transformer_options)
        h = torch.cat([h, hsp], dim=1)
        del hsp
        output_shape = hs[-1].shape if len(hs) > 0 else None
        return self.forward_timestep_embed(self.unet.output_blocks[index], h, emb, context, transformer_options,
                                           output_shape, **video)

    def _finish(self, h, x):
        h = h.type(x.dtype)
        if getattr(self.unet, "predict_codebook_ids", False):
            return self.unet.id_predictor(h)
        return self.unet.out(h)

    def full_forward(self, x, timesteps, context=None, y=None, transformer_options=None, **kwargs):
        """UNetModel.forward without `control`; returns (output, the h entering output_blocks[N - depth])."""
        transformer_options = {} if transformer_options is None else transformer_options
        patches = transformer_options.get("patches", {})
        video = self._video_kwargs(kwargs)
        emb = self._embed(x, timesteps, y, transformer_options)
        unet = self.unet
        n = len(unet.input_blocks)
        cut = n - self.depth
        hs = []
        h = x
        for index in range(n):
            h, skip = self._input_block(index, h, emb, context, transformer_options, patches, video)
            hs.append(skip)
        transformer_options["block"] = ("middle", 0)
        if unet.middle_block is not None:
            h = self.forward_timestep_embed(unet.middle_block, h, emb, context, transformer_options, **video)
        feature = h
        for index in range(n):
            if index == cut:
                # An output_block_patch may write into h in place (FreeU does): keep the cache its own copy.
                feature = h.clone() if patches.get("output_block_patch") else h
            h = self._output_block(index, h, hs, emb, context, transformer_options, patches, video)
        return self._finish(h, x), feature

    def shallow_forward(self, cached, x, timesteps, context=None, y=None, transformer_options=None, **kwargs):
        """The outer `depth` skip branches around `cached` (the feature full_forward returned at the last full step)."""
        transformer_options = {} if transformer_options is None else transformer_options
        patches = transformer_options.get("patches", {})
        video = self._video_kwargs(kwargs)
        emb = self._embed(x, timesteps, y, transformer_options)
        n = len(self.unet.input_blocks)
        hs = []
        h = x
        for index in range(self.depth):
            h, skip = self._input_block(index, h, emb, context, transformer_options, patches, video)
            hs.append(skip)
        if "transformer_index" in transformer_options:
            transformer_options["transformer_index"] += self.skipped_transformers
        h = cached.clone() if patches.get("output_block_patch") else cached
        for index in range(n - self.depth, n):
            h = self._output_block(index, h, hs, emb, context, transformer_options, patches, video)
        return self._finish(h, x)

    # -- reading calls -------------------------------------------------------------------------------------------
    def inspect(self, args: tuple, kwargs: dict) -> CallInfo:
        x, timesteps, context, y, control, transformer_options, extra = _bind(*args, **kwargs)
        options = transformer_options if transformer_options is not None else {}
        sigmas = options.get("sigmas")
        sigma = sigmas if isinstance(sigmas, torch.Tensor) else timesteps
        sample_sigmas = options.get("sample_sigmas")
        cond_or_uncond = options.get("cond_or_uncond")
        layout = (x.shape[0], tuple(cond_or_uncond) if cond_or_uncond is not None else None,
                  tuple(context.shape) if isinstance(context, torch.Tensor) else None,
                  tuple(y.shape) if isinstance(y, torch.Tensor) else None)
        fingerprint = [t.detach().reshape(t.shape[0], -1).sum(dim=1, dtype=torch.float64)
                       for t in (context, y) if isinstance(t, torch.Tensor) and t.ndim > 0 and t.shape[0] > 0]
        run_key = (tuple(x.shape[1:]), x.dtype, x.device, self.weights_token())
        info = CallInfo(sigma=sigma, run_key=run_key, layout=layout, fingerprint=fingerprint,
                        path_args=(x, timesteps),
                        path_kwargs=dict(context=context, y=y, transformer_options=options, **extra),
                        sample_sigmas=sample_sigmas if isinstance(sample_sigmas, torch.Tensor) else None)
        info.unsupported = self._unsupported(timesteps, control, options, extra)
        uuids = options.get("uuids")
        if isinstance(options.get(STEP_CLOCK), StepClock) and isinstance(uuids, list) and uuids:
            info.clock, info.host_fingerprint = options[STEP_CLOCK], tuple(uuids)  # one uuid per cond in the batch
        return info

    def weights_token(self) -> int:
        return self._weights.token()

    def _unsupported(self, timesteps, control, options, extra) -> str | None:
        if not isinstance(timesteps, torch.Tensor):
            return "no timesteps tensor"
        if control is not None and _has_tensor(control):
            return "ControlNet/T2I-Adapter residuals (control) reach the skipped blocks"
        patches = options.get("patches") or {}
        unknown = sorted(k for k, v in patches.items() if v and k not in KNOWN_PATCHES and not _inert(v))
        if unknown:
            return f"transformer_options patches DeepCache does not implement: {unknown}"
        wrappers = options.get("wrappers")
        if isinstance(wrappers, dict) and wrappers.get("diffusion_model"):
            return "diffusion_model wrappers in transformer_options"
        unknown_kwargs = sorted(set(extra) - KNOWN_KWARGS)
        if unknown_kwargs:
            return f"model inputs DeepCache does not pass on: {unknown_kwargs}"
        return None

    # -- the model's own forward ---------------------------------------------------------------------------------
    def native_forward(self, *args, **kwargs):
        # The class's forward: the instance attribute may be the DeepCache runner itself (ModelPatcher object patch).
        return type(self.unet).forward(self.unet, *args, **kwargs)

    def reference_forward(self, args: tuple, kwargs: dict) -> torch.Tensor:
        x, timesteps, context, y, control, transformer_options, extra = _bind(*args, **kwargs)
        options = dict(transformer_options) if transformer_options is not None else {}
        return type(self.unet).forward(self.unet, x, timesteps, context=context, y=y, control=None,
                                       transformer_options=options, **extra)
