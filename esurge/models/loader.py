"""Load a supported checkpoint: an HF directory (config.json + safetensors) or a GGUF file.

The model is built abstractly (`nnx.eval_shape`, no parameter memory), then
each parameter is read from its source (esurge.models.checkpoint), checked
against the expected shape and cast to the serving dtype. Only safetensors
and GGUF are read (no pickled `.bin`), and no remote code is ever trusted.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from esurge.core.kv_cache_spec import CacheGroupsConfig, cache_groups_from_hf_config
from esurge.errors import InvalidConfigError
from esurge.models.checkpoint import CheckpointSource, open_checkpoint
from esurge.models.coded_layout import CodedPanels, read_coded_panels, widened_roles
from esurge.models.cpu_kernels import (
    cpu_has_amx,
    cpu_has_avx512,
    kernels_serve,
    widened_panels_enabled,
)
from esurge.models.decoder import CausalLM
from esurge.models.decoder_config import WIDENED_BITS, DecoderConfig
from esurge.models.families import decoder_config_from_hf
from esurge.models.forward import ModelState, Params
from esurge.models.fusion import coded_config, fuse_projections, pack_projections, packed_config
from esurge.models.layout_cache import LayoutCache, LayoutInputs
from esurge.models.registry import architecture_of, policy_for
from esurge.models.slice_load import load_onto_mesh
from esurge.models.tensor_parallel import make_mesh

__all__ = ["LOAD_DTYPES", "LoadedModel", "codes_in_bfloat16", "load_model", "resolve_dtype"]

log = logging.getLogger(__name__)

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
    model_dir: Path  # the checkpoint directory, or the .gguf file
    source_kind: str = "safetensors"
    dtype_reason: str = "asked for"
    # The checkpoint's transformers tokenizer (None without one): a GGUF's
    # comes from the same open file, so it is read here, once.
    hf_tokenizer: Any = None
    # The devices the parameters are split over (None: one device).
    mesh: Mesh | None = None

    @property
    def graphdef(self) -> nnx.GraphDef[CausalLM]:
        """The static nnx graph definition."""
        return self.model_state.graphdef

    @property
    def params(self) -> Params:
        """The parameter arrays."""
        return self.model_state.params

    def cache_groups(self, num_pages: int, page_size: int,
                     kv_dtype: str | None = None) -> CacheGroupsConfig:
        """The KV cache groups of this model over a pool of num_pages pages
        (kv_dtype: the cache's dtype, by default the serving dtype)."""
        # The serving config's kv heads: replicated up to the TP degree when fewer.
        return cache_groups_from_hf_config(self.hf_config, num_pages, page_size,
                                           kv_dtype or self.dtype,
                                           num_kv_heads=self.config.num_kv_heads)


def _read_params(abstract: Params, source: CheckpointSource, dtype: jnp.dtype) -> Params:
    def load(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.Array:
        name = ".".join(str(getattr(key, "key", key)) for key in path)
        array = source.read(name)
        if tuple(array.shape) != tuple(leaf.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, expected "
                             f"{tuple(leaf.shape)}")
        return jnp.asarray(array, dtype=dtype)

    try:
        return jax.tree_util.tree_map_with_path(load, abstract)
    finally:
        source.close()


@dataclass(frozen=True, slots=True)
class _Layout:
    """The single-device serving layout asked for."""

    dtype: str
    jdtype: jnp.dtype
    fuse: bool
    packed: bool
    dual: bool

    @property
    def keeps_codes(self) -> bool:
        """Whether a GGUF's integer codes stay in coded panels: in float32
        (coded_matmul.cc), and in bfloat16 where the CPU's bfloat16 dot
        products take the codes themselves (coded_bf16_matmul.cc) and no AMX
        tiles would multiply bfloat16 panels faster at prefill; elsewhere a
        bfloat16 model dequantizes them at load like any other tensor."""
        if not self.packed:
            return False
        if jnp.dtype(self.jdtype) == jnp.float32:
            return True
        return jnp.dtype(self.jdtype) == jnp.bfloat16 and codes_in_bfloat16()

    @property
    def widen(self) -> bool:
        """Whether bfloat16 values are kept in widened panels (float32 serving)."""
        return (self.keeps_codes and jnp.dtype(self.jdtype) == jnp.float32
                and widened_panels_enabled())

    def config(self, config: DecoderConfig, coded_weights: tuple[tuple[str, int], ...]
               ) -> DecoderConfig:
        """The serving config the layout builds from a checkpoint's config."""
        if self.fuse:
            config = dataclasses.replace(config, fused_projections=True)
        if self.packed:
            config = coded_config(packed_config(config, self.dual, self.jdtype), coded_weights)
        return config

    def key(self, model_path: Path) -> LayoutInputs:
        """What the layout of this checkpoint depends on (the layout cache's key)."""
        cpu = (("avx512", cpu_has_avx512()), ("amx", cpu_has_amx()),
               ("float32 kernels", kernels_serve(jnp.float32)),
               ("bfloat16 kernels", kernels_serve(jnp.bfloat16)),
               ("widened panels", self.widen))
        return LayoutInputs(model_path, self.dtype, self.fuse, self.packed, self.dual, cpu)


def _build_state(source: CheckpointSource, config: DecoderConfig, layout: _Layout
                 ) -> tuple[DecoderConfig, ModelState]:
    """Read the checkpoint, then fuse and pack as the layout asks."""
    graphdef, abstract_params = nnx.split(
        nnx.eval_shape(lambda: CausalLM(config, dtype=layout.jdtype)))
    coded = _coded_panels(source, config, layout.widen) if layout.keeps_codes else None
    params = _read_params(nnx.to_pure_dict(abstract_params), source, layout.jdtype)
    state = ModelState(graphdef=graphdef, params=params)
    if layout.fuse:
        config, state = fuse_projections(config, state, layout.jdtype)
    if layout.packed:
        config, state = pack_projections(config, state, layout.jdtype, dual=layout.dual,
                                         coded=coded)
    return config, state


def _single_device_state(source: CheckpointSource, config: DecoderConfig, layout: _Layout
                         ) -> tuple[DecoderConfig, ModelState]:
    """The serving config and state: from the layout cache (esurge.models.layout_cache)
    when it holds this checkpoint's layout, else built and stored there."""
    cache = LayoutCache.from_env() if layout.fuse else None
    if cache is None:
        return _build_state(source, config, layout)
    digest = layout.key(source.path).digest()
    found: list[tuple[DecoderConfig, nnx.GraphDef[CausalLM]]] = []

    def abstract_for(metadata: dict[str, str]) -> dict[str, Any]:
        coded = tuple((str(role), int(bits))
                      for role, bits in json.loads(metadata.get("coded_weights", "[]")))
        serving = layout.config(config, coded)
        graphdef, abstract = nnx.split(
            nnx.eval_shape(lambda: CausalLM(serving, dtype=layout.jdtype)))
        found.append((serving, graphdef))
        return nnx.to_pure_dict(abstract)

    params = cache.read(digest, abstract_for)
    if params is not None:
        source.close()
        serving, graphdef = found[-1]
        log.info("serving layout read from the layout cache (%s)", cache.directory)
        return serving, ModelState(graphdef=graphdef, params=params)
    config, state = _build_state(source, config, layout)
    cache.write_in_background(digest, state.params,
                              {"coded_weights": json.dumps(config.coded_weights)})
    return config, state


def _coded_panels(source: CheckpointSource, config: DecoderConfig, widen: bool
                  ) -> CodedPanels:
    """The projections served from the checkpoint's own integer codes (a GGUF's
    4- and 8-bit blocks; esurge.models.coded_layout) and, where the model
    serves float32 (widen), from its own bfloat16 values; logged."""
    start = time.perf_counter()
    coded = read_coded_panels(source, config)
    if widen:
        coded = coded.widened(widened_roles(source, config, coded.bits))
    if coded.bits:
        log.info("serving %s from the checkpoint's own values (%.1fs to pack codes)",
                 ", ".join(f"{role} ({'bfloat16' if bits == WIDENED_BITS else f'{bits}-bit'})"
                           for role, bits in coded.coded_weights),
                 time.perf_counter() - start)
    return coded


def codes_in_bfloat16() -> bool:
    """Whether a bfloat16 model keeps a GGUF's codes here: the CPU kernels serve
    bfloat16 (AVX512_BF16) and no AMX tiles would multiply dequantized bfloat16
    panels faster at prefill (the coded kernel has no AMX path)."""
    return kernels_serve(jnp.bfloat16) and not cpu_has_amx()


def resolve_dtype(requested: str, source: CheckpointSource, hf_config: Any) -> tuple[str, str]:
    """The serving dtype for `requested` ("auto", "float32" or "bfloat16") and why.

    auto: the checkpoint's own precision where this backend runs it on a fast
    path. On CPU a bfloat16 checkpoint is served in bfloat16 where the CPU
    multiplies bfloat16 natively (AVX512_BF16, AMX) and the kernels build,
    and so is a quantized GGUF where those dot products take its codes
    (AVX512_BF16 without AMX: coded_bf16_matmul.cc; SmolLM2's 4-bit model
    there decodes 1.0-1.5x faster than with float32 activations up to 16
    rows, and prefills faster); every other checkpoint, and those elsewhere,
    in float32: the C++ kernels serve float32, and XLA's CPU bfloat16 matmuls
    are tens of times slower than them.
    """
    if requested not in ("auto", *LOAD_DTYPES):
        raise InvalidConfigError("dtype", f"dtype must be 'auto' or one of "
                                          f"{sorted(LOAD_DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested, "asked for"
    stored = source.stored_precision(hf_config)
    backend = jax.default_backend()
    if backend == "cpu":
        if stored == "float32":
            return "float32", "float32 checkpoint"
        if stored == "bfloat16" and kernels_serve(jnp.bfloat16):
            return "bfloat16", ("bfloat16 checkpoint; this CPU's native bfloat16 dot products "
                                "serve it (AVX512_BF16" + (", AMX)" if cpu_has_amx() else ")"))
        if stored == "quantized" and codes_in_bfloat16():
            # Under tensor parallelism the codes are dequantized (coded weights
            # need one device): bfloat16 panels still halve float32's bytes.
            return "bfloat16", ("quantized checkpoint; this CPU's native bfloat16 dot products "
                                "serve it (AVX512_BF16; on one device they multiply its codes)")
        why = ("this CPU has no native bfloat16 dot product" if stored == "bfloat16"
               else "the CPU kernels serve it in float32")
        return "float32", (f"{stored} checkpoint upcast: {why}, and float32 there is "
                           "faster than XLA's CPU bfloat16")
    if stored == "float32":
        return "float32", f"float32 checkpoint on {backend}"
    return "bfloat16", f"{stored} checkpoint on {backend}"


def _peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_model(model_path: str | Path, dtype: str = "auto", *,
               fuse: bool = True, pack: bool | None = None,
               tensor_parallel_size: int = 1) -> LoadedModel:
    """Load a checkpoint (an HF directory or a .gguf file) for serving.

    dtype: "auto" (see resolve_dtype), "float32" or "bfloat16".
    fuse: bring the projections into the serving layout (esurge.models.fusion);
    False keeps the checkpoint's own module tree and parameter names.
    pack: also store them in column panels for the CPU matmul kernel (needs
    fuse); None packs where the kernels serve the dtype (XLA:CPU, float32).
    tensor_parallel_size: split the model over that many devices
    (esurge.models.tensor_parallel); InvalidConfigError naming the field when
    the heads do not divide or the devices do not exist.
    """
    if pack and not fuse:
        raise ValueError("pack=True needs fuse=True")
    mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
    start = time.perf_counter()
    source = open_checkpoint(model_path)
    hf_config = source.hf_config()
    dtype, reason = resolve_dtype(dtype, source, hf_config)
    log.info("dtype %s (%s)", dtype, reason)
    architecture = architecture_of(hf_config)
    config = decoder_config_from_hf(hf_config, policy_for(architecture))
    jdtype = LOAD_DTYPES[dtype]
    packed = fuse and (kernels_serve(jdtype) if pack is None else pack)
    # Without AVX-512 the panels serve small buckets only (packed_linear.py).
    dual = not cpu_has_avx512()
    if mesh is not None:
        try:
            abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(config, dtype=jdtype)))[1]
            config, state = load_onto_mesh(nnx.to_pure_dict(abstract), source, config,
                                           jdtype, mesh, fuse, packed, dual)
        finally:
            source.close()
    else:
        layout = _Layout(dtype, jdtype, fuse, packed, dual)
        config, state = _single_device_state(source, config, layout)
    hf_tokenizer = source.tokenizer()
    jax.block_until_ready(state.params)
    log.info("loaded %s (%s, %s) in %.1fs; peak host memory %.0f MiB", source.path,
             architecture, source.kind, time.perf_counter() - start, _peak_rss_mib())
    return LoadedModel(
        model_state=state,
        config=config,
        hf_config=hf_config,
        architecture=architecture,
        vocab_size=config.vocab_size,
        eos_token_ids=source.eos_token_ids(hf_config),
        dtype=dtype,
        model_dir=source.path,
        source_kind=source.kind,
        dtype_reason=reason,
        hf_tokenizer=hf_tokenizer,
        mesh=mesh,
    )
