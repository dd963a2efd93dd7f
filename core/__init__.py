"""The core between the engines and the hosts: how one accelerated forward is composed (stack.py: Stack, Host, build;
blockwise.py: a family's model run block by block) and the runtime helpers every layer uses (per-call options, stops,
storage, CUDA streams, weight watching, errors, plug-in registries)."""
