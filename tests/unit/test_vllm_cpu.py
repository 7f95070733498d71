"""trl_aspo.infra.vllm_cpu without an engine: tied names written out and the scoped class swap in GRPOTrainer's module.
The engine itself is exercised in tests/vllm_tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trl_aspo.infra.vllm_cpu import cpu_weight_sync, on_cpu, tied_parameter_aliases, with_tied_aliases


def test_tied_output_layer_is_named_and_written_as_its_own_tensor(tiny_model):
    aliases = tied_parameter_aliases(tiny_model)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    tensors = with_tied_aliases(tiny_model.named_parameters(), aliases)
    assert "lm_head.weight" not in dict(tiny_model.named_parameters())  # named_parameters yields a tied one once
    assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert tensors["lm_head.weight"].data_ptr() != tensors["model.embed_tokens.weight"].data_ptr()  # safetensors
    assert len(tensors) == len(dict(tiny_model.named_parameters())) + 1


def test_untied_model_has_no_aliases():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert tied_parameter_aliases(model) == {}
    shared = torch.nn.Linear(2, 2)
    assert tied_parameter_aliases(torch.nn.Sequential(shared, shared)) == {"1.weight": "0.weight", "1.bias": "0.bias"}


def test_alias_without_its_source_is_not_invented():
    tensors = with_tied_aliases([("a", torch.ones(2))], {"b": "a", "c": "missing"})
    assert set(tensors) == {"a", "b"}


def test_grpo_trainer_builds_the_cpu_generation_only_inside_the_scope():
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer import grpo_trainer

    with cpu_weight_sync(False):
        assert grpo_trainer.VLLMGeneration is VLLMGeneration
    with cpu_weight_sync(True):
        swapped = grpo_trainer.VLLMGeneration
        assert swapped is not VLLMGeneration and issubclass(swapped, VLLMGeneration)
    assert grpo_trainer.VLLMGeneration is VLLMGeneration
    with pytest.raises(RuntimeError), cpu_weight_sync(True):
        raise RuntimeError("construction failed")
    assert grpo_trainer.VLLMGeneration is VLLMGeneration


def test_on_cpu():
    assert on_cpu("cpu") and on_cpu(torch.device("cpu")) and not on_cpu("cuda:0")


def test_served_dtype_asks_the_server_once():
    """The dev-endpoint check and the dtype warning both read the dtype; the server is asked once (its dtype is fixed
    at start). The session is replaced by a recorder: this checks the request count, the tier checks the real
    server's answer."""
    from trl_aspo.infra.vllm_cpu import VLLMServerReload

    class Response:
        status_code, content = 200, b"{}"

        def json(self):
            return {"vllm_config": {"model_config": {"dtype": "torch.float32"}}}

    class Session:
        paths: list[str] = []

        def request(self, method, url, **kwargs):
            self.paths.append(url)
            return Response()

    reload = VLLMServerReload("http://127.0.0.1:1")
    reload._session = Session()
    assert [reload.served_dtype(), reload.served_dtype()] == ["float32", "float32"]
    assert reload._session.paths == ["http://127.0.0.1:1/server_info"]


def _recording_session(seen: list, fail_on: str | None = None):
    """A session that records each request's path and, for a reload, whether its weights file exists then."""

    class Response:
        status_code, content = 200, b""

    class Session:
        def request(self, method, url, json=None, **kwargs):
            path = url.removeprefix("http://127.0.0.1:1")
            weights = json["kwargs"]["weights_path"] if json else None
            seen.append((path, weights, weights is not None and (Path(weights) / "model.safetensors").is_file()))
            if path == fail_on:
                raise ConnectionError("the server went away")
            return Response()

        def close(self):
            seen.append(("closed", None, False))

    return Session()


def test_a_reload_leaves_no_weights_in_the_temporary_directory(tmp_path, monkeypatch):
    """The weights file exists while the server reads it and is gone when `reload` returns, or raises: the trainer
    never has to call `close` for the temporary directory to stay clean (issue 25, item 8)."""
    import tempfile

    from trl_aspo.infra.vllm_cpu import VLLMServerReload

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen: list = []
    reload = VLLMServerReload("http://127.0.0.1:1", aliases={"lm_head.weight": "embed.weight"})
    reload._session = _recording_session(seen)
    reload.reload(iter([("embed.weight", torch.ones(2, 2))]))
    assert [(path, exists) for path, _, exists in seen] == [("/collective_rpc", True), ("/reset_prefix_cache", False)]
    assert list(tmp_path.iterdir()) == []

    reload._session = _recording_session(seen, fail_on="/collective_rpc")
    with pytest.raises(ConnectionError):
        reload.reload(iter([("embed.weight", torch.ones(2, 2))]))
    assert list(tmp_path.iterdir()) == []
