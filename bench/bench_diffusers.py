"""GPU benchmark of overdrive.api on a diffusers StableDiffusionXLPipeline: eager, the peer (torch.compile of the UNet
and VAE decode as diffusers' "accelerate inference" tutorial does it: channels_last, mode="max-autotune",
fullgraph=True) and Overdrive (compile_, + quantize_, + deepcache_), in one process, same seed.

  python bench/bench_diffusers.py --out bench/results/DATE_h100_diffusers_sdxl1024.json
  python bench/bench_diffusers.py --tiny --device cpu          # smoke test of every variant (Dynamo without Inductor)

The UNet and VAE are diffusers' SDXL classes at SDXL base 1.0's config values with fixed-seed random weights (each
variant builds the UNet again from the seed: identical weights, nothing left over from the previous variant). The
text encoders are not called: random prompt_embeds / pooled_prompt_embeds of SDXL's shapes (77x2048, 1280) stand in
for them. Reported per variant: s/image (median of --repeats, whole pipeline call incl. VAE decode), first run
(includes compiling; Inductor's caches start empty in a temp folder at the start of the process, so only the first
compiled variant's figure is truly cold: later ones reuse the kernels and graphs it compiled; compare cold compile
times only between variants run first, in separate processes), warm compile (after
torch._dynamo.reset(), with Inductor's and Overdrive's disk caches filled: what a restarted process pays), peak VRAM,
relative error of the final latent (and image) vs eager, Dynamo graphs; plus GPU and torch/triton versions.
"""
import gc
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from diffusers_runs import parser_for, run_variants, settle  # noqa: E402
from report import environment, finish, profile_run  # noqa: E402

# the defaults (regions, the saved guard-free frame), one flat graph, max-autotune, no saved frame (Dynamo's guards)
COMPILES = ("overdrive", "overdrive-flat", "overdrive-autotune", "overdrive-no-precompile")
VARIANTS = ("eager", "peer", *COMPILES, *(f"{c}+quant" for c in COMPILES), "overdrive+quant+deepcache",
            "overdrive-no-precompile+quant+deepcache")
SDXL_UNET = dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
                 use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                 projection_class_embeddings_input_dim=2816, norm_num_groups=32)
SDXL_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, sample_size=1024,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                scaling_factor=0.13025, force_upcast=False)
TINY_UNET = dict(SDXL_UNET, sample_size=8, layers_per_block=1, block_out_channels=(32, 64),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                 transformer_layers_per_block=(1, 1), attention_head_dim=(4, 8), cross_attention_dim=64,
                 addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 32, norm_num_groups=8)
TINY_VAE = dict(SDXL_VAE, block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8, sample_size=64, layers_per_block=1)
EMBEDS = {"full": (77, 2048, 1280), "tiny": (8, 64, 32)}  # tokens, context width, pooled width


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_unet(args):
    from diffusers import UNet2DConditionModel
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        unet = UNet2DConditionModel(**(TINY_UNET if args.tiny else SDXL_UNET))
    return unet.to(args.dtype).eval().requires_grad_(False)


