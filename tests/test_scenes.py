"""The reference models' procedural scenes (builtin_models/scenes.py): every word changes the picture, a prompt reads
back as the scene it names, a clip's shape moves as its motion word says, and the conditioning is a fixed vector per
word."""
import dataclasses

import pytest
import torch

from overdrive.builtin_models import scenes


def centroid(image: torch.Tensor, background: torch.Tensor) -> torch.Tensor:
    """(x, y) of the pixels that differ from the background, in pixels."""
    mask = ((image - background[:, None, None]).abs().sum(0) > 0.1).float()
    y, x = torch.meshgrid(torch.arange(image.shape[1]), torch.arange(image.shape[2]), indexing="ij")
    return torch.stack([(x * mask).sum(), (y * mask).sum()]) / mask.sum()


def test_the_same_scene_renders_the_same_pixels_and_every_word_changes_them():
    scene = scenes.Scene()
    image = scenes.render(scene)
    assert image.shape == (3, 64, 64) and image.min() >= -1 and image.max() <= 1
    assert torch.equal(image, scenes.render(scene))
    for attribute, words in scenes.ATTRIBUTES.items():
        if attribute == "motion":  # a still image has no motion
            continue
        for word in words:
            if word != getattr(scene, attribute):
                other = scenes.render(dataclasses.replace(scene, **{attribute: word}))
                assert (other - image).abs().mean() > 1e-3, (attribute, word)


def test_a_prompt_reads_back_as_its_scene_and_bad_words_are_named():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        scene = scenes.random_scene(generator, video=True)
        assert scenes.parse(scene.prompt(video=True)) == scene
    assert scenes.parse("blue square") == scenes.Scene(colour="blue", shape="square")
    with pytest.raises(scenes.SceneError, match="'cat'.*shape: circle"):
        scenes.parse("red cat")
    with pytest.raises(scenes.SceneError, match="colour twice"):
        scenes.parse("red blue circle")


def test_a_clips_shape_travels_in_its_motion_words_direction():
    background = torch.tensor(scenes.BACKGROUNDS["on-dark"]) * 2 - 1
    for motion, (dx, dy) in scenes.MOTIONS.items():
        clip = scenes.render(scenes.Scene(motion=motion, size="small"), size=64, frames=5)
        assert clip.shape == (3, 5, 64, 64)
        moved = centroid(clip[:, -1], background) - centroid(clip[:, 0], background)
        expected = torch.tensor([dx, dy]) * scenes.TRAVEL * 64
        assert torch.allclose(moved, expected, atol=1.0), (motion, moved, expected)


def test_conditioning_is_a_fixed_vector_per_word_then_padding():
    prompt = "small green diamond striped top-left on-light"
    tokens = scenes.embed(prompt, width=32, tokens=8)
    assert tokens.shape == (1, 8, 32) and torch.equal(tokens, scenes.embed(prompt, 32, 8))
    assert torch.equal(tokens[0, 2], scenes.word_vector("diamond", 32)) and not tokens[0, 6:].any()
    other = scenes.embed(prompt.replace("green", "red"), width=32, tokens=8)
    assert not torch.equal(other[0, 1], tokens[0, 1]) and torch.equal(other[0, 2:], tokens[0, 2:])
    assert scenes.pooled(prompt, 16).shape == (1, 16)
    with pytest.raises(scenes.SceneError, match="cannot hold"):
        scenes.embed(prompt, width=32, tokens=4)
