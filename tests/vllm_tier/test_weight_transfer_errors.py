"""The CPU weight transfer refuses a server without vLLM's development endpoints by name: a local HTTP server that
answers 404 there, as vLLM does without VLLM_SERVER_DEV_MODE=1 (requests, which the transfer uses, comes with vLLM)."""

from __future__ import annotations

import http.server
import threading

import pytest

from trl_aspo.infra.vllm_cpu import CPUWeightTransfer


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path == "/health" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"{}" if code == 200 else b"Not Found")

    def log_message(self, *args):
        pass


def test_weight_transfer_names_the_missing_development_endpoints():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        transfer = CPUWeightTransfer(f"http://127.0.0.1:{server.server_address[1]}", server_timeout=5)
        with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
            transfer.init_weight_transfer()
    finally:
        server.shutdown()
