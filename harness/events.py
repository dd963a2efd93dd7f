"""ComfyUI's websocket (/ws?clientId=...): the messages about one client's prompts, collected as they arrive."""
import json
import threading


class EventStream:
    """`with client.events() as events:` every JSON message the server sends this client id, in arrival order
    (status, execution_start, execution_cached, executing, progress, executed, execution_error, ...).

    Open it before queueing: ComfyUI sends a prompt's messages only to the client id it was queued with.
    """

    def __init__(self, base_url: str, client_id: str, connect_timeout: float = 30):
        import websocket  # websocket-client; imported here so that the HTTP-only client does not need it

        self._closed_errors = (websocket.WebSocketConnectionClosedException, OSError)
        self.socket = websocket.create_connection(f"ws{base_url[4:]}/ws?clientId={client_id}", timeout=connect_timeout)
        self.socket.settimeout(None)
        self.messages: list[dict] = []
        self.open = True
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="comfy-websocket", daemon=True)
        self._reader.start()

    def _read(self):
        try:
            while True:
                data = self.socket.recv()
                if not data:  # the connection is closing
                    break
                if isinstance(data, str):  # binary frames are sampler preview images
                    with self._changed:
                        self.messages.append(json.loads(data))
                        self._changed.notify_all()
        except self._closed_errors:
            pass
        finally:
            with self._changed:
                self.open = False
                self._changed.notify_all()

    def of(self, prompt_id: str) -> list[dict]:
        """The messages about one prompt, in order."""
        with self._changed:
            return [m for m in self.messages if (m.get("data") or {}).get("prompt_id") == prompt_id]

    def ended(self, prompt_id: str) -> bool:
        """ComfyUI's last word on a prompt, success or failure: 'executing' with node None."""
        return any(m["type"] == "executing" and m["data"].get("node") is None for m in self.of(prompt_id))

    def follow(self, prompt_ids, timeout: float = 900) -> dict[str, list[dict]]:
        """Wait until every prompt has ended; {prompt id: its messages}. Raises if the socket closes or time runs out."""
        def done():
            return all(self.ended(pid) for pid in prompt_ids) or not self.open
        with self._changed:
            self._changed.wait_for(done, timeout)
        waiting = [pid for pid in prompt_ids if not self.ended(pid)]
        if waiting:
            raise TimeoutError(f"prompts {waiting} did not end within {timeout} s" if self.open
                               else f"the websocket closed before prompts {waiting} ended")
        return {pid: self.of(pid) for pid in prompt_ids}

    def close(self):
        self.socket.close()
        self._reader.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
