"""The proto API's tooling: buf lint is clean, generated/ is fresh, the service shape holds."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from generated.esurge.v1 import engine_pb2, service_pb2

REPO = Path(__file__).resolve().parents[2]
BUF = Path(sys.executable).parent / "buf"

pytestmark = pytest.mark.timeout(120)


def _buf_lint(root: Path) -> subprocess.CompletedProcess[str]:
    assert BUF.is_file(), f"buf CLI missing at {BUF}: install the dev extras (buf-bin)"
    return subprocess.run([str(BUF), "lint"], cwd=root, capture_output=True, text=True,
                          check=False, timeout=90)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_buf_lint_is_clean() -> None:
    result = _buf_lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_buf_lint_catches_an_uncommented_field(tmp_path: Path) -> None:
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    proto = tmp_path / "protos" / "esurge" / "v1" / "engine.proto"
    text = proto.read_text()
    proto.write_text(text.replace("  uint32 num_accepted_tokens = 11;\n",
                                  "  uint32 num_accepted_tokens = 11;\n  uint32 Extra = 12;\n"))
    result = _buf_lint(tmp_path)
    assert result.returncode != 0
    assert 'Field "Extra" should have a non-empty comment' in result.stdout  # COMMENTS rules
    assert 'Field name "Extra" should be lower_snake_case' in result.stdout  # STANDARD rules


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    out = tmp_path / "generated"
    subprocess.run([sys.executable, str(REPO / "tools" / "gen_proto.py"), "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=90)
    fresh, committed = _tree(out), _tree(REPO / "generated")
    assert sorted(fresh) == sorted(committed), "run `make proto`: file set differs"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert stale == [], f"run `make proto`: stale {stale}"


def test_generated_modules_import_as_the_generated_package() -> None:
    assert engine_pb2.__name__ == "generated.esurge.v1.engine_pb2"
    assert "esurge.v1" not in sys.modules
    text = (REPO / "generated" / "esurge" / "v1" / "service_pb2_grpc.py").read_text()
    assert "from generated.esurge.v1 import service_pb2" in text


def test_engine_service_methods_and_streaming_shape() -> None:
    service = service_pb2.DESCRIPTOR.services_by_name["EngineService"]
    assert service.full_name == "esurge.v1.EngineService"
    shape = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert shape == {
        "Generate": (False, True),
        "GenerateUnary": (False, False),
        "EngineStream": (True, True),
        "Abort": (False, False),
        "Tokenize": (False, False),
        "Detokenize": (False, False),
        "GetModelInfo": (False, False),
        "GetServerInfo": (False, False),
        "GetLoad": (False, False),
    }
