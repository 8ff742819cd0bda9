"""Load a supported HF checkpoint (config.json + safetensors) from a local directory.

The model is built abstractly (`nnx.eval_shape`, no parameter memory), then
each parameter is read straight from its safetensors file, checked against
the expected shape and cast to the requested dtype. Only safetensors are
read (no pickled `.bin`), and no remote code is ever trusted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from esurge.core.kv_cache_spec import CacheGroupsConfig, cache_groups_from_hf_config
from esurge.models.cpu_kernels import kernels_serve
from esurge.models.decoder import CausalLM
from esurge.models.decoder_config import DecoderConfig
from esurge.models.families import decoder_config_from_hf
from esurge.models.forward import ModelState, Params
from esurge.models.fusion import fuse_projections, pack_projections
from esurge.models.registry import architecture_of, policy_for

__all__ = ["LOAD_DTYPES", "LoadedModel", "load_model"]

LOAD_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A loaded checkpoint: the model pytree plus what the engine needs to know about it."""

    model_state: ModelState
    config: DecoderConfig
    hf_config: Any
    architecture: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    model_dir: Path

    @property
    def graphdef(self) -> nnx.GraphDef[CausalLM]:
        """The static nnx graph definition."""
        return self.model_state.graphdef

    @property
    def params(self) -> Params:
        """The parameter arrays."""
        return self.model_state.params

    def cache_groups(self, num_pages: int, page_size: int) -> CacheGroupsConfig:
        """The KV cache groups of this model over a pool of num_pages pages."""
        return cache_groups_from_hf_config(self.hf_config, num_pages, page_size, self.dtype)


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: model_dir / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise ValueError(f"{index} names {file.name}, which does not exist")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in {model_dir} (pickled .bin checkpoints "
                         "are not supported)")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="flax") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                files.setdefault(name, shard)
    return files


def _param_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(key, "key", key)) for key in path)


def _read_params(
    abstract: Params, files: dict[str, Path], model_dir: Path, dtype: jnp.dtype
) -> Params:
    handles: dict[Path, Any] = {}

    def load(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = _param_name(path)
        file = files.get(name)
        if file is None:
            raise ValueError(f"checkpoint in {model_dir} is missing tensor {name!r}")
        if file not in handles:
            handles[file] = safe_open(str(file), framework="flax")
        handle = handles[file]
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != tuple(leaf.shape):
            raise ValueError(f"tensor {name!r} has shape {shape}, expected {tuple(leaf.shape)}")
        return jnp.asarray(handle.get_tensor(name), dtype=dtype)

    try:
        return jax.tree_util.tree_map_with_path(load, abstract)
    finally:
        handles.clear()


def _eos_ids(model_dir: Path, hf_config: Any) -> tuple[int, ...]:
    found: list[int] = []
    sources = [getattr(hf_config, "eos_token_id", None)]
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for value in sources:
        for token in (value if isinstance(value, list) else [value]):
            if isinstance(token, int) and token not in found:
                found.append(token)
    return tuple(found)


def load_model(model_dir: str | Path, dtype: str = "float32", *,
               fuse: bool = True, pack: bool | None = None) -> LoadedModel:
    """Load the checkpoint in model_dir as float32 or bfloat16 parameters.

    fuse: bring the projections into the serving layout (esurge.models.fusion);
    False keeps the checkpoint's own module tree and parameter names.
    pack: also store them in column panels for the CPU matmul kernel (needs
    fuse); None packs where the kernels serve the dtype (XLA:CPU, float32).
    """
    from transformers import AutoConfig  # heavy import, only needed here

    if dtype not in LOAD_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(LOAD_DTYPES)}, got {dtype!r}")
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json")
    hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    architecture = architecture_of(hf_config)
    config = decoder_config_from_hf(hf_config, policy_for(architecture))
    jdtype = LOAD_DTYPES[dtype]
    if pack and not fuse:
        raise ValueError("pack=True needs fuse=True")
    abstract = nnx.eval_shape(lambda: CausalLM(config, dtype=jdtype))
    graphdef, abstract_params = nnx.split(abstract)
    params = _read_params(nnx.to_pure_dict(abstract_params), _tensor_files(path), path, jdtype)
    state = ModelState(graphdef=graphdef, params=params)
    if fuse:
        config, state = fuse_projections(config, state, jdtype)
    if fuse and (kernels_serve(jdtype) if pack is None else pack):
        config, state = pack_projections(config, state, jdtype)
    return LoadedModel(
        model_state=state,
        config=config,
        hf_config=hf_config,
        architecture=architecture,
        vocab_size=config.vocab_size,
        eos_token_ids=_eos_ids(path, hf_config),
        dtype=dtype,
        model_dir=path,
    )
