"""Hand-made HTTP against the Gradio routes (what an attacker sends, not what gradio_client sends)."""

from __future__ import annotations

import json
import uuid

import httpx


def file_data(path: str) -> dict:
    return {"path": str(path), "meta": {"_type": "gradio.FileData"}}


class RawGradio:
    def __init__(self, url: str, client: httpx.Client | None = None):
        self.url = url
        self.http = client or httpx.Client(timeout=60)
        self.config = self.http.get(f"{url}/config").json()
        self.session = uuid.uuid4().hex[:11]

    def component_id(self, elem_id: str) -> int:
        return next(c["id"] for c in self.config["components"] if c.get("props", {}).get("elem_id") == elem_id)

    def fn_index(self, api_name: str | None = None, trigger: tuple[str, str] | None = None) -> int:
        """The event by its api_name, or by (elem_id or label of the target, event name)."""
        for dep in self.config["dependencies"]:
            if api_name is not None and dep.get("api_name") == api_name:
                return dep["id"]
            if trigger is not None:
                ids = {c["id"] for c in self.config["components"]
                       if trigger[0] in (c.get("props", {}).get("elem_id"), c.get("props", {}).get("label"),
                                         c.get("props", {}).get("value"))}
                if any(t[0] in ids and t[1] == trigger[1] for t in dep.get("targets", [])):
                    return dep["id"]
        raise LookupError(api_name or trigger)

    def predict(self, fn_index: int, data: list) -> httpx.Response:
        """An event that skips the queue (queue=False): answered in the response itself."""
        return self.http.post(f"{self.url}/gradio_api/run/predict", json={
            "data": data, "fn_index": fn_index, "session_hash": self.session, "event_data": None})

    def join(self, fn_index: int, data, session: str | None = None) -> httpx.Response:
        return self.http.post(f"{self.url}/gradio_api/queue/join", json={
            "data": data, "fn_index": fn_index, "session_hash": session or self.session, "event_data": None})

    def messages(self, session: str | None = None, until: int = 1) -> list[dict]:
        """Read the session's event stream until `until` events have completed (or it ends)."""
        found, done = [], 0
        with self.http.stream("GET", f"{self.url}/gradio_api/queue/data",
                              params={"session_hash": session or self.session}) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                found.append(message)
                if message.get("msg") == "process_completed":
                    done += 1
                if done >= until or message.get("msg") == "close_stream":
                    break
        return found

    def close(self) -> None:
        self.http.close()
