"""QuantizeModel's VRAM and device moves in each of ComfyUI's memory modes, on a real CUDA GPU with ComfyUI's own
loader: the float layers that 8-bit layers replace leave the GPU, a collected clone moves nothing, and a float prompt
after a quantized one runs on the GPU with its own layers.

Skipped without CUDA (CI has no GPU). Run it alone (it imports ComfyUI for the GPU, the rest of the suite for the CPU):
`python3 -m pytest tests/test_quantize_memory_gpu.py`.
"""
import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
RES, STEPS = 1024, 2
EVERYTHING = dict(conv_mse_threshold=1e9, linear_mse_threshold=1e9, compute_density_threshold=0.0, min_speedup=0.0)


@pytest.fixture(scope="module")
def comfy():
    from overdrive.harness.inprocess import import_comfy
    return import_comfy(cpu=False)


@pytest.fixture(params=["normal", "gpu-only"])
def memory_mode(comfy, request):
    """ComfyUI's default (models offload to the CPU) and --gpu-only / --highvram (they stay on the GPU)."""
    mm = comfy.model_management
    saved = mm.vram_state
    mm.vram_state = mm.VRAMState.HIGH_VRAM if request.param == "gpu-only" else mm.VRAMState.NORMAL_VRAM
    yield request.param
    mm.unload_all_models()
    mm.vram_state = saved
    gc.collect()
    torch.cuda.empty_cache()


def sampler(comfy):
    import comfy.sample
    from overdrive.harness.inprocess import conditioning
    positive, negative = conditioning("sdxl", RES, RES, seed=1)
    latent = torch.zeros(1, 4, RES // 8, RES // 8)
    noise = comfy.sample.prepare_noise(latent, 7)

    def run(model):
        with torch.inference_mode():
            return comfy.sample.sample(model, noise, STEPS, 1.0, "euler", "normal", positive, negative, latent,
                                       seed=7, disable_pbar=True)
    return run, dict(positive=positive, negative=negative, latent={"samples": latent})


def weights_on_gpu(model) -> int:
    """Bytes of the diffusion model's tensors (float and 8-bit layers, loaded or not) that are on the GPU."""
    from overdrive.comfy_host.quantized_state import followers
    tensors = {id(t): t for t in model.model.diffusion_model.state_dict().values()}
    for follower in followers(model):
        for module in list(follower.modules.values()) + list(follower.originals.values()):
            tensors.update({id(t): t for t in module.state_dict().values()})
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.is_cuda)


def test_quantized_weights_lower_vram_in_every_memory_mode(comfy, memory_mode, tmp_path, monkeypatch):
    from overdrive.nodes import NODES
    from overdrive.comfy_host.quantized_state import followers
    from overdrive.harness.inprocess import build_model

    monkeypatch.setenv("OVERDRIVE_CACHE_DIR", str(tmp_path))
    run, prompt = sampler(comfy)
    base = build_model(comfy, "sdxl", "full", torch.float16, seed=0)
    float_out = run(base.clone())
    float_bytes = weights_on_gpu(base)
    with torch.inference_mode():
        quantized = NODES["OverdriveQuantizeModel"].execute(
            base, format="fp8_e4m3", calibration_steps=1, **prompt, **EVERYTHING)[0]
    follower = followers(quantized)[0]
    run(quantized)
    quantized_bytes = weights_on_gpu(quantized)
    print(f"{memory_mode}: diffusion-model bytes on the GPU, float {float_bytes / 2**30:.2f} GiB, "
          f"quantized {quantized_bytes / 2**30:.2f} GiB ({len(follower.modules)} layers in fp8)")
    assert all(t.device.type == "cpu" for m in follower.originals.values() for t in m.state_dict().values())
    assert quantized_bytes < 0.75 * float_bytes

    # A clone collected while the quantized model stays loaded moves nothing (it used to copy every 8-bit layer to
    # the CPU and back).
    clone = quantized.clone()
    del clone
    gc.collect()
    assert all(t.is_cuda for m in follower.modules.values() for t in m.state_dict().values())

    # The float model again: its own layers back on the GPU, the same output as before any quantizing.
    again = run(base.clone())
    tree = base.model.diffusion_model
    assert all(t.is_cuda for t in tree.state_dict().values())
    assert ((again - float_out).norm() / float_out.norm()).item() < 1e-3


