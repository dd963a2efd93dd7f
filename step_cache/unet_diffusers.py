"""Full and shallow forwards of diffusers' UNet2DConditionModel (SD1.x, SD2.x, SDXL), duck-typed like the openai
adapter: the model is never mutated, its own submodules and helpers (time/class/aug embeddings, encoder projection,
resnets, transformers, samplers, mid block) do the work, and only UNet2DConditionModel.forward's control flow
(diffusers 0.30-0.39) is mirrored.

Skip branches. diffusers' forward collects one skip per stage on the way down: conv_in, every resnet(+transformer)
layer of every down block, every downsampler; each up-block layer consumes one, last first. Flattened, that is the
openaimodel picture (input_blocks/output_blocks), so `cache_depth` means the same here: `d` keeps the d outermost
branches. `d=1` is DeepCache's Stable Diffusion setting (its diffusers code's cache_layer_id=0, cache_block_id=0):
a shallow step runs conv_in, the last layer of up_blocks[-1] and the output head; the feature cached is the
hidden state entering that last layer.

Calls the mirror does not implement (ControlNet/T2I residuals, GLIGEN, a LoRA `scale` in cross_attention_kwargs,
FreeU, unknown arguments) run the model's own forward; the runner verifies the full path against the model's own
forward on the first full call of each kind. Blocks of other types than the four below are refused at construction.
"""
import torch
import torch.nn as nn

from .config import DeepCacheConfigError
from .paths import CallInfo
from .unet_openai import UnsupportedUNetError
from ..core.weights_watch import WeightsWatch

DOWN_BLOCKS = frozenset(("CrossAttnDownBlock2D", "DownBlock2D"))
UP_BLOCKS = frozenset(("CrossAttnUpBlock2D", "UpBlock2D"))
REQUIRED_ATTRIBUTES = ("conv_in", "time_embedding", "down_blocks", "mid_block", "up_blocks", "conv_out",
                       "num_upsamplers", "get_time_embed", "get_class_embed", "get_aug_embed", "process_encoder_hidden_states", "config")
COND_NAMES = ("class_labels", "timestep_cond", "attention_mask", "cross_attention_kwargs", "added_cond_kwargs",
              "encoder_attention_mask")
RESIDUALS = ("down_block_additional_residuals", "mid_block_additional_residual", "down_intrablock_additional_residuals")
FREEU = ("s1", "s2", "b1", "b2")


