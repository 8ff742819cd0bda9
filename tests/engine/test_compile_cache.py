"""The persistent compile cache is on for library users too, and configurable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
from esurge.engine.compile_cache import enable_compile_cache
print(json.dumps(enable_compile_cache()))
"""

_ENGINE = """
import json, sys
from esurge import SamplingParams, eSurge
from esurge.config import CacheConfig, Config, SchedulerConfig
config = Config(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                CacheConfig(num_pages=16, page_size=8, enable_prefix_caching=True))
with eSurge(sys.argv[1], config, show_progress=False, warmup=False) as llm:
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))
print(json.dumps(out[0].outputs[0].token_ids))
"""


def _run(script: str, env: dict[str, str], *args: str) -> str:
    base = {k: v for k, v in os.environ.items()
            if k not in ("ESURGE_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_an_engine_fills_the_cache_directory(tmp_path: Path, tiny_llama_dir: Path) -> None:
    cache = tmp_path / "xla"
    tokens = json.loads(_run(_ENGINE, {"ESURGE_COMPILE_CACHE": str(cache)}, str(tiny_llama_dir)))
    assert len(tokens) == 2
    assert cache.is_dir() and any(cache.iterdir())


def test_jax_own_setting_wins_and_empty_turns_it_off(tmp_path: Path) -> None:
    jax_dir, ours = str(tmp_path / "jax"), str(tmp_path / "ours")
    assert json.loads(_run(_PROBE, {"JAX_COMPILATION_CACHE_DIR": jax_dir,
                                    "ESURGE_COMPILE_CACHE": ours})) == jax_dir
    assert json.loads(_run(_PROBE, {"ESURGE_COMPILE_CACHE": ours})) == ours
    assert json.loads(_run(_PROBE, {"ESURGE_COMPILE_CACHE": ""})) is None
