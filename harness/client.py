"""A small client for ComfyUI's HTTP API: queue prompts, wait for them, find their outputs."""
import json
import pathlib
import time
import urllib.error
import urllib.request
import uuid

from ..core.errors import OverdriveError


class PromptFailed(OverdriveError, RuntimeError):
    pass


class ComfyClient:
    def __init__(self, url: str, client_id: str | None = None):
        self.url = url.rstrip("/")
        self.client_id = client_id or uuid.uuid4().hex

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as response:
            return json.loads(response.read())

    def post(self, path: str, payload: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            raise PromptFailed(f"POST {path} answered {error.code}: {error.read().decode(errors='replace')}") from None

    def object_info(self) -> dict:
        return self.get("/object_info")

    def queue(self, prompt: dict) -> str:
        """POST /prompt; returns the prompt id. A prompt ComfyUI rejects raises PromptFailed with its reason."""
        return self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})["prompt_id"]

    def finished(self, prompt_id: str, timeout: float = 900) -> dict:
        """Poll /history until the prompt has ended, however it ended; returns its history entry (its status says
        how). Raises TimeoutError if it has not ended within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get(f"/history/{prompt_id}").get(prompt_id)
            if entry:  # ComfyUI writes the history entry once the prompt has ended, with its status
                return entry
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout} s")

    def wait(self, prompt_id: str, timeout: float = 900) -> dict:
        """The history entry of the prompt once it finished. Raises on error or timeout."""
        entry = self.finished(prompt_id, timeout)
        status = entry.get("status", {})
        if status.get("status_str") == "error":
            raise PromptFailed(f"prompt {prompt_id} failed: {json.dumps(status.get('messages'))[:3000]}")
        return entry

    def events(self):
        """This client id's websocket, to follow prompts as they run (open it before queueing): an EventStream."""
        from .events import EventStream
        return EventStream(self.url, self.client_id)

    def run(self, prompt: dict, timeout: float = 900) -> dict:
        return self.wait(self.queue(prompt), timeout)

    @staticmethod
    def output_files(entry: dict, output_dir, kind: str = "images") -> list[pathlib.Path]:
        """Files a finished prompt wrote (SaveImage's 'images', SaveLatent's 'latents')."""
        files = []
        for node_output in entry.get("outputs", {}).values():
            for item in node_output.get(kind, []):
                files.append(pathlib.Path(output_dir) / item.get("subfolder", "") / item["filename"])
        return files
