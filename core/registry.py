"""One registration style for every kind of plug-in (quantization formats, attention backends, model families): a
plug-in's own module calls `register` when it is imported, and the rest of Overdrive looks plug-ins up by name."""


class Registry(dict):
    """Plug-ins of one kind by name, in the order they registered (the order UI lists show)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str, plugin):
        """Adds `plugin` under `name` and returns it; a second plug-in under a taken name is refused."""
        if self.get(name, plugin) is not plugin:
            raise ValueError(f"a {self.kind} named {name!r} is registered already ({self[name]!r})")
        self[name] = plugin
        return plugin

    def lookup(self, name: str):
        """The plug-in named `name`; an unknown name raises a KeyError listing the registered ones."""
        try:
            return self[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}: choose one of {', '.join(self)}") from None
