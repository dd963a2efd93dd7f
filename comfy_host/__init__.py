"""The ComfyUI host: everything that adapts Overdrive's engines to ComfyUI's ModelPatcher (object patches, wrappers,
callbacks, dynamic VRAM, LoRA patches beside quantized layers, weight switching, Parallel Model's workers), and what
each node does. The nodes (nodes/) only declare their inputs and call one function here."""
