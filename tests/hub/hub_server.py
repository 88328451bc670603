"""A local stand-in for the Hub's HTTP API on 127.0.0.1 that records every request.

It answers the calls `huggingface_hub` makes for create_repo, create_branch and create_commit
(README validation, preupload, the NDJSON commit) the way the Hub documents them, asking for
"regular" (inline base64) uploads so no LFS or Xet storage is involved. Tests point
HF_ENDPOINT at it and drive the real client.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclasses.dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)

    def ndjson(self) -> list[dict]:
        return [json.loads(line) for line in self.body.splitlines() if line.strip()]


@dataclasses.dataclass
class HubServer:
    url: str
    requests: list[Request]
    fail_with: dict[str, int]  # path regex -> status to answer instead

    def committed_files(self) -> dict[str, bytes]:
        """path -> content of the files in the (single) commit."""
        commits = [r for r in self.requests if "/commit/" in r.path]
        assert len(commits) == 1, f"{len(commits)} commits"
        return {op["value"]["path"]: base64.b64decode(op["value"]["content"])
                for op in commits[0].ndjson() if op["key"] == "file"}


def _handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep pytest output clean
            pass

        def _answer(self, status: int, payload) -> None:
            raw = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _handle(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            req = Request(self.command, self.path, dict(self.headers), body)
            server.requests.append(req)
            for pattern, status in server.fail_with.items():
                if re.search(pattern, self.path):
                    return self._answer(status, {"error": f"refused by test ({status})"})
            path = self.path.split("?")[0]
            if path == "/api/repos/create":
                d = req.json()
                return self._answer(200, {"url": f"{server.url}/{d['organization']}/"
                                                 f"{d['name']}"})
            if path == "/api/validate-yaml":
                return self._answer(200, {"errors": [], "warnings": []})
            if m := re.fullmatch(r"/api/models/(.+)/preupload/(.+)", path):
                files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                         for f in req.json()["files"]]
                return self._answer(200, {"files": files})
            if m := re.fullmatch(r"/api/models/(.+)/branch/(.+)", path):
                return self._answer(200, {})
            if m := re.fullmatch(r"/api/models/(.+)/commit/(.+)", path):
                return self._answer(200, {"commitUrl": f"{server.url}/{m[1]}/commit/c0ffee",
                                          "commitOid": "c0ffee", "pullRequestUrl": None})
            return self._answer(404, {"error": f"no route for {self.command} {path}"})

        do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _handle

    return Handler


@contextlib.contextmanager
def hub_server():
    """Yields a running `HubServer`; shuts it down afterwards."""
    state = HubServer("", [], {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
