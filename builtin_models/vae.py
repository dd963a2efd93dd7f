"""The SD/SDXL KL autoencoder (comfy/ldm/modules/diffusionmodules/model.py Encoder/Decoder), at the one
config ComfyUI builds for it (comfy/sd.py VAE: ch 128, ch_mult [1, 2, 4, 4], 2 res blocks, 4 latent
channels, attention only in the middle). SD1.5 and SDXL share the shapes; only trained weights differ."""
from .tensors import Specs, conv, norm, with_prefix

CH, CH_MULT, NUM_RES_BLOCKS, Z_CHANNELS, IMAGE_CHANNELS = 128, (1, 2, 4, 4), 2, 4, 3


def resnet(ch_in: int, ch_out: int) -> Specs:
    out = norm("norm1", ch_in) + conv("conv1", ch_out, ch_in, 3) + norm("norm2", ch_out) + conv("conv2", ch_out, ch_out, 3)
    return out + conv("nin_shortcut", ch_out, ch_in, 1) if ch_in != ch_out else out


def middle(ch: int) -> Specs:
    attn = norm("norm", ch) + conv("q", ch, ch, 1) + conv("k", ch, ch, 1) + conv("v", ch, ch, 1) + conv("proj_out", ch, ch, 1)
    return (with_prefix("mid.block_1.", resnet(ch, ch)) + with_prefix("mid.attn_1.", attn)
            + with_prefix("mid.block_2.", resnet(ch, ch)))


def encoder() -> Specs:
    out, ch = conv("conv_in", CH, IMAGE_CHANNELS, 3), CH
    for level, mult in enumerate(CH_MULT):
        for b in range(NUM_RES_BLOCKS):
            out += with_prefix(f"down.{level}.block.{b}.", resnet(ch, CH * mult))
            ch = CH * mult
        if level != len(CH_MULT) - 1:
            out += conv(f"down.{level}.downsample.conv", ch, ch, 3)
    return out + middle(ch) + norm("norm_out", ch) + conv("conv_out", 2 * Z_CHANNELS, ch, 3)  # mean and logvar


def decoder() -> Specs:
    ch = CH * CH_MULT[-1]
    out = conv("conv_in", ch, Z_CHANNELS, 3) + middle(ch)
    for level in reversed(range(len(CH_MULT))):  # up.{level} is numbered as the encoder's, built deepest first
        for b in range(NUM_RES_BLOCKS + 1):
            out += with_prefix(f"up.{level}.block.{b}.", resnet(ch, CH * CH_MULT[level]))
            ch = CH * CH_MULT[level]
        if level != 0:
            out += conv(f"up.{level}.upsample.conv", ch, ch, 3)
    return out + norm("norm_out", ch) + conv("conv_out", IMAGE_CHANNELS, ch, 3)


def vae_tensors() -> Specs:
    return (with_prefix("encoder.", encoder()) + with_prefix("decoder.", decoder())
            + conv("quant_conv", 2 * Z_CHANNELS, 2 * Z_CHANNELS, 1) + conv("post_quant_conv", Z_CHANNELS, Z_CHANNELS, 1))
