"""The quantized layers' page-locked home (comfy_host/pinned_home.py): what an unload copies out, and when it copies
nothing. On the CPU the home is plain host memory; tests/test_quantize_memory_gpu.py runs the same on a GPU. And the
float layers those replace, left on the host, when a float clone reuses the quantized model's load."""
import torch

from overdrive.comfy_host.layer_tensors import tensors_of
from overdrive.comfy_host.pinned_home import HomeOfLayer, PinnedHome
from overdrive.quantization import Int8Linear


def quantized_layer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Int8Linear.from_float(torch.nn.Linear(64, 48))


def test_a_layer_home_holds_every_tensor_aligned_with_its_dtype_and_shape():
    layer = quantized_layer()
    layer.register_buffer("flag", torch.tensor(True))  # a 0-d tensor of another dtype beside the 8-bit weight
    home = HomeOfLayer(layer)
    for (*_, tensor), view in zip(tensors_of(layer), home.views):
        assert (view.dtype, view.shape) == (tensor.dtype, tensor.shape)
        assert (view.data_ptr() - home.block.data_ptr()) % 256 == 0
    assert home.nbytes >= sum(t.numel() * t.element_size() for *_, t in tensors_of(layer))


def test_the_home_takes_a_layers_data_and_a_slot_that_holds_it_copies_nothing():
    layer, home = quantized_layer(), PinnedHome()
    views = home.views(layer)
    assert home.nbytes() > 0
    assert all(torch.equal(view, tensor) for (*_, view), (*_, tensor) in zip(views, tensors_of(layer)))
    sub, kind, name, tensor = tensors_of(layer)[0]
    tensor.add_(1)  # written in place (Switch Weights re-quantizes so): a slot apart from its home is copied again
    assert home.send([layer], keep_on_card=True) > 0
    assert torch.equal(home.views(layer)[0][3], tensor)
    for sub, kind, name, view in home.views(layer):  # the slots hold their home (an unloaded layer): nothing to copy
        getattr(sub, kind)[name] = view
    assert home.send([layer], keep_on_card=True) == 0


def test_a_layers_home_goes_with_the_layer():
    home = PinnedHome()
    layer = quantized_layer()
    home.views(layer)
    assert len(home.homes) == 1
    del layer
    import gc
    gc.collect()
    assert len(home.homes) == 0


def test_a_home_made_during_a_prompt_takes_a_copy_outside_one():
    """ComfyUI runs prompts in inference mode, and /free unloads outside it: a home made in the first is written in
    the second (an inference tensor there refused the copy, and every /free fell back)."""
    home = PinnedHome()
    with torch.inference_mode():
        layer = quantized_layer()
        home.views(layer)
    sub, kind, name, tensor = tensors_of(layer)[0]
    getattr(sub, kind)[name] = fresh = tensor.clone() + 1  # another tensor in the slot, made outside a prompt
    assert home.send([layer], keep_on_card=True) > 0
    assert torch.equal(home.views(layer)[0][3], fresh)


def test_float_layers_stranded_on_the_host_go_to_the_card_while_it_has_room_and_else_cast_from_the_host(comfy,
                                                                                                      monkeypatch):
    """A float clone that reuses the quantized model's whole load finds the float layers the quantized one had sent to
    the host (quantized_follower.place_stranded): each goes to the card while its budget has room, the rest cast at
    each call as ComfyUI's low-VRAM load makes them; a layer that casts already stays where it is. The meta device
    stands in for the card."""
    import comfy.ops
    from overdrive.comfy_host import quantized_follower
    from overdrive.comfy_host.layer_tensors import tensor_bytes

    def layer(ops):
        made = ops.Linear(16, 16)
        made.weight, made.bias = torch.nn.Parameter(torch.randn(16, 16)), torch.nn.Parameter(torch.randn(16))
        return made
    first, second, third = (layer(comfy.ops.disable_weight_init) for _ in range(3))
    casting = layer(comfy.ops.manual_cast)
    kept = []

    class Model:  # ComfyUI's BaseModel: its estimate of a call's activations, its low-VRAM mark
        model_lowvram = False

        def memory_required(self, shape):
            return 2**31 * shape[0]

    def room(device, activations):
        kept.append(activations)
        return 2 * tensor_bytes(first)
    monkeypatch.setattr(quantized_follower, "room_for_weights", room)
    model = Model()
    quantized_follower.place_stranded([first, second, third, casting], torch.empty(2, 4, device="meta"), model)
    assert first.weight.is_meta and second.weight.is_meta
    assert not third.weight.is_meta and third.comfy_cast_weights and third.prev_comfy_cast_weights is False
    assert not casting.weight.is_meta and not hasattr(casting, "prev_comfy_cast_weights")
    assert kept == [2**32] and model.model_lowvram  # the call's activations kept free; ComfyUI's unload undoes the cast
