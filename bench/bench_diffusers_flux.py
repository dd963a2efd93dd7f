"""GPU benchmark of overdrive.api on a diffusers FluxPipeline against diffusers' own recipes, in one process, same
seed: eager; the peer (diffusers' regional compile, `transformer.compile_repeated_blocks(fullgraph=True)`), + torchao
float8 (dynamic activations, per-row scales: diffusers' and torchao's Flux recipe), + diffusers' First Block Cache;
Overdrive compile_, + quantize_ fp8, + deepcache_ (the DiT step cache), + attention_ (8-bit attention, auto).

  python bench/bench_diffusers_flux.py --out bench/results/DATE_h200_diffusers_flux1024.json
  python bench/bench_diffusers_flux.py --tiny --device cpu      # smoke test (the fp8 variants need a Hopper GPU)

The transformer and VAE are diffusers' Flux classes at Flux.1-dev's configuration with fixed-seed random weights
(harness.inprocess.seeded_init_: fan-in scaled, adaLN layers 10x smaller as in the ComfyUI benchmarks), rebuilt from
the seed for each variant. The text encoders are not called: random T5 (512 x 4096) and CLIP (768) embeddings stand
in for them. Timed: the pipeline call to the final latent (the VAE decode is not in the loop). Reported per variant:
s/image (median of --repeats), first run (includes compiling and, for quantize_, not its calibration, reported
apart), peak VRAM, relative error of the final latent and of the first transformer call against eager, Dynamo graphs,
the step caches' full and reused steps.
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
from report import environment, finish  # noqa: E402

VARIANTS = ("eager", "peer", "peer+fp8", "peer+fbcache", "peer+fp8+fbcache", "overdrive", "overdrive+fp8",
            "overdrive+fp8+cache", "overdrive+fp8+cache+nographs", "overdrive+fp8+adaptive", "overdrive+fp8+attn",
            "overdrive+noprecompile")
# Flux.1-dev's transformer (diffusers' defaults are Flux.1's shapes; dev adds the guidance embedding) and VAE.
FLUX_TRANSFORMER = dict(guidance_embeds=True)
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1159,
                scaling_factor=0.3611)
TINY_TRANSFORMER = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                        axes_dims_rope=(4, 6, 6))
TINY_VAE = dict(FLUX_VAE, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8)
EMBEDS = {"full": (512, 4096, 768), "tiny": (8, 32, 16)}  # T5 tokens, T5 width, CLIP pooled width
# Flux.1-dev's scheduler: resolution-dependent shift of the flow-matching sigmas.
SCHEDULER = dict(base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15,
                 use_dynamic_shifting=True, shift=3.0)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_transformer(args):
    from diffusers import FluxTransformer2DModel

    from overdrive.builtin_models.dit import MODULATION_GAIN
    from overdrive.harness.inprocess import seeded_init_
    with torch.device(args.device):
        transformer = FluxTransformer2DModel(**(TINY_TRANSFORMER if args.tiny else FLUX_TRANSFORMER))
    transformer = transformer.to(args.dtype).eval().requires_grad_(False)
    seeded_init_(transformer, args.seed, MODULATION_GAIN)
    return transformer


def build_pipeline(args):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline

    from overdrive.harness.inprocess import seeded_init_
    with torch.device(args.device):
        vae = AutoencoderKL(**(TINY_VAE if args.tiny else FLUX_VAE))
    vae = vae.to(args.dtype).eval().requires_grad_(False)
    seeded_init_(vae, args.seed + 1)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=build_transformer(args))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_inputs(args) -> dict:
    tokens, width, pooled = EMBEDS["tiny" if args.tiny else "full"]
    g = torch.Generator().manual_seed(args.seed + 2)
    return {"prompt_embeds": torch.randn(1, tokens, width, generator=g).to(args.device, args.dtype),
            "pooled_prompt_embeds": torch.randn(1, pooled, generator=g).to(args.device, args.dtype)}


def generate(pipe, args, embeds, first_call=None):
    """(final latent, seconds); with a list `first_call`, the first transformer call's output is appended to it."""
    transformer, installed = pipe.transformer, pipe.transformer.__dict__.get("forward")
    if first_call is not None:
        inner = installed or transformer.forward

        def record(*a, **k):
            out = inner(*a, **k)
            if not first_call:
                first_call.append(out[0].float().cpu())
            return out
        transformer.forward = record
    sync()
    start = time.perf_counter()
    try:
        latent = pipe(**embeds, height=args.res, width=args.res, num_inference_steps=args.steps,
                      guidance_scale=args.guidance, output_type="latent",
                      generator=torch.Generator().manual_seed(args.seed)).images
    finally:
        if first_call is not None:
            if installed is None:
                transformer.__dict__.pop("forward", None)
            else:
                transformer.forward = installed
    sync()
    return latent.float().cpu(), time.perf_counter() - start


