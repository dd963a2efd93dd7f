"""The LDM UNet's parameter list (openaimodel.UNetModel with a SpatialTransformer), from a config in
ComfyUI's own terms; ComfyUI's model_detection reads the config back from these shapes.

"tiny" keeps only what detection matches on (comfy/supported_models.py): SD1.5 needs model_channels 320,
context_dim 768 and conv proj_in; SDXL also needs adm_in_channels 2816, linear proj_in and input
transformer depths [0, 0, 2, 2, 10, 10], i.e. 3 levels of 2 res blocks. Everything else shrinks."""
from .tensors import Specs, conv, linear, norm, with_prefix

FULL = {
    "sd15": dict(in_channels=4, out_channels=4, model_channels=320, adm_in_channels=None, context_dim=768,
                 use_linear_in_transformer=False, channel_mult=[1, 2, 4, 4], num_res_blocks=[2, 2, 2, 2],
                 transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                 transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], transformer_depth_middle=1),
    "sdxl": dict(in_channels=4, out_channels=4, model_channels=320, adm_in_channels=2816, context_dim=2048,
                 use_linear_in_transformer=True, channel_mult=[1, 2, 4], num_res_blocks=[2, 2, 2],
                 transformer_depth=[0, 0, 2, 2, 10, 10],
                 transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], transformer_depth_middle=10),
}
# SD1.5: two levels of one res block (107M weights, full 860M); SDXL: every level at 320 channels (283M, full 2.6B).
TINY_OVERRIDES = {
    "sd15": dict(channel_mult=[1, 2], num_res_blocks=[1, 1], transformer_depth=[1, 1],
                 transformer_depth_output=[1, 1, 1, 1]),
    "sdxl": dict(channel_mult=[1, 1, 1]),
}


def unet_config(arch: str, size: str) -> dict:
    return {**FULL[arch], **(TINY_OVERRIDES[arch] if size == "tiny" else {})}


def res_block(ch_in: int, ch_out: int, emb: int) -> Specs:
    out = (norm("in_layers.0", ch_in) + conv("in_layers.2", ch_out, ch_in, 3) + linear("emb_layers.1", ch_out, emb)
           + norm("out_layers.0", ch_out) + conv("out_layers.3", ch_out, ch_out, 3))
    return out + conv("skip_connection", ch_out, ch_in, 1) if ch_in != ch_out else out


def spatial_transformer(ch: int, depth: int, context_dim: int, use_linear: bool) -> Specs:
    # SD1.5 projects with 1x1 convs, SDXL with linears: detection tells them apart by this weight's rank.
    proj = (lambda p: linear(p, ch, ch)) if use_linear else (lambda p: conv(p, ch, ch, 1))
    out = norm("norm", ch) + proj("proj_in")
    for d in range(depth):
        block = (linear("attn1.to_q", ch, ch, bias=False) + linear("attn1.to_k", ch, ch, bias=False)
                 + linear("attn1.to_v", ch, ch, bias=False) + linear("attn1.to_out.0", ch, ch)
                 + linear("ff.net.0.proj", 8 * ch, ch) + linear("ff.net.2", ch, 4 * ch)  # GEGLU: 2 x 4ch out
                 + linear("attn2.to_q", ch, ch, bias=False) + linear("attn2.to_k", ch, context_dim, bias=False)
                 + linear("attn2.to_v", ch, context_dim, bias=False) + linear("attn2.to_out.0", ch, ch)
                 + norm("norm1", ch) + norm("norm2", ch) + norm("norm3", ch))
        out += with_prefix(f"transformer_blocks.{d}.", block)
    return out + proj("proj_out")


def unet_tensors(cfg: dict) -> Specs:
    """Walks the blocks in UNetModel.__init__'s order (same indices, same channel bookkeeping). Each block is
    a TimestepEmbedSequential, i.e. a list of layers numbered 0, 1, ..."""
    c, emb = cfg["model_channels"], 4 * cfg["model_channels"]
    depth_in, depth_out = list(cfg["transformer_depth"]), list(cfg["transformer_depth_output"])

    def transformer(ch, depth):
        return spatial_transformer(ch, depth, cfg["context_dim"], cfg["use_linear_in_transformer"])

    def attention(ch, depth):  # a res block's optional SpatialTransformer
        return [transformer(ch, depth)] if depth else []

    out = linear("time_embed.0", emb, c) + linear("time_embed.2", emb, emb)
    if cfg["adm_in_channels"]:
        out += linear("label_emb.0.0", emb, cfg["adm_in_channels"]) + linear("label_emb.0.2", emb, emb)

    blocks = [[conv("", c, cfg["in_channels"], 3)]]
    skip_channels, ch = [c], c
    for level, mult in enumerate(cfg["channel_mult"]):
        for _ in range(cfg["num_res_blocks"][level]):
            blocks.append([res_block(ch, mult * c, emb)] + attention(mult * c, depth_in.pop(0)))
            ch = mult * c
            skip_channels.append(ch)
        if level != len(cfg["channel_mult"]) - 1:
            blocks.append([conv("op", ch, ch, 3)])  # Downsample: detection counts levels by these
            skip_channels.append(ch)
    out += _blocks("input_blocks.", blocks)

    depth_mid = cfg["transformer_depth_middle"]  # as ComfyUI reads it: -1 a lone res block, -2 no middle block
    if depth_mid >= -1:
        middle = [res_block(ch, ch, emb)]
        if depth_mid >= 0:
            middle += [transformer(ch, depth_mid), res_block(ch, ch, emb)]
        out += _layers("middle_block.", middle)

    blocks = []
    for level, mult in reversed(list(enumerate(cfg["channel_mult"]))):
        for i in range(cfg["num_res_blocks"][level] + 1):
            layers = [res_block(ch + skip_channels.pop(), mult * c, emb)]
            ch = mult * c
            layers += attention(ch, depth_out.pop())
            if level and i == cfg["num_res_blocks"][level]:
                layers.append(conv("conv", ch, ch, 3))  # Upsample
            blocks.append(layers)
    out += _blocks("output_blocks.", blocks)
    return out + norm("out.0", ch) + conv("out.2", cfg["out_channels"], c, 3)


def _layers(prefix: str, layers) -> Specs:
    return [s for i, layer in enumerate(layers) for s in with_prefix(f"{prefix}{i}.", layer)]


def _blocks(prefix: str, blocks) -> Specs:
    return [s for b, layers in enumerate(blocks) for s in _layers(f"{prefix}{b}.", layers)]