def build_pipeline(args):
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline
    torch.manual_seed(args.seed + 1)
    with torch.device(args.device):
        vae = AutoencoderKL(**(TINY_VAE if args.tiny else SDXL_VAE))
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       timestep_spacing="leading", steps_offset=1)
    pipe = StableDiffusionXLPipeline(vae=vae.to(args.dtype).eval().requires_grad_(False), text_encoder=None,
                                     text_encoder_2=None, tokenizer=None, tokenizer_2=None, unet=build_unet(args),
                                     scheduler=scheduler, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_inputs(args) -> dict:
    """Random stand-ins for the two text encoders' outputs (fixed seed), positive and negative."""
    tokens, width, pooled = EMBEDS["tiny" if args.tiny else "full"]
    g = torch.Generator().manual_seed(args.seed + 2)
    make = lambda *shape: torch.randn(1, *shape, generator=g).to(args.device, args.dtype)  # noqa: E731
    return {"prompt_embeds": make(tokens, width), "negative_prompt_embeds": make(tokens, width),
            "pooled_prompt_embeds": make(pooled), "negative_pooled_prompt_embeds": make(pooled)}


def generate(pipe, args, embeds, output_type="np"):
    """One image; returns (image, final latent, seconds)."""
    final = {}

    def keep_latent(pipeline, step, timestep, callback_kwargs):
        final["latent"] = callback_kwargs["latents"]
        return callback_kwargs

    sync()
    start = time.perf_counter()
    image = pipe(**embeds, height=args.res, width=args.res, num_inference_steps=args.steps,
                 guidance_scale=args.guidance, output_type=output_type, callback_on_step_end=keep_latent,
                 generator=torch.Generator().manual_seed(args.seed)).images
    sync()
    return torch.as_tensor(image), final["latent"].float().cpu(), time.perf_counter() - start


def compile_options(variant, args):
    """Overdrive's CompileOptions for `variant` ("overdrive-flat": one graph, no regions; "overdrive-autotune":
    Inductor's max-autotune, which benchmarks Triton GEMM/conv templates against cuBLAS/cuDNN on this GPU;
    "overdrive-no-precompile": the UNet call goes through torch.compile and Dynamo's guards, no saved frame)."""
    from overdrive.api import CompileOptions
    parts = variant.split("+")
    return CompileOptions(mode="max-autotune" if "overdrive-autotune" in parts else args.mode,
                          cuda_graphs=args.device == "cuda", backend=args.backend, regional="overdrive-flat" not in parts,
                          precompile="overdrive-no-precompile" not in parts)


def apply_variant(pipe, variant, args, embeds) -> dict:
    """Install `variant` on a pipeline with a fresh UNet; returns what it reported (quantization, DeepCache)."""
    from overdrive.api import DeepCacheConfig, QuantConfig, compile_, deepcache_, quantize_
    info = {}
    if variant == "peer":
        pipe.unet.to(memory_format=torch.channels_last)
        pipe.vae.to(memory_format=torch.channels_last)
        kwargs = dict(mode=args.peer_mode, fullgraph=True, backend=args.backend)
        if args.backend != "inductor":
            kwargs.pop("mode")
        pipe.unet = torch.compile(pipe.unet, **kwargs)
        pipe.vae.decode = torch.compile(pipe.vae.decode, **kwargs)
        return info
    parts = variant.split("+")
    if "quant" in parts:
        config = QuantConfig(format=args.quant_format, **({} if args.density is None else
                                                          {"compute_density_threshold": args.density}))
        start = time.perf_counter()
        report = quantize_(pipe, config, calibration=dict(embeds, height=args.res, width=args.res,
                                                          guidance_scale=args.guidance))
        info["quantize_s"] = round(time.perf_counter() - start, 2)
        info["quantization"] = report.summary()
    if set(parts) & set(COMPILES):
        compile_(pipe, compile_options(variant, args))
    if "deepcache" in parts:
        info["runner"] = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=args.cache_interval))
    return info


def reset_pipeline(pipe, args):
    """Back to eager with a freshly built UNet (same seed, same weights) and the VAE's own decode."""
    pipe.vae.__dict__.pop("decode", None)
    pipe.vae.to(memory_format=torch.contiguous_format)
    pipe.unet = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    pipe.unet = build_unet(args)


def warm_compile_s(pipe, variant, args, embeds, per_image) -> float:
    """A restart's compile cost: forget every compiled graph in memory, compile again from the disk caches."""
    from overdrive.api import compile_
    from overdrive.compiler import clear_shared_graphs
    torch._dynamo.reset()
    clear_shared_graphs()
    if variant != "peer":
        compile_(pipe, compile_options(variant, args))
    _, _, first = generate(pipe, args, embeds)
    return round(first - per_image, 2)