def apply_variant(pipe, variant, args, embeds) -> dict:
    """Install `variant` on a pipeline with a fresh transformer; returns what it reported."""
    from overdrive.api import (AttentionConfig, CompileOptions, DeepCacheConfig, QuantConfig, attention_, compile_,
                               deepcache_, quantize_)
    parts, info = variant.split("+"), {}
    if variant == "eager":
        return info
    if "peer" in parts:
        if "fp8" in parts:  # torchao's float8 recipe for Flux (diffusers' quantization docs)
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
            from torchao.quantization import quantize_ as torchao_quantize_
            torchao_quantize_(pipe.transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        if "fbcache" in parts:
            from diffusers.hooks import FirstBlockCacheConfig
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=args.fbcache_threshold))
        # The cache's decision is a compiler.disable'd function inside the first block: no full graph there.
        pipe.transformer.compile_repeated_blocks(fullgraph="fbcache" not in parts, backend=args.backend)
        return info
    if "fp8" in parts:
        start = time.perf_counter()
        report = quantize_(pipe, QuantConfig(format="fp8_e4m3" if args.device == "cuda" else "int8"),
                           calibration=dict(embeds, height=args.res, width=args.res, guidance_scale=args.guidance))
        info["quantize_s"], info["quantization"] = round(time.perf_counter() - start, 2), report.summary()
    if "attn" in parts:
        attention_(pipe, AttentionConfig(mode="auto", max_error=args.attention_max_error))
    # "noprecompile": compile_'s precompile (saving each block's first-shape call whole) off, to see its share of the
    # cold compile; "nographs": the blocks run without their CUDA graphs (compiler/block_graphs.py).
    compile_(pipe, CompileOptions(backend=args.backend, cuda_graphs="nographs" not in parts,
                                  precompile="noprecompile" not in parts))
    if "cache" in parts:
        info["step_cache"] = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=args.cache_interval,
                                                              start_percent=args.cache_start,
                                                              end_percent=args.cache_end))
    if "adaptive" in parts:
        info["step_cache"] = deepcache_(pipe, DeepCacheConfig(mode="adaptive", threshold=args.cache_threshold,
                                                              start_percent=args.cache_start,
                                                              end_percent=args.cache_end))
    return info


def reset_pipeline(pipe, args):
    """Back to eager with a freshly built transformer (same seed, same weights) and the VAE's own decode."""
    from overdrive.compiler import clear_shared_graphs
    pipe.vae.__dict__.pop("decode", None)
    pipe.transformer = None
    torch._dynamo.reset()
    clear_shared_graphs()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    pipe.transformer = build_transformer(args)


