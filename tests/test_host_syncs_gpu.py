"""The families' host-sync fixes on a GPU: ComfyUI's function blocks the host on the GPU (torch's sync debug mode
raises at it), the replacement does not, and both give the same values."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def comfy():
    from overdrive.harness.inprocess import import_comfy
    return import_comfy(cpu=False)


def test_wans_time_embedding_does_not_wait_for_the_gpu(comfy):
    import comfy.ldm.wan.model as comfy_wan

    from overdrive.families import wan

    comfys = next(fix for fix in wan.FAMILY.host_sync_fixes if fix.module == comfy_wan.__name__).original()
    assert comfys is not wan.time_embedding
    position = torch.rand(2 * 3510, device="cuda") * 1000
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            comfys(256, position)
        fixed = wan.time_embedding(256, position)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(fixed, comfys(256, position))


def test_ltx_videos_token_coordinates_do_not_wait_for_the_gpu(comfy):
    from comfy.ldm.lightricks import symmetric_patchifier

    from overdrive.families import ltxv

    comfys_coords, comfys_pixels = (fix.original() for fix in ltxv.FAMILY.host_sync_fixes)
    patchifier = symmetric_patchifier.SymmetricPatchifier(1, start_end=True)
    args = (13, 16, 24, 2, torch.device("cuda"))  # 768x512, 97 frames, CFG
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            comfys_coords(patchifier, *args)
        coords = ltxv.latent_coords(patchifier, *args)
        with pytest.raises(RuntimeError, match="synchroniz"):
            comfys_pixels(coords, (8, 32, 32), True)
        pixels = ltxv.pixel_coords(coords, (8, 32, 32), True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(coords, comfys_coords(patchifier, *args))
    assert torch.equal(pixels, comfys_pixels(coords, (8, 32, 32), True))