def run_variant(pipe, variant, args, embeds, reference) -> dict:
    from overdrive.compiler import dynamo_graph_count
    info = apply_variant(pipe, variant, args, embeds)
    graphs = dynamo_graph_count()
    image, latent, first = generate(pipe, args, embeds)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        image, latent, seconds = generate(pipe, args, embeds)
        times.append(seconds)
    per_image = statistics.median(times)
    if args.profile and torch.cuda.is_available():
        print(f"[{variant}]")
        profile_run(lambda: generate(pipe, args, embeds), args.steps)
    reference = reference or {"image": image, "latent": latent}
    error = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    row = {"variant": variant, "s_per_image": round(per_image, 4), "first_run_s": round(first, 2),
           "cold_compile_s_est": round(first - per_image, 2), "dynamo_graphs": dynamo_graph_count() - graphs,
           "peak_vram_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None,
           "rel_err_latent_vs_eager": error(latent, reference["latent"]),
           "rel_err_image_vs_eager": error(image, reference["image"]), "finite": bool(torch.isfinite(latent).all())}
    runner = info.pop("runner", None)
    if runner is not None:
        stats = runner.stats
        row["deepcache"] = {"full_calls": stats.full_calls, "shallow_calls": stats.shallow_calls,
                            "decisions": stats.decisions}
    row.update(info)
    if variant != "eager" and not args.no_warm and (args.warm_variants is None or variant in args.warm_variants):
        row["warm_compile_s_est"] = warm_compile_s(pipe, variant, args, embeds, per_image)
    return row, reference


def parse_args(argv=None):
    parser = parser_for(__doc__, VARIANTS, "SDXL-shaped UNet/VAE", tiny_res=64)
    parser.add_argument("--guidance", type=float, default=5.0, help="CFG scale (> 1: cond and uncond, batch 2)")
    parser.add_argument("--mode", default="default", choices=["default", "max-autotune"], help="Overdrive's mode")
    parser.add_argument("--peer-mode", default=None, help="the peer's torch.compile mode (default max-autotune)")
    parser.add_argument("--quant-format", default="auto", choices=["auto", "int8", "fp8_e4m3"])
    parser.add_argument("--density", type=float, default=None, help="QuantConfig.compute_density_threshold "
                        "(default: QuantConfig's; --tiny: 0, so tiny layers quantize too)")
    parser.add_argument("--cache-interval", type=int, default=3, help="DeepCache interval")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm (restart) compile measurement")
    parser.add_argument("--warm-variants", default=None, help="comma-separated variants whose warm (restart) compile is "
                        "measured (default: every compiled variant)")
    parser.add_argument("--profile", action="store_true", help="per variant, GPU kernel time by family and the GPU's "
                        "idle share of one image (torch.profiler)")
    args = parser.parse_args(argv)
    args.warm_variants = args.warm_variants.split(",") if args.warm_variants else None
    settle(parser, args, VARIANTS, tiny_res=64, repeats=3, named=("warm_variants",))
    args.peer_mode = args.peer_mode or "max-autotune"
    if args.density is None and args.tiny:
        args.density = 0.0
    args.dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    return args


def main(argv=None):
    args = parse_args(argv)
    # Cold compiles: Inductor's and Overdrive's caches start empty (a temp folder), and fill for the warm measurement.
    cache = tempfile.mkdtemp(prefix="overdrive-bench-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    os.environ["OVERDRIVE_CACHE_DIR"] = cache
    import diffusers

    pipe, embeds = build_pipeline(args), prompt_inputs(args)
    settings = {k: (str(v) if k == "dtype" else v) for k, v in vars(args).items()}
    report = {"benchmark": "diffusers", "pipeline": "StableDiffusionXLPipeline", "settings": settings,
              "environment": dict(environment(), diffusers=diffusers.__version__), "batch": 1,
              "text_encoders": "skipped: random prompt_embeds/pooled_prompt_embeds of SDXL's shapes",
              "weights": "fixed-seed random (diffusers' default init), SDXL base 1.0 config values",
              "peer": f"torch.compile(unet and vae.decode, mode={args.peer_mode!r}, fullgraph=True), channels_last",
              "results": []}
    rows = run_variants(report, args.variants,
                        lambda variant, reference: run_variant(pipe, variant, args, embeds, reference),
                        lambda: reset_pipeline(pipe, args), args.out)
    finish(report, rows, [("variant", lambda r: r["variant"]), ("s/image", lambda r: r["s_per_image"]),
                          ("speedup", lambda r: r["speedup_vs_eager"]), ("first run (s)", lambda r: r["first_run_s"]),
                          ("warm compile (s)", lambda r: r.get("warm_compile_s_est", "-")),
                          ("peak VRAM GiB", lambda r: r["peak_vram_gib"]),
                          ("rel err latent", lambda r: f"{r['rel_err_latent_vs_eager']:.2e}")], args.out)
    return report


if __name__ == "__main__":
    main()
