"""A small OpenAI-compatible chat server on 127.0.0.1 for `regenerate --endpoint` tests.

Answers are a deterministic function of the request, so two runs can be compared byte for
byte. It can refuse prompts (HTTP 400 for a user message containing TOOLONG), fail now and
then (the first attempt of every `flaky`-th distinct request gets `fail_code`, 503 unless
told, which a retry gets past), go down for good after `up_for` answers, or hold every
request after `hold_after` answers until the test ends (`held` is set once one waits); it
records every request body it answered and counts every request (`calls`).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading


class ChatServer:
    def __init__(self, flaky: int = 0, up_for: int | None = None, fail_code: int = 503,
                 hold_after: int | None = None):
        self.flaky, self.up_for, self.fail_code = flaky, up_for, fail_code
        self.hold_after = hold_after
        self.held = threading.Event()  # a request is being held
        self._release = threading.Event()
        self.bodies: list[dict] = []
        self.calls = 0
        self.failed: set[str] = set()  # requests already failed once (flaky)
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "tiny-chat"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = json.dumps(body, sort_keys=True)
                with server.lock:
                    server.calls += 1
                    calls = server.calls
                    answered = len(server.bodies)
                    flake = (server.flaky and calls % server.flaky == 0
                             and key not in server.failed)
                    if flake:
                        server.failed.add(key)
                if server.hold_after is not None and answered >= server.hold_after:
                    server.held.set()
                    server._release.wait()
                    with contextlib.suppress(OSError):  # the client may be gone by now
                        self._send(503, {"error": {"message": "released"}})
                    return None
                if server.up_for is not None and answered >= server.up_for:
                    return self._send(503, {"error": {"message": "down for maintenance"}})
                if flake:  # once per request: its retry succeeds
                    return self._send(server.fail_code, {"error": {"message": "busy"}})
                user = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
                if "TOOLONG" in user:
                    return self._send(400, {"error": {"message": "prompt is too long"}})
                with server.lock:
                    server.bodies.append(body)
                turn = sum(m["role"] == "assistant" for m in body["messages"])
                text = (f"re {user[:24]!r} turn {turn} t={body['temperature']} "
                        f"seed={body['seed']}")
                self._send(200, {"choices": [{"message": {"role": "assistant",
                                                          "content": text},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": len(str(body)) // 4,
                                           "completion_tokens": len(text) // 4}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