def _bind(sample, timestep, encoder_hidden_states, class_labels=None, timestep_cond=None, attention_mask=None,
          cross_attention_kwargs=None, added_cond_kwargs=None, down_block_additional_residuals=None,
          mid_block_additional_residual=None, down_intrablock_additional_residuals=None, encoder_attention_mask=None,
          return_dict=True):
    """UNet2DConditionModel.forward's signature."""
    cond = dict(class_labels=class_labels, timestep_cond=timestep_cond, attention_mask=attention_mask,
                cross_attention_kwargs=cross_attention_kwargs, added_cond_kwargs=added_cond_kwargs,
                encoder_attention_mask=encoder_attention_mask)
    residuals = (down_block_additional_residuals, mid_block_additional_residual, down_intrablock_additional_residuals)
    return sample, timestep, encoder_hidden_states, cond, residuals, return_dict


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class DiffusersUNetPaths(nn.Module):
    """Full ("record the feature at the cache point") and shallow ("reuse it") forwards of one UNet2DConditionModel."""

    def __init__(self, unet: nn.Module, depth: int, num_train_timesteps: int = 1000):
        super().__init__()
        name = type(unet).__name__
        missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(unet, a)]
        if missing:
            raise UnsupportedUNetError(f"{name} is not a diffusers UNet2DConditionModel (missing {missing})")
        kinds = [type(b).__name__ for b in unet.down_blocks] + [type(b).__name__ for b in unet.up_blocks]
        unknown = sorted({k for k in kinds if k not in DOWN_BLOCKS | UP_BLOCKS})
        if unknown or len(unet.down_blocks) != len(unet.up_blocks):
            raise UnsupportedUNetError(
                f"{name} has blocks DeepCache does not mirror ({unknown or 'unequal down/up block counts'}); it "
                f"supports {sorted(DOWN_BLOCKS | UP_BLOCKS)} (SD1.x, SD2.x, SDXL UNets)")
        if unet.config.get("addition_embed_type") == "image_hint":
            raise UnsupportedUNetError(f"{name} uses addition_embed_type='image_hint', which DeepCache does not mirror")
        self.unet = unet
        self._weights = WeightsWatch(unet)  # cheap per-step check that the weights are the same
        self.down_stages, self.up_stages = self._stages(unet)
        n = len(self.down_stages)
        if n != len(self.up_stages):
            raise UnsupportedUNetError(f"{name} has {n} skips down and {len(self.up_stages)} up-block layers; "
                                       "DeepCache needs one layer per skip")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= n:
            raise DeepCacheConfigError(f"cache_depth={depth!r} is out of range for this UNet: it has {n} skip branches "
                                       f"(conv_in, each down-block layer and downsampler), so cache_depth must be in "
                                       f"1..{n}")
        self.depth = depth
        self.num_train_timesteps = num_train_timesteps

    @staticmethod
    def _stages(unet):
        """(block index, layer index or "down"/"in") per skip, and (block index, layer index) per up-block layer."""
        down = [("in", None)]
        for b, block in enumerate(unet.down_blocks):
            down += [(b, j) for j in range(len(block.resnets))]
            if block.downsamplers is not None:
                down.append((b, "down"))
        up = [(b, j) for b, block in enumerate(unet.up_blocks) for j in range(len(block.resnets))]
        return down, up

    @property
    def skip_branches(self) -> int:
        return len(self.down_stages)

    def percent_to_timestep(self, percent: float) -> float:
        """ComfyUI's percent convention (0 = start of sampling, 1 = end) on the training timestep axis."""
        return (1.0 - percent) * (self.num_train_timesteps - 1)

    # -- pieces of UNet2DConditionModel.forward --------------------------------------------------------------------
    def _prepare(self, sample, timestep, encoder_hidden_states, cond):
        unet = self.unet
        masks = {}
        for key in ("attention_mask", "encoder_attention_mask"):
            mask = cond[key]
            masks[key] = None if mask is None else ((1 - mask.to(sample.dtype)) * -10000.0).unsqueeze(1)
        if unet.config.center_input_sample:
            sample = 2 * sample - 1.0
        emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), cond["timestep_cond"])
        class_emb = unet.get_class_embed(sample=sample, class_labels=cond["class_labels"])
        if class_emb is not None:
            emb = torch.cat([emb, class_emb], dim=-1) if unet.config.class_embeddings_concat else emb + class_emb
        aug_emb = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                                     added_cond_kwargs=cond["added_cond_kwargs"])
        emb = emb + aug_emb if aug_emb is not None else emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        context = unet.process_encoder_hidden_states(encoder_hidden_states=encoder_hidden_states,
                                                     added_cond_kwargs=cond["added_cond_kwargs"])
        attention = dict(encoder_hidden_states=context, cross_attention_kwargs=cond["cross_attention_kwargs"],
                         attention_mask=masks["attention_mask"], encoder_attention_mask=masks["encoder_attention_mask"])
        return sample, emb, attention

    def _down(self, index, h, emb, attention):
        b, j = self.down_stages[index]
        if b == "in":
            return self.unet.conv_in(h)
        block = self.unet.down_blocks[b]
        if j == "down":
            for downsampler in block.downsamplers:
                h = downsampler(h)
            return h
        h = block.resnets[j](h, emb)
        if getattr(block, "attentions", None) is not None:
            h = block.attentions[j](h, return_dict=False, **attention)[0]
        return h

    def _up(self, index, h, hs, emb, attention, upsample):
        b, j = self.up_stages[index]
        block = self.unet.up_blocks[b]
        h = torch.cat([h, hs.pop()], dim=1)
        h = block.resnets[j](h, emb)
        if getattr(block, "attentions", None) is not None:
            h = block.attentions[j](h, return_dict=False, **attention)[0]
        if j == len(block.resnets) - 1 and block.upsamplers is not None:
            size = hs[-1].shape[2:] if (upsample and hs and b < len(self.unet.up_blocks) - 1) else None
            for upsampler in block.upsamplers:
                h = upsampler(h, size)
        return h

    def _finish(self, h):
        unet = self.unet
        if unet.conv_norm_out:
            h = unet.conv_act(unet.conv_norm_out(h))
        return unet.conv_out(h)

    def _upsample_size_needed(self, sample) -> bool:
        factor = 2 ** self.unet.num_upsamplers
        return any(dim % factor != 0 for dim in sample.shape[-2:])

    # -- the two paths (compile these) ---------------------------------------------------------------------------
    def full_forward(self, sample, timestep, encoder_hidden_states, **cond):
        """UNet2DConditionModel.forward (no residuals); returns (output sample, the h entering up layer N - depth)."""
        cond = {name: cond.get(name) for name in COND_NAMES}
        upsample = self._upsample_size_needed(sample)
        h, emb, attention = self._prepare(sample, timestep, encoder_hidden_states, cond)
        n = len(self.down_stages)
        hs = []
        for index in range(n):
            h = self._down(index, h, emb, attention)
            hs.append(h)
        mid = self.unet.mid_block
        if mid is not None:
            h = mid(h, emb, **attention) if getattr(mid, "has_cross_attention", False) else mid(h, emb)
        feature = None
        for index in range(n):
            if index == n - self.depth:
                feature = h
            h = self._up(index, h, hs, emb, attention, upsample)
        return self._finish(h), feature

    def shallow_forward(self, cached, sample, timestep, encoder_hidden_states, **cond):
        """The outer `depth` skip branches around `cached` (the feature full_forward returned at the last full step)."""
        cond = {name: cond.get(name) for name in COND_NAMES}
        upsample = self._upsample_size_needed(sample)
        h, emb, attention = self._prepare(sample, timestep, encoder_hidden_states, cond)
        n = len(self.down_stages)
        hs = []
        for index in range(self.depth):
            h = self._down(index, h, emb, attention)
            hs.append(h)
        h = cached
        for index in range(n - self.depth, n):
            h = self._up(index, h, hs, emb, attention, upsample)
        return self._finish(h)

    # -- reading calls -------------------------------------------------------------------------------------------
    def inspect(self, args: tuple, kwargs: dict) -> CallInfo:
        try:
            sample, timestep, context, cond, residuals, return_dict = _bind(*args, **kwargs)
        except TypeError as error:  # the model's own forward raises the real error
            return CallInfo(sigma=torch.zeros(1), run_key=(), layout=(), path_args=(), path_kwargs={},
                            unsupported=f"arguments UNet2DConditionModel.forward does not take ({error})")
        sigma = timestep if isinstance(timestep, torch.Tensor) else torch.tensor(float(timestep))
        present = {k: v for k, v in cond.items() if v is not None}
        conditioning = [context] + [t for v in present.values() for t in _tensors(v)]
        layout = (sample.shape[0],) + tuple(tuple(t.shape) for t in conditioning)
        fingerprint = [t.detach().reshape(t.shape[0], -1).sum(dim=1, dtype=torch.float64)
                       for t in conditioning if t.ndim > 0 and t.shape[0] > 0 and t.numel() > 0]
        info = CallInfo(sigma=sigma, run_key=(tuple(sample.shape[1:]), sample.dtype, sample.device,
                                              self.weights_token()),
                        layout=layout, fingerprint=fingerprint, path_args=(sample, timestep, context),
                        path_kwargs=present, kind=(str(sample.dtype), tuple(sorted(present))),
                        finish=_output_wrapper(return_dict))
        info.unsupported = self._unsupported(cond, residuals)
        return info

    def weights_token(self) -> int:
        return self._weights.token()

    def _unsupported(self, cond, residuals) -> str | None:
        if any(r is not None for r in residuals):
            return "ControlNet/T2I-Adapter residuals reach the skipped blocks"
        extra = cond["cross_attention_kwargs"] or {}
        if extra.get("gligen") is not None:
            return "GLIGEN (cross_attention_kwargs['gligen'])"
        if extra.get("scale") is not None:
            return "a LoRA scale in cross_attention_kwargs (the model's own forward applies it)"
        if any(all(getattr(block, a, None) for a in FREEU) for block in self.unet.up_blocks):
            return "FreeU is enabled on the UNet"
        return None

    # -- the model's own forward ---------------------------------------------------------------------------------
    def native_forward(self, *args, **kwargs):
        # The class's forward: the instance attribute may be the DeepCache runner itself.
        return type(self.unet).forward(self.unet, *args, **kwargs)

    def reference_forward(self, args: tuple, kwargs: dict) -> torch.Tensor:
        sample, timestep, context, cond, residuals, _ = _bind(*args, **kwargs)
        return type(self.unet).forward(self.unet, sample, timestep, context, **cond, **dict(zip(RESIDUALS, residuals)),
                                       return_dict=False)[0]


def _output_wrapper(return_dict: bool):
    """The native forward's return type: UNet2DConditionOutput(sample=...) or a 1-tuple."""
    if not return_dict:
        return lambda out: (out,)
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput
    return lambda out: UNet2DConditionOutput(sample=out)
