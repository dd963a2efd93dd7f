"""The built-in DiT files' layouts: read off ComfyUI's own classes and detected back as the same model (model_layout
checks that round trip itself and raises otherwise), at the real sizes for "full"; the conditioning node's shapes."""
import math

import pytest

from overdrive.builtin_models.dit import FAMILIES, conditioning, model_layout, vae_layout

# Parameters of the real models (ComfyUI's classes at the configs its detection reads from the released files; LTX-2's
# class in ComfyUI 0.33 holds 19.6 B at the 19 B model's config).
FULL_BILLIONS = {"flux": 11.9, "flux2": 32.2, "qwen_image": 20.4, "wan22": 5.0, "wan22_14b": 14.3, "zimage": 6.2,
                 "sd35": 8.1, "ltxv": 13.0, "chroma": 8.9, "ltx2": 19.6}


def billions(specs) -> float:
    return sum(math.prod(s.shape) for s in specs) / 1e9


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_and_tiny_layouts_round_trip_through_comfyui_detection(comfy, family):
    full, tiny = model_layout(family, "full"), model_layout(family, "tiny")
    assert billions(full) == pytest.approx(FULL_BILLIONS[family], abs=0.05)
    assert billions(tiny) < 0.2 * billions(full)  # Z-Image: 0.91 of 6.15 B (its width is fixed by detection)
    assert {s.key for s in tiny} < {s.key for s in full}  # fewer blocks, the same names


@pytest.mark.parametrize("family", list(FAMILIES))
def test_modulation_layers_are_drawn_small_and_vaes_are_complete(comfy, family):
    specs = model_layout(family, "tiny")
    assert any(s.init == "small" for s in specs) and any(s.init == "normal" for s in specs)
    assert any(s.key.startswith("decoder.") for s in vae_layout(FAMILIES[family].vae, "tiny"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_builtin_conditioning_has_the_family_text_encoder_shape(comfy, family):
    from overdrive.nodes import NODES
    positive, negative = NODES["OverdriveBuiltinConditioning"].execute(family, seed=3, tokens=7)
    (cond, extras), = positive
    assert tuple(cond.shape) == (1, 7, FAMILIES[family].cond["width"])
    assert ("pooled_output" in extras) == ("pooled" in FAMILIES[family].cond)
    assert not (cond == negative[0][0]).all() and (cond == conditioning(family, 3, 7)[0][0]).all()
    with pytest.raises(ValueError, match="unknown family"):
        NODES["OverdriveBuiltinConditioning"].execute("sdxl")


def test_the_command_line_writes_files_comfyui_loads(comfy, tmp_path):
    """`python -m overdrive.builtin_models --arch wan22` writes the diffusion model and the VAE; ComfyUI's own
    loaders (what Load Diffusion Model and Load VAE call) take them as Wan 2.2."""
    import subprocess
    import sys

    import comfy.sd
    import comfy.utils
    out = subprocess.run([sys.executable, "-m", "overdrive.builtin_models", "--arch", "wan22", "--out", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout.split()
    model_path, vae_path = [p for p in out if p.endswith(".safetensors")]
    model = comfy.sd.load_diffusion_model(model_path)
    assert type(model.model.model_config).__name__ == "WAN22_T2V"
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(vae_path))
    assert vae.latent_channels == 48


def test_a_layout_made_while_another_thread_builds_leaves_stdout_as_it_was(comfy):
    """Builds silence ComfyUI's prints by redirecting stdout, which is process-wide: a thread that redirected before
    waiting for the builds' lock restored the other thread's redirect at its end, and the process printed into it
    for good (the iteration soak writes its second model beside its prompts)."""
    import sys
    import threading

    from overdrive.builtin_models.dit import quiet_build

    stdout, inside, leave = sys.stdout, threading.Event(), threading.Event()

    def hold_a_build():
        with quiet_build():
            inside.set()
            leave.wait(30)
    other = threading.Thread(target=hold_a_build)
    other.start()
    inside.wait(30)
    building = threading.Thread(target=vae_layout, args=("wan21", "tiny"))
    building.start()
    building.join(0.5)  # it waits for the other build: let it get as far as it can before that one ends
    leave.set()
    other.join(30)
    building.join(60)
    assert sys.stdout is stdout
