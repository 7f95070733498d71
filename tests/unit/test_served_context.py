"""The served context (trl_aspo.infra.served_context): what `/v1/models` reports, and the per-turn check of TRL's
rollout loop. The HTTP server here answers only `/v1/models` the way vLLM 0.31's OpenAI server does (its JSON shape);
tests/vllm_tier/test_context_vllm.py runs both checks against the real server."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_aspo.infra.served_context import ServedContextLoop, served_max_model_len


class ModelsEndpoint:
    """A local HTTP server whose `/v1/models` answers `body` (JSON-encoded unless bytes)."""

    def __init__(self, body):
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.requests = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                endpoint.requests += 1
                status = 200 if self.path == "/v1/models" else 404
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload if status == 200 else b"{}")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def vllm_models(max_model_len):
    return {"object": "list", "data": [{"id": "served", "object": "model", "max_model_len": max_model_len}]}


@pytest.fixture
def endpoint(request):
    server = ModelsEndpoint(request.param)
    yield server
    server.close()


@pytest.mark.parametrize("endpoint", [vllm_models(1024)], indirect=True)
def test_the_served_max_model_len_is_read_from_v1_models(endpoint):
    assert served_max_model_len(endpoint.url) == 1024
    assert served_max_model_len(endpoint.url + "/") == 1024


@pytest.mark.parametrize(
    "endpoint, reason",
    [
        ({"object": "list", "data": []}, "IndexError"),
        ({"data": [{"id": "served"}]}, "KeyError"),
        (b"not json", "JSONDecodeError"),
    ],
    indirect=["endpoint"],
)
def test_an_answer_without_max_model_len_is_refused_naming_the_url(endpoint, reason):
    with pytest.raises(RuntimeError, match=rf"from {endpoint.url}/v1/models \({reason}"):
        served_max_model_len(endpoint.url)


@pytest.mark.parametrize("endpoint", [vllm_models(0), vllm_models("512"), vllm_models(True)], indirect=True)
def test_a_max_model_len_that_is_not_a_positive_integer_is_refused(endpoint):
    with pytest.raises(RuntimeError, match="not a positive integer"):
        served_max_model_len(endpoint.url)


def test_an_unreachable_server_is_named():
    endpoint = ModelsEndpoint(vllm_models(512))
    url = endpoint.url
    endpoint.close()
    with pytest.raises(RuntimeError, match=rf"from {url}/v1/models \(ConnectionError"):
        served_max_model_len(url, timeout_s=5)


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


class OneTurnLoop:
    """The part of TRL's `_AsyncRolloutLoop` the mixin uses: its server URL, budget, tokenizer and a turn."""

    def __init__(self, url, max_tokens):
        self.vllm_server_url, self.max_tokens, self.tokenizer = url, max_tokens, WordTokenizer()
        self.turns = []

    async def _generate_one_turn(self, prompt_ids):
        self.turns.append(list(prompt_ids))
        return [7], [-0.5]


class CheckedLoop(ServedContextLoop, OneTurnLoop):
    pass


@pytest.mark.parametrize("endpoint", [vllm_models(16)], indirect=True)
def test_each_turn_must_fit_the_served_context_which_is_asked_once(endpoint):
    loop = CheckedLoop(endpoint.url, max_tokens=6)
    assert asyncio.run(loop._generate_one_turn(list(range(10)))) == ([7], [-0.5])  # 10 + 6 = 16 positions: fits
    with pytest.raises(ValueError) as refused:
        asyncio.run(loop._generate_one_turn(list(range(11))))
    assert str(refused.value).startswith(
        "The conversation starting 'w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10' has 11 tokens: with max_completion_length=6 it "
        "needs 17 positions, more than the model's context of 16."
    )
    assert loop.turns == [list(range(10))] and endpoint.requests == 1


@pytest.mark.parametrize("endpoint", [vllm_models(16)], indirect=True)
def test_a_budget_of_the_whole_served_context_is_refused_at_the_first_turn(endpoint):
    loop = CheckedLoop(endpoint.url, max_tokens=16)
    with pytest.raises(ValueError, match=r"max_completion_length=16 must be smaller than the model's context of 16 "):
        asyncio.run(loop._generate_one_turn([1]))
    assert loop.turns == []
