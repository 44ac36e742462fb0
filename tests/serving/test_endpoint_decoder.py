"""engine=endpoint against a stand-in vLLM server (http.server in a thread): /v1/models, /v1/completions with
token ids and return_token_ids, /metrics differenced around each request; the errors name the url."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specheads.serving.endpoint import EndpointDecoder, EndpointError

STATE = {"drafts": 0, "accepted": 0, "gen": 0}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._send(200, json.dumps({"data": [{"id": "smollm2"}]}).encode())
        if self.path == "/metrics":
            s = STATE
            text = (f'vllm:spec_decode_num_drafts_total{{engine="0"}} {s["drafts"]}\n'
                    f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {3 * s["drafts"]}\n'
                    f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {s["accepted"]}\n'
                    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {s["accepted"]}\n'
                    f'vllm:generation_tokens_total{{engine="0"}} {s["gen"]}\n')
            return self._send(200, text.encode(), "text/plain")
        self._send(404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or body.get("model") != "smollm2":
            return self._send(400, json.dumps({"error": f"bad request {self.path} {body.get('model')}"}).encode())
        assert body["temperature"] == 0.0 and body["return_token_ids"] is True
        n = body["max_tokens"]
        STATE["drafts"] += 5
        STATE["accepted"] += 4
        STATE["gen"] += n
        tokens = [t + 1 for t in body["prompt"]][:n]
        self._send(200, json.dumps({"choices": [{"text": "x", "token_ids": tokens}]}).encode())


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_request_and_its_counters(server):
    decoder = EndpointDecoder(server + "/v1/")  # the API base is accepted too
    assert decoder.model == "smollm2" and decoder.url == server
    first = decoder.generate([5, 6, 7], 3)
    second = decoder.generate([1, 2], 2)
    assert first.token_ids == [6, 7, 8] and second.token_ids == [2, 3]
    for decoded, gen in ((first, 3), (second, 2)):
        c = decoded.counters
        assert (c.drafts, c.draft_tokens, c.accepted, c.accepted_per_pos, c.generation_tokens) == (5, 15, 4, [4], gen)


def test_errors_name_the_url(server):
    with pytest.raises(EndpointError, match="HTTP 400"):
        EndpointDecoder(server, model="other").generate([1], 1)
    with pytest.raises(EndpointError, match="cannot reach the server"):
        EndpointDecoder("http://127.0.0.1:9", model="m").generate([1], 1)
