"""Built-in checkpoints (overdrive.builtin_models), loaded and sampled by the real ComfyUI in-process (CPU)."""
import ast
import contextlib
import hashlib
import logging
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from overdrive.builtin_models import checkpoint_tensors, ensure_checkpoint
from overdrive.builtin_models.unet import unet_config

RES = 64  # pixels: an 8x8 latent
UNET = "model.diffusion_model."
# CLIP-L parameters that ComfyUI creates and initialises itself (identity projection, logit scale ln 100) and
# that no SD1.5/SDXL checkpoint carries: its own save_checkpoint drops them, and for SDXL its loader keeps only
# `...embedders.0.transformer.text_model.*`. So "clip missing" lists exactly these, for real checkpoints too.
COMFY_OWNED_CLIP_KEYS = {"clip_l.logit_scale", "clip_l.transformer.text_projection.weight"}
# ComfyUI's log lines (comfy/sd.py, comfy/model_base.py) about keys it did not find or did not use.
KEY_COMPLAINTS = ("unet missing", "unet unexpected", "Missing VAE keys", "Leftover VAE keys", "clip unexpected",
                  "left over keys", "no CLIP/text encoder weights")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def root_log_records():
    """Every record ComfyUI logs (it logs through the root logger), debug level included."""
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


# The default folder (the test run's cache, tests/conftest.py): the files the server's fixtures use too, one copy.
@pytest.fixture(scope="session")
def sd15_path():
    return ensure_checkpoint("sd15", "tiny", seed=0)


@pytest.fixture(scope="session")
def sdxl_path():
    return ensure_checkpoint("sdxl", "tiny", seed=0)  # 2.4 GB, mostly bigG: made once


def load(comfy, path):
    """CheckpointLoaderSimple's call, under inference mode as ComfyUI's executor runs it; and what it logged."""
    import comfy.sd
    with root_log_records() as records, torch.inference_mode():
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=True, output_clip=True,
                                                                   embedding_directory=None)
    return model, clip, vae, [r.getMessage() for r in records]


def assert_no_key_complaints(messages):
    for message in messages:
        assert not message.startswith(KEY_COMPLAINTS), message
        if message.startswith("clip missing: "):
            assert set(ast.literal_eval(message[len("clip missing: "):])) <= COMFY_OWNED_CLIP_KEYS, message


def sample_image(comfy, model, clip, vae, steps):
    """CLIPTextEncode, KSampler (euler, cfg 7) and VAEDecode, as nodes.py calls them."""
    import comfy.model_management
    import comfy.sample

    def encode(text):
        cond, pooled = clip.encode_from_tokens(clip.tokenize(text), return_pooled=True)
        return [[cond, {"pooled_output": pooled}]]

    with torch.inference_mode():
        positive, negative = encode("a photo of a cat"), encode("")
        latent = torch.zeros(1, 4, RES // 8, RES // 8)
        noise = comfy.sample.prepare_noise(latent, 0)
        samples = comfy.sample.sample(model, noise, steps, 7.0, "euler", "normal", positive, negative, latent,
                                      seed=0, disable_pbar=True)
        image = vae.decode(samples)
    comfy.model_management.unload_all_models()
    return positive[0][0], samples, image


def assert_finite_and_varied(cond, samples, image):
    for t in (cond, samples, image):
        assert torch.isfinite(t).all()
    assert cond.std() > 0.1 and samples.std() > 0.1
    assert image.shape == (1, RES, RES, 3)
    assert image.std() > 0.05 and image.amax() > image.amin()  # not a constant image


def test_same_seed_same_bytes_other_seed_same_shapes_other_weights(tmp_path, sd15_path):
    again = ensure_checkpoint("sd15", "tiny", seed=0, directory=tmp_path)
    assert again.name == sd15_path.name and sha256(again) == sha256(sd15_path)
    assert ensure_checkpoint("sd15", "tiny", seed=0, directory=tmp_path) == again  # cached: found, not remade

    other = ensure_checkpoint("sd15", "tiny", seed=1, directory=tmp_path)
    assert other.name != sd15_path.name
    with safe_open(str(sd15_path), "pt") as a, safe_open(str(other), "pt") as b:
        assert a.metadata()["overdrive_generated"] == "sd15/tiny/0" and b.metadata()["overdrive_generated"] == "sd15/tiny/1"
        assert sorted(a.keys()) == sorted(b.keys())
        for key in a.keys():
            x, y = a.get_tensor(key), b.get_tensor(key)
            assert x.shape == y.shape and x.dtype == y.dtype == torch.float16, key
            assert not torch.equal(x, y), key  # every weight moves with the seed (norms and biases too)
            assert torch.isfinite(x).all(), key


def test_full_unets_have_comfyui_own_shapes_and_real_sizes(comfy):
    """The "full" UNets, checked on the meta device (no 7 GB file): ComfyUI detects the real SD1.5/SDXL config
    from our shapes, and the UNet class it then builds has exactly our keys and shapes. Tiny ones too."""
    import comfy.model_detection

    params = {}
    for arch, size in (("sd15", "tiny"), ("sd15", "full"), ("sdxl", "tiny"), ("sdxl", "full")):
        sd = {s.key: torch.empty(s.shape, device="meta") for s in checkpoint_tensors(arch, size)}
        model_config = comfy.model_detection.model_config_from_unet(sd, UNET)
        assert type(model_config).__name__ == {"sd15": "SD15", "sdxl": "SDXL"}[arch]
        expected = unet_config(arch, size)
        assert {k: model_config.unet_config[k] for k in expected} == expected
        unet = model_config.get_model(sd, UNET, device="meta").diffusion_model
        theirs = {k: tuple(v.shape) for k, v in unet.state_dict().items()}
        assert theirs == {k[len(UNET):]: tuple(s.shape) for k, s in sd.items() if k.startswith(UNET)}
        params[arch, size] = sum(v.numel() for v in unet.state_dict().values())
    assert params["sd15", "full"] == 859_520_964 and params["sdxl", "full"] == 2_567_463_684  # the real models'


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_comfyui_loads_and_samples(comfy, arch, request):
    import comfy.supported_models

    model, clip, vae, messages = load(comfy, request.getfixturevalue(f"{arch}_path"))
    expected = {"sd15": comfy.supported_models.SD15, "sdxl": comfy.supported_models.SDXL}[arch]
    assert type(model.model.model_config) is expected
    assert model.model.model_config.unet_config["channel_mult"] == unet_config(arch, "tiny")["channel_mult"]
    assert_no_key_complaints(messages)
    assert_finite_and_varied(*sample_image(comfy, model, clip, vae, steps=2 if arch == "sdxl" else 3))


def test_cli_prints_the_cached_path_without_importing_comfyui(sd15_path):
    code = ("import sys, runpy; sys.argv = sys.argv[1:]; runpy.run_module('overdrive.builtin_models', run_name='__main__');"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'comfy'], 'imported ComfyUI'")
    out = subprocess.run([sys.executable, "-c", code, "builtin_models", "--arch", "sd15", "--size", "tiny",
                          "--seed", "0", "--out", str(sd15_path.parent)],
                         capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == str(sd15_path)
