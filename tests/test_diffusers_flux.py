"""overdrive.api on a real diffusers FluxPipeline (CPU, tiny fixed-seed FluxTransformer2DModel): compile_ compiles the
transformer block by block (the Flux family's diffusers plug-in), quantize_ calibrates it through the pipeline, and
switch_weights_ reads another pipeline folder's transformer. The step cache: test_diffusers_dit.py."""
import pytest
import torch

from diffusers_tiny import flux_prompt, tiny_flux_pipeline
from overdrive.api import CompileOptions, QuantConfig, compile_, quantize_, switch_weights_
from overdrive.core.blockwise import BlockwiseForward
from overdrive.compiler import dynamo_graph_count

COMPILE_RTOL = 1e-4  # Inductor vs eager per transformer call, float32 on the CPU
INT8_RTOL = 0.05     # int8 transformer vs float, one call


def relative_error(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def generate(pipe, steps=3):
    return pipe(**flux_prompt(), height=32, width=32, num_inference_steps=steps, guidance_scale=1.0,
                output_type="latent", generator=torch.Generator().manual_seed(1)).images


def transformer_call(pipe):
    """One transformer call on fixed inputs (packed latents of 16x16 tokens, the prompt, a timestep)."""
    g = torch.Generator().manual_seed(2)
    prompt = flux_prompt()
    ids = torch.zeros(256, 3)
    ids[:, 1], ids[:, 2] = torch.arange(256) // 16, torch.arange(256) % 16
    with torch.no_grad():
        return pipe.transformer(hidden_states=torch.randn(1, 256, 16, generator=g),
                                encoder_hidden_states=prompt["prompt_embeds"],
                                pooled_projections=prompt["pooled_prompt_embeds"], timestep=torch.tensor([0.5]),
                                img_ids=ids, txt_ids=torch.zeros(8, 3), return_dict=False)[0]


def test_compile_runs_each_distinct_flux_block_through_one_graph_and_matches_eager():
    """diffusers registers its blocks with allow_in_graph, so Dynamo cannot look up their forward in traced code: the
    block's function is handed to the traced call, and each block compiles whole (no graph break)."""
    pipe = tiny_flux_pipeline()
    expected_call, expected = transformer_call(pipe), generate(pipe)
    before, breaks = dynamo_graph_count(), sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled = compile_(pipe, CompileOptions(precompile=False))
    forward = pipe.transformer.forward
    assert isinstance(forward, BlockwiseForward) and compiled["transformer.forward"] is forward
    assert len(forward.compiled) == 3 and len({c.fingerprint for c in forward.compiled.values()}) == 2
    assert relative_error(transformer_call(pipe), expected_call) < COMPILE_RTOL
    # The double block, and the single block twice: the first gets a contiguous input, the next the strided view of
    # the concatenated streams that a single block returns.
    assert dynamo_graph_count() - before == 3
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert relative_error(generate(pipe), expected) < COMPILE_RTOL
    assert "vae.decode" in compiled


def test_switching_to_another_flux_pipeline_folder_reuses_the_compiled_blocks(tmp_path):
    """Another Flux checkpoint (a pipeline folder's transformer/) into the compiled pipeline: no new graph, and each
    call matches that checkpoint's own eager transformer."""
    other = tiny_flux_pipeline(seed=1)
    other.transformer.save_pretrained(tmp_path / "transformer")
    expected = transformer_call(other)
    pipe = tiny_flux_pipeline()
    compile_(pipe, CompileOptions(precompile=False))
    first = transformer_call(pipe)
    before = dynamo_graph_count()
    switch_weights_(pipe, tmp_path)
    assert relative_error(transformer_call(pipe), expected) < COMPILE_RTOL
    assert dynamo_graph_count() == before and relative_error(first, expected) > 0.1


def test_quantize_calibrates_the_flux_transformer_through_the_pipeline():
    pipe = tiny_flux_pipeline()
    expected = transformer_call(pipe)
    report = quantize_(pipe, QuantConfig(format="int8", compute_density_threshold=0),
                       calibration={**flux_prompt(), "height": 32, "width": 32, "num_inference_steps": 2,
                                    "guidance_scale": 1.0})
    assert report.calibrated and len(report.quantized) > 10
    assert all(name.startswith(("transformer_blocks", "single_transformer_blocks", "x_embedder", "context_embedder",
                                "time_text_embed", "norm_out", "proj_out")) for name in report.quantized)
    assert relative_error(transformer_call(pipe), expected) < INT8_RTOL


def test_quantize_in_fp8_fuses_the_feed_forwards_and_they_match_their_layers_run_apart():
    """quantize_ in fp8: each double block's FeedForward (GELU(proj, "tanh"), Dropout, Linear) runs proj, the GELU and
    the second layer's input cast as one op (quantization/gelu_fusion.py; on the CPU torch's fp8 GEMM and GELU in
    float32), the GELU module passing the e4m3 result through: the transformer's output equals the same 8-bit layers run
    apart."""
    from overdrive.quantization import fp8_supported
    if not fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm has no CPU fp8 kernel in this build")
    pipe = tiny_flux_pipeline()
    expected = transformer_call(pipe)
    quantize_(pipe, QuantConfig(format="fp8_e4m3", compute_density_threshold=0),
              calibration={**flux_prompt(), "height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 1.0})
    linked = [m for m in pipe.transformer.modules() if getattr(m, "gelu_dtype", None) is not None]
    double_blocks = len(pipe.transformer.transformer_blocks)
    assert len(linked) == 2 * double_blocks  # the image and the text stream's FeedForward of each double block
    assert all(type(block.ff.net[0]).__name__ == "GELUUnlessFused" for block in pipe.transformer.transformer_blocks)
    fused = transformer_call(pipe)
    for layer in linked:
        layer.gelu_dtype = None
    apart = transformer_call(pipe)
    assert relative_error(fused, apart) < 1e-6
    assert relative_error(fused, expected) < 0.1  # fp8 against float32, one call
