"""API-format workflows: load them, adjust their settings, and derive the eager baseline of an Overdrive workflow."""
import copy
import json
import pathlib

from ..builtin_models.dit import FAMILIES

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKFLOWS = REPO / "workflows"
BUILTIN_NAMES = {"sd15": "overdrive-builtin-sd15.safetensors", "sdxl": "overdrive-builtin-sdxl.safetensors"}
# The DiT families' built-in files, as the workflows name them: (diffusion_models file, vae file).
DIT_FAMILIES = tuple(FAMILIES)
BUILTIN_DIT_NAMES = {family: (f"overdrive-builtin-{family}.safetensors", f"overdrive-builtin-{family}-vae.safetensors")
                     for family in DIT_FAMILIES}
MODEL_FOLDERS = ("checkpoints", "diffusion_models", "vae")
LATENT_NODES = ("EmptyLatentImage", "EmptySD3LatentImage", "Wan22ImageToVideoLatent",  # the examples' empty latents
                "EmptyLTXVLatentVideo", "EmptyFlux2LatentImage", "EmptyHunyuanLatentVideo")


# The DiT families without a workflow file of their own run another's graph with their own diffusion model, VAE,
# conditioning and empty latent, cfg and steps as they are used. LTX-2 runs LTX-Video's, video only: its audio latent
# needs an audio VAE, which the built-in files do not have (ComfyUI's LTX audio nodes also need torchaudio, which
# scripts/install.sh leaves out), and the model samples an empty audio stream.
SHARED_GRAPH = {"ltx2": "compile_ltxv_api.json"}


def dit_workflow(family: str) -> dict:
    """Flux.2, Chroma, Z-Image and SD3.5 share Flux's graph, LTX-2 LTX-Video's (SHARED_GRAPH)."""
    workflow = load_workflow(SHARED_GRAPH.get(family, "compile_flux_api.json"))
    latent_node = FAMILIES[family].latent.get("node")
    if latent_node:
        next(n for n in workflow.values() if n["class_type"] == "EmptySD3LatentImage")["class_type"] = latent_node
    model, vae = BUILTIN_DIT_NAMES[family]
    set_inputs(workflow, "UNETLoader", unet_name=model)
    set_inputs(workflow, "VAELoader", vae_name=vae)
    set_inputs(workflow, "OverdriveBuiltinConditioning", family=family)
    return set_inputs(workflow, "KSampler", **FAMILIES[family].sampling)


def set_latent_size(workflow: dict, width: int, height: int, frames=None) -> dict:
    """Size every empty-latent node of `workflow`, whichever the family uses (and its frames, for video)."""
    for node in workflow.values():
        if node["class_type"] in LATENT_NODES:
            node["inputs"].update(width=width, height=height)
            if frames is not None and "length" in node["inputs"]:
                node["inputs"]["length"] = frames
    return workflow


def builtin_dit_files(families=DIT_FAMILIES, size: str = "tiny") -> dict:
    """{folder: {workflow file name: path}} for the families' built-in diffusion models and VAEs (generated once, in
    Overdrive's cache folder; needs ComfyUI importable, see builtin_models.dit)."""
    import torch

    from ..builtin_models.dit import default_directory, ensure_diffusion_model, ensure_vae
    from .inprocess import import_comfy
    import_comfy(cpu=not torch.cuda.is_available())  # their layout is read off ComfyUI's classes
    files = {"diffusion_models": {}, "vae": {}}
    for family in families:
        model_name, vae_name = BUILTIN_DIT_NAMES[family]
        files["diffusion_models"][model_name] = ensure_diffusion_model(family, size, 0, default_directory())
        files["vae"][vae_name] = ensure_vae(family, size, 0, default_directory())
    return files


def load_workflow(name_or_path) -> dict:
    path = pathlib.Path(name_or_path)
    if not path.is_file():
        path = WORKFLOWS / name_or_path
    return json.loads(path.read_text())


def set_inputs(workflow: dict, class_type: str, **values) -> dict:
    """Set inputs on every node of `class_type` (e.g. steps on KSampler); returns the workflow for chaining."""
    found = False
    for node in workflow.values():
        if node["class_type"] == class_type:
            node["inputs"].update(values)
            found = True
    if not found:
        raise KeyError(f"the workflow has no {class_type} node")
    return workflow


def prefix_images(workflow: dict, prefix: str) -> dict:
    """Every SaveImage node saves as `prefix-<node id>`: files of their own, and outputs ComfyUI must compute anew."""
    for key, node in workflow.items():
        if node["class_type"] == "SaveImage":
            node["inputs"]["filename_prefix"] = f"{prefix}-{key}"
    return workflow


def without_overdrive(workflow: dict) -> dict:
    """The same workflow with every Overdrive node that passes its first linked input through (the compile,
    quantize, cache and switch nodes) taken out and its consumers wired to what it consumed: the eager baseline.
    Nodes that make something of their own (Built-in Conditioning) stay."""
    workflow = copy.deepcopy(workflow)
    removed = {nid: node for nid, node in workflow.items() if node["class_type"].startswith("Overdrive")
               and any(isinstance(value, list) for value in node["inputs"].values())}
    def source_of(node_id):
        for value in removed[node_id]["inputs"].values():
            if isinstance(value, list):
                return source_of(value[0]) if value[0] in removed else value
        raise ValueError(f"node {node_id} has no linked input to pass through")
    for nid in removed:
        del workflow[nid]
    for node in workflow.values():
        for key, value in node["inputs"].items():
            if isinstance(value, list) and value[0] in removed:
                node["inputs"][key] = source_of(value[0])
    return workflow


def link_checkpoints(workdir, checkpoints: dict, kind: str = "checkpoints") -> None:
    """Links `checkpoints` ({file name: path}) into workdir/models/<kind> (a running ComfyUI sees new ones)."""
    folder = pathlib.Path(workdir) / "models" / kind
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in checkpoints.items():
        link = folder / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(pathlib.Path(path).resolve())


def model_paths_config(workdir, checkpoints: dict, other_files: dict | None = None) -> pathlib.Path:
    """An extra_model_paths.yaml that shows ComfyUI `checkpoints` ({file name: path}) and `other_files` ({folder:
    {file name: path}}, e.g. builtin_dit_files()) without touching its folders."""
    link_checkpoints(workdir, checkpoints)
    for kind, files in (other_files or {}).items():
        link_checkpoints(workdir, files, kind)
    config = pathlib.Path(workdir) / "extra_model_paths.yaml"
    folders = "".join(f"  {kind}: {kind}\n" for kind in MODEL_FOLDERS)
    config.write_text(f"overdrive:\n  base_path: {pathlib.Path(workdir).resolve() / 'models'}\n{folders}")
    return config