def run_variant(pipe, variant, args, embeds, reference) -> tuple:
    from overdrive.compiler import dynamo_graph_count
    if "fp8" in variant.split("+") and "peer" in variant and args.device != "cuda":
        return {"variant": variant, "skipped": "torchao float8 needs a CUDA GPU of compute capability >= 8.9"}, \
            reference
    try:
        info = apply_variant(pipe, variant, args, embeds)
        graphs = dynamo_graph_count()
        first_call = []
        latent, first = generate(pipe, args, embeds, first_call)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.repeats):
            latent, seconds = generate(pipe, args, embeds)
            times.append(seconds)
    except Exception as error:  # noqa: BLE001 - a peer recipe that fails here is a result, the run goes on
        return {"variant": variant, "failed": f"{type(error).__name__}: {str(error)[:300]}"}, reference
    per_image = statistics.median(times)
    reference = reference or {"latent": latent, "call": first_call[0]}
    error = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    row = {"variant": variant, "s_per_image": round(per_image, 4), "first_run_s": round(first, 2),
           "cold_compile_s_est": round(first - per_image, 2), "dynamo_graphs": dynamo_graph_count() - graphs,
           "peak_vram_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available() else None,
           "rel_err_latent_vs_eager": error(latent, reference["latent"]),
           "first_call_rel_err": error(first_call[0], reference["call"]), "finite": bool(torch.isfinite(latent).all())}
    cache = info.pop("step_cache", None)
    if cache is not None:
        stats = cache.last_stats or cache.stats
        row["step_cache"] = {"full_steps": stats.full_steps, "reused_steps": stats.shallow_steps,
                             "decisions": stats.decisions}
    row.update(info)
    return row, reference


def parse_args(argv=None):
    parser = parser_for(__doc__, VARIANTS, "Flux-shaped transformer/VAE", tiny_res=32)
    parser.add_argument("--guidance", type=float, default=3.5, help="Flux.1-dev's distilled guidance (one call a step)")
    parser.add_argument("--cache-interval", type=int, default=4, help="the step cache's fixed interval")
    parser.add_argument("--cache-threshold", type=float, default=0.2, help="the adaptive step cache's threshold")
    parser.add_argument("--cache-start", type=float, default=0.1, help="the step cache's start_percent")
    parser.add_argument("--cache-end", type=float, default=0.95, help="the step cache's end_percent")
    parser.add_argument("--fbcache-threshold", type=float, default=0.08,
                        help="First Block Cache's threshold (ParaAttention's Flux setting; diffusers' default 0.05)")
    parser.add_argument("--attention-max-error", type=float, default=0.05, help="attention_'s error bound per call")
    args = settle(parser, parser.parse_args(argv), VARIANTS, tiny_res=32, repeats=2)
    args.dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return args


def main(argv=None):
    args = parse_args(argv)
    import logging
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("overdrive").setLevel(logging.INFO)  # what was compiled, in how long, beside the figures
    cache = tempfile.mkdtemp(prefix="overdrive-bench-")  # cold compiles: Inductor's and Overdrive's caches start empty
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    os.environ["OVERDRIVE_CACHE_DIR"] = cache
    import diffusers

    pipe, embeds = build_pipeline(args), prompt_inputs(args)
    settings = {k: (str(v) if k == "dtype" else v) for k, v in vars(args).items()}
    try:
        import torchao
        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    report = {"benchmark": "diffusers-flux", "pipeline": "FluxPipeline", "settings": settings,
              "environment": dict(environment(), diffusers=diffusers.__version__, torchao=torchao_version),
              "batch": 1, "text_encoders": "skipped: random T5/CLIP embeddings of Flux's shapes",
              "weights": "fixed-seed random (harness.inprocess.seeded_init_), Flux.1-dev config values",
              "peer": "diffusers: transformer.compile_repeated_blocks(fullgraph=True); torchao "
                      "Float8DynamicActivationFloat8WeightConfig(PerRow); FirstBlockCacheConfig(threshold)",
              "results": []}
    rows = run_variants(report, args.variants,
                        lambda variant, reference: run_variant(pipe, variant, args, embeds, reference),
                        lambda: reset_pipeline(pipe, args), args.out)
    timed = [r for r in rows if "s_per_image" in r]
    finish(report, timed, [("variant", lambda r: r["variant"]), ("s/image", lambda r: r["s_per_image"]),
                           ("speedup", lambda r: r["speedup_vs_eager"]), ("first run (s)", lambda r: r["first_run_s"]),
                           ("peak VRAM GiB", lambda r: r["peak_vram_gib"]),
                           ("rel err latent", lambda r: f"{r['rel_err_latent_vs_eager']:.2e}"),
                           ("first call", lambda r: f"{r['first_call_rel_err']:.2e}")], args.out)
    return report


if __name__ == "__main__":
    main()
