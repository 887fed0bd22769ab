"""A local OpenAI-compatible judge endpoint that injects faults (``http.server``, one thread per
request): ``POST /v1/chat/completions`` answers a chat completion as OpenAI's API reference
lays it out, or a fault chosen by a marker in the judge's message:

- ``case:slow``: the reply comes after ``slow_s`` seconds;
- ``case:500``: HTTP 500 always; ``case:500once``: HTTP 500 to the first request of that
  message, a reply afterwards;
- ``case:malformed``: HTTP 200 with a body cut off in the middle of its JSON;
- ``case:nochoices``: HTTP 200, valid JSON without ``choices``;
- ``case:text``: a reply without a score;
- ``score:N``: the reply ends with "Score: N" (default 7).

Every request is recorded (its JSON body), and so is the most requests ever in flight at once.
Every request also waits ``delay_s`` first (to make concurrency visible).
"""

from __future__ import annotations

import http.server
import json
import re
import threading
import time


class FaultyJudge:
    """The server; a context manager (``url`` is its ``.../v1`` base URL)."""

    def __init__(self, delay_s: float = 0.0, slow_s: float = 3.0, fail_every: int = 0):
        self.delay_s, self.slow_s = delay_s, slow_s
        self.fail_every = fail_every  # > 0: every n-th request (1-based) gets HTTP 500
        self.requests: list[dict] = []
        self.failed = 0  # HTTP 500s sent
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/v1"

    def __enter__(self) -> FaultyJudge:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def respond(self, body: dict) -> tuple[int, bytes]:
        """(status, body) for one request; records it and the requests in flight."""
        message = body["messages"][-1]["content"]
        with self._lock:
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            count = len(self.requests)
            seen = self._seen[message] = self._seen.get(message, 0) + 1
        try:
            time.sleep(self.delay_s)
            status, data = self._reply(message, body, seen, count)
            if status == 500:
                with self._lock:
                    self.failed += 1
            return status, data
        finally:
            with self._lock:
                self.in_flight -= 1

    def _reply(self, message: str, body: dict, seen: int, count: int) -> tuple[int, bytes]:
        error = json.dumps({"error": {"message": "injected fault", "type": "server_error"}})
        if "case:500" in message and (seen == 1 or "case:500once" not in message):
            return 500, error.encode()
        if self.fail_every and count % self.fail_every == 0:
            return 500, error.encode()
        if "case:malformed" in message:
            return 200, b'{"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"mess'
        if "case:nochoices" in message:
            return 200, json.dumps({"id": "chatcmpl-1", "object": "chat.completion"}).encode()
        if "case:slow" in message:
            time.sleep(self.slow_s)
        found = re.search(r"score:(\d+)", message)
        text = ("I cannot tell." if "case:text" in message
                else f"The answer is fine.\nScore: {found.group(1) if found else 7}")
        return 200, json.dumps(_completion(body["model"], text)).encode()


def _completion(model: str, text: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def _handler(judge: FaultyJudge) -> type:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.rstrip("/") != "/v1/chat/completions":
                status, data = 404, b'{"error": {"message": "not found"}}'
            else:
                status, data = judge.respond(body)
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up (its timeout)
                pass

        def log_message(self, *args):
            pass

    return Handler
