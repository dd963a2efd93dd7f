"""ComfyUI's own prompt executor in this process, started as main.py starts it: its arguments (dynamic VRAM where
main.py turns it on), its nodes with Overdrive's, its output cache (RAM pressure, with main.py's default headroom), its
progress hook (which is where a stop reaches a sampler); prompts validated and executed as its prompt worker does, a
stop as /interrupt makes it and a /free as the prompt worker performs it. No HTTP server: the figures are the
process's own (host memory, the device's memory), and nothing of a web server is needed where the GPU is.
"""
import asyncio
import contextlib
import gc
import logging
import threading
import time
import uuid

from .inprocess import import_comfy


class QuietServer:
    """What the executor tells a web server: kept as messages ({"type", "data"}), with the node that runs now."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.messages = []
        self.on_executing = None  # called with (prompt id, node id) as each node starts
        self.started = []  # (node id, time.perf_counter()) as each node of the current prompt starts

    def send_sync(self, event, data, sid=None):
        self.messages.append({"type": event, "data": data})
        if event == "executing" and isinstance(data, dict):
            self.started.append((data.get("node"), time.perf_counter()))
            if self.on_executing is not None:
                self.on_executing(data.get("prompt_id"), data.get("node"))

    def node_seconds(self) -> dict:
        """{node id: seconds from its start to the next node's (or the prompt's end)} of the current prompt."""
        ends = self.started[1:] + [(None, time.perf_counter())]
        return {node: round(end - start, 3) for (node, start), (_, end) in zip(self.started, ends) if node}

    def queue_updated(self):
        pass


class LogCounter(logging.Handler):
    """Every log record's message from the moment it is attached (ComfyUI's and Overdrive's), to count patterns in."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot format is not what is counted
            pass


@contextlib.contextmanager
def captured_log():
    """A LogCounter on the root logger for the block, which logs at INFO meanwhile (ComfyUI's own lines included)."""
    root, counter = logging.getLogger(), LogCounter()
    level = root.level
    root.addHandler(counter)
    root.setLevel(min(level or logging.WARNING, logging.INFO))
    try:
        yield counter
    finally:
        root.removeHandler(counter)
        root.setLevel(level)


class InProcessComfy:
    """`run(prompt)` -> (how it ended, seconds); `stop_when(class_type, after)` before it; `free()`."""

    def __init__(self, output_dir, folders: dict, cpu: bool, dynamic_vram: bool = False, budget_gib=None):
        """`folders`: {ComfyUI model folder: [directories]} the loaders read."""
        self.comfy = import_comfy(cpu=cpu, dynamic_vram=dynamic_vram, budget_gib=budget_gib)
        import comfy.model_management
        import comfy.utils
        import execution
        import folder_paths
        import nodes
        from comfy_execution.progress import get_progress_state

        from ..nodes import NODES
        for folder, directories in folders.items():
            for directory in directories:
                folder_paths.add_model_folder_path(folder, str(directory))
        folder_paths.set_output_directory(str(output_dir))
        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
        nodes.NODE_CLASS_MAPPINGS.update(NODES)  # as ComfyUI registers a custom node pack's V3 nodes

        def progress(value, total, preview_image, prompt_id=None, node_id=None):  # main.py's hijack_progress
            comfy.model_management.throw_exception_if_processing_interrupted()
            get_progress_state().update_progress(node_id or self.server.last_node_id, value, total, preview_image)
        comfy.utils.set_progress_bar_global_hook(progress)
        self.log = LogCounter()
        root = logging.getLogger()
        root.addHandler(self.log)
        root.setLevel(min(root.level or logging.WARNING, logging.INFO))  # main.py logs at INFO
        self.server = QuietServer()
        total_gib = comfy.model_management.total_ram / 1024.0  # main.py's prompt_worker's cache headroom
        cache = {"lru": 0, "ram": min(10.0, max(2.0, total_gib * 0.10)), "ram_inactive": min(128.0, total_gib)}
        self.executor = execution.PromptExecutor(self.server, cache_type=execution.CacheType.RAM_PRESSURE,
                                                 cache_args=cache)
        self.execution, self.nodes = execution, nodes

    def run(self, prompt: dict, stop_in: str | None = None, stop_after: float = 0.0) -> tuple:
        """Validate and execute `prompt`; (success | interrupted | error | invalid, seconds from ComfyUI's start to
        end messages, {class type: seconds of its nodes}). `stop_in`: the class of a node during whose run the prompt
        is stopped, `stop_after` seconds in."""
        prompt_id = uuid.uuid4().hex
        valid = asyncio.run(self.execution.validate_prompt(prompt_id, prompt, None))
        if not valid[0]:
            logging.getLogger("overdrive").error("invalid prompt: %s %s", valid[1], valid[3])
            return "invalid", None, {}
        stop_node = next((nid for nid, node in prompt.items() if node["class_type"] == stop_in), None)
        timer = None

        def on_executing(pid, node):
            nonlocal timer
            if node == stop_node and timer is None:
                timer = threading.Timer(stop_after, self.nodes.interrupt_processing, args=(True,))
                timer.start()
        self.server.on_executing = on_executing if stop_node else None
        self.server.last_prompt_id, self.server.started = prompt_id, []
        # a client id: the executor tells a client which node runs (the stop above waits for it)
        self.executor.execute(prompt, prompt_id, {"client_id": "in-process"}, valid[2])
        if timer is not None:
            timer.cancel()
        by_class = {}
        for node, seconds in self.server.node_seconds().items():
            kind = prompt[node]["class_type"] if node in prompt else node
            by_class[kind] = round(by_class.get(kind, 0.0) + seconds, 3)
        return (*ended(self.executor.status_messages), by_class)

    def free(self) -> None:
        """What /free with unload_models and free_memory does in the prompt worker."""
        import comfy.model_management
        comfy.model_management.unload_all_models()
        self.executor.reset()
        gc.collect()
        comfy.model_management.soft_empty_cache()

    def close(self) -> None:
        logging.getLogger().removeHandler(self.log)


def ended(messages: list) -> tuple:
    """(how a prompt ended: success, interrupted or error; seconds from ComfyUI's start to end messages)."""
    found = {name: data for name, data in messages}
    start = found.get("execution_start", {}).get("timestamp")
    for status in ("execution_success", "execution_interrupted", "execution_error"):
        if status in found:
            end = found[status].get("timestamp")
            seconds = (end - start) / 1000 if start is not None and end is not None else None
            return status.removeprefix("execution_"), seconds
    return "unknown", None