def test_an_unload_to_the_pinned_home_frees_the_card_and_copies_nothing_the_second_time(comfy):
    """The quantized layers' page-locked home (comfy_host/pinned_home.py): an unload gives their GPU memory back, a
    load computes the same, again and again. Pinning counts against ComfyUI's limit, so ComfyUI is imported (`comfy`)
    even where this test runs alone."""
    from overdrive.comfy_host.layer_tensors import tensors_of
    from overdrive.comfy_host.pinned_home import PinnedHome
    from overdrive.quantization import Int8Linear
    torch.manual_seed(0)
    layers = [Int8Linear.from_float(torch.nn.Linear(1024, 1024)).cuda() for _ in range(4)]
    x = torch.randn(8, 1024, device="cuda")
    expected = [layer(x) for layer in layers]
    home, held = PinnedHome(), torch.cuda.memory_allocated()
    assert home.send(layers) > 0
    assert all(t.device.type == "cpu" and t.is_pinned() for layer in layers for *_, t in tensors_of(layer))
    assert torch.cuda.memory_allocated() < held - 3 * 2**20  # the 8-bit weights left the card
    for _ in range(2):
        home.bring(layers, "cuda")
        assert all(torch.equal(layer(x), out) for layer, out in zip(layers, expected))
        held_home = home.nbytes()
        assert home.send(layers) > 0 and home.nbytes() == held_home  # the same blocks, no new allocation


@pytest.mark.parametrize("kind", ["fp8", "int8", "int8 weight-only", "1x1 conv"])
def test_a_layer_waiting_on_the_host_quantized_on_the_card_is_the_layer_the_host_quantizes(kind):
    """Switch Weights / Switch Diffusion Model quantize the new file's weights on the card while the layers wait on the
    host (quantize_patches.requantize_onto): the tensors the card makes for a layer on the card (as Quantize Model
    made the layers in the first place), left on the host; they compute what the host's own quantizing computes."""
    import copy
    from overdrive.comfy_host.layer_tensors import tensors_of
    from overdrive.quantization import Fp8Linear, Int8Linear, Int8WeightOnlyLinear, QuantConv2d1x1
    from overdrive.quantization.modules import requantize
    torch.manual_seed(0)
    make = {"fp8": lambda: Fp8Linear.from_float(torch.nn.Linear(256, 512, dtype=torch.bfloat16)),
            "int8": lambda: Int8Linear.from_float(torch.nn.Linear(256, 512)),
            "int8 weight-only": lambda: Int8WeightOnlyLinear.from_float(torch.nn.Linear(256, 512)),
            "1x1 conv": lambda: QuantConv2d1x1.from_float(torch.nn.Conv2d(256, 512, 1), "int8")}[kind]
    layer = make()
    weight, bias = torch.randn(512, 256, *((1, 1) if kind == "1x1 conv" else ())), torch.randn(512)
    on_card = requantize({"x": layer}, {"x.weight": weight, "x.bias": bias}, copy=True,
                         quantize_on=torch.device("cuda"))["x"]
    assert all(t.device.type == "cpu" for *_, t in tensors_of(on_card))
    made_on_card = copy.deepcopy(layer).cuda().load_float_weight(weight.cuda(), bias.cuda())
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1
               else torch.equal(a.cpu(), b) for (*_, a), (*_, b) in zip(tensors_of(made_on_card), tensors_of(on_card)))
    on_host = requantize({"x": layer}, {"x.weight": weight, "x.bias": bias}, copy=True)["x"]
    x = torch.randn(4, 256, *((2, 2) if kind == "1x1 conv" else ()), device="cuda",
                    dtype=torch.bfloat16 if kind == "fp8" else torch.float32)
    ours, theirs = on_card.cuda()(x).float(), on_host.cuda()(x).float()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-2


def test_weights_copied_ahead_arrive_as_plain_copies_do_and_stay_apart():
    """core.weights_ahead: each layer's tensors reach the card in order with the values `.to` gives, a later layer's
    staging (through the same two page-locked buffers) overwrites no earlier copy, and a tensor that is not a plain
    host one (already on the card, None) goes through as it is."""
    from overdrive.core.weights_ahead import on_device_ahead
    generator = torch.Generator().manual_seed(0)
    layers = [(torch.randn(300 + 7 * i, 70, generator=generator).to(torch.bfloat16), torch.randn(300 + 7 * i))
              for i in range(5)]
    layers += [(torch.randn(33, 5, dtype=torch.float16), None), (torch.randn(64, 64), torch.randn(64, device="cuda"))]
    arrived = list(on_device_ahead(layers, "cuda"))
    torch.cuda.synchronize()
    assert len(arrived) == len(layers)
    for layer, copies in zip(layers, arrived):
        for tensor, copy in zip(layer, copies, strict=True):
            if tensor is None:
                assert copy is None
                continue
            assert copy.is_cuda and copy.dtype == tensor.dtype and torch.equal(copy.cpu(), tensor.cpu())
