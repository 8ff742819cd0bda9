"""Resumable training checkpoints and the Hugging Face export of the trained model.

A checkpoint is `train_state.npz` (every leaf of params and optimizer state,
in pytree order) plus `train_state.json` (step, data cursor, the run's
settings). Both are written to temporary names and renamed, so an
interrupted save never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.flax import save_file

from esurge.models.forward import Params
from tools.lm_training import BOS_ID, EOS_ID, PAD_ID, ModelShape, hf_llama_config

__all__ = ["TrainState", "export_hf", "flat_params", "load_checkpoint", "save_checkpoint"]

STATE_ARRAYS = "train_state.npz"
STATE_META = "train_state.json"


@dataclass
class TrainState:
    """Everything needed to continue training: weights, optimizer, step, data cursor."""

    params: Params
    opt_state: Any
    step: int
    cursor: int


def save_checkpoint(work_dir: Path, state: TrainState, settings: dict[str, Any]) -> None:
    """Write state (and the run's settings, to check on resume) into work_dir."""
    leaves = jax.tree_util.tree_leaves((state.params, state.opt_state))
    arrays = {f"leaf_{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)}
    tmp_arrays = work_dir / (STATE_ARRAYS + ".tmp.npz")
    np.savez(tmp_arrays, **arrays)  # type: ignore[arg-type]
    meta = {"step": state.step, "cursor": state.cursor, "num_leaves": len(leaves),
            "settings": settings}
    tmp_meta = work_dir / (STATE_META + ".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_arrays, work_dir / STATE_ARRAYS)
    os.replace(tmp_meta, work_dir / STATE_META)


def load_checkpoint(work_dir: Path, template: TrainState,
                    settings: dict[str, Any]) -> TrainState:
    """The checkpoint in work_dir, shaped like template; ValueError when it does not
    exist or was written by a run with different settings."""
    meta_path = work_dir / STATE_META
    if not meta_path.is_file():
        raise ValueError(f"--resume: no checkpoint in {work_dir} (missing {STATE_META})")
    meta = json.loads(meta_path.read_text())
    saved = meta["settings"]
    changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if changed:
        diffs = ", ".join(f"{k}: saved {saved.get(k)!r}, now {settings.get(k)!r}" for k in changed)
        raise ValueError(f"--resume with different settings than the checkpoint in "
                         f"{work_dir}: {diffs}")
    leaves, treedef = jax.tree_util.tree_flatten((template.params, template.opt_state))
    with np.load(work_dir / STATE_ARRAYS) as data:
        if len(data.files) != len(leaves) or meta["num_leaves"] != len(leaves):
            raise ValueError(f"checkpoint in {work_dir} has {len(data.files)} arrays, "
                             f"the model and optimizer have {len(leaves)}")
        loaded = [jnp.asarray(data[f"leaf_{i:05d}"]) for i in range(len(leaves))]
    for i, (got, want) in enumerate(zip(loaded, leaves, strict=True)):
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ValueError(f"checkpoint array {i} is {got.dtype}{list(got.shape)}, "
                             f"expected {want.dtype}{list(want.shape)}")
    params, opt_state = jax.tree_util.tree_unflatten(treedef, loaded)
    return TrainState(params=params, opt_state=opt_state, step=int(meta["step"]),
                      cursor=int(meta["cursor"]))


def flat_params(params: Params) -> dict[str, jax.Array]:
    """HF tensor name -> array (the module paths joined with dots)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in leaves}


def export_hf(params: Params, shape: ModelShape, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write config.json, bfloat16 model.safetensors, tokenizer and generation config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_llama_config(shape)
    config.dtype = "bfloat16"
    config.save_pretrained(str(out_dir))
    tensors = {name: jnp.asarray(value, jnp.bfloat16)
               for name, value in flat_params(params).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(tokenizer_dir / "tokenizer.json", out_dir / "tokenizer.json")
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = shape.context
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir
