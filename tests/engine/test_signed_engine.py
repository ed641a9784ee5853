"""Signed adapters with the real engine: a gRPC client -> multilora_router -> the sidecar under a
signing policy (moto S3) -> vllm_model on the stock backend -> vLLM on CPU. The router's answer
for a signed adapter carries the content digest and the signer of the bytes vLLM read, and they
match the files on disk; an unsigned one is refused before the engine sees it.

One node for the module: an engine start costs about 40 s and 3 GB on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from tests.engine.harness import MAX_TOKENS, PROMPT, EngineAssets
from tests.engine.node import EngineNode, _bytes_input, status_of
from tests.support.signing_keys import KeyPair, key_policy, make_key, sign_with_key
from tests.support.waiting import eventually_blocking
from tests.triton.harness import ROUTER

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

SIGNED = "acme-tenant-0"
UNSIGNED = "acme-unsigned-1"


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> KeyPair:
    return make_key(tmp_path_factory.mktemp("keys"), "acme-2026")


@pytest.fixture(scope="module")
def node(start_engine_node: object, engine_assets: EngineAssets, key: KeyPair,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineNode]:
    publisher = tmp_path_factory.mktemp("publisher")
    signed = shutil.copytree(engine_assets.adapter("tenant-0"), publisher / SIGNED)
    sign_with_key(signed, key)
    unsigned = shutil.copytree(engine_assets.adapter("tenant-1"), publisher / UNSIGNED)
    policy = key_policy(publisher, key, match='prefix = "acme-"', name="acme-2026")
    node: EngineNode = start_engine_node(  # type: ignore[operator]
        adapters={SIGNED: signed, UNSIGNED: unsigned},
        sidecar_args=["--signing-policy", str(policy)])
    yield node


def sha256sums_digest(folder: Path) -> str:
    """What an operator computes from the published folder: sha256sum of every file but the
    signature and the record, sorted by name, hashed once more."""
    names = sorted(p.name for p in folder.iterdir() if p.name not in ("model.sig",
                                                                        ".sidecar.json"))
    text = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n"
                   for n in names)
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


def test_the_routers_answer_names_the_digest_and_signer_of_the_bytes_on_disk(
    node: EngineNode, engine_assets: EngineAssets, key: KeyPair
) -> None:
    inputs = [_bytes_input("prompt", PROMPT), _bytes_input("adapter_id", SIGNED),
              _bytes_input("sampling_parameters", json.dumps({"max_tokens": MAX_TOKENS}))]
    client = node.client()
    try:
        result = client.infer(ROUTER, inputs, request_id="audit-7", client_timeout=300)
    finally:
        client.close()

    text = result.as_numpy("generated_text").reshape(-1)[0].decode()
    assert text == engine_assets.text("tenant-0")  # the signed copy answers as tenant-0 does
    facts = {name: result.as_numpy(name).reshape(-1)[0].decode()
             for name in ("content_digest", "signer", "signer_identity")}
    on_disk = node.cache_root / "adapters" / SIGNED
    pem = key.public.read_bytes()
    assert facts == {"content_digest": sha256sums_digest(on_disk), "signer": "acme-2026",
                     "signer_identity": f"sha256:{hashlib.sha256(pem).hexdigest()}"}
    record = json.loads((on_disk / ".sidecar.json").read_text())
    assert record["content_digest"] == facts["content_digest"]
    assert record["signature"]["signer"] == "acme-2026"
    # The router logs its line once the answer is sent: it may land a moment after.
    eventually_blocking(
        lambda: re.search(rf"request_id=audit-7 adapter_id={SIGNED} lora_name=\S+ "
                          rf"content_digest={facts['content_digest']} signer=acme-2026 ",
                          node.server.log_path.read_text(errors="replace")),
        timeout_s=30, what="the router's provenance line in Triton's log")


def test_an_unsigned_adapter_under_require_never_reaches_the_engine(node: EngineNode) -> None:
    with pytest.raises(InferenceServerException) as caught:
        node.ask(UNSIGNED)

    assert status_of(caught.value) == "INVALID_ARGUMENT"
    assert "signature_missing" in caught.value.message()
    assert not (node.cache_root / "adapters" / UNSIGNED).exists()
    # No name the engine can be asked for leads to it (the catalog and every name's link).
    assert UNSIGNED not in (node.cache_root / "multi_lora.json").read_text()
    links = [p for p in (node.cache_root / "catalog").rglob("*") if p.is_symlink()]
    assert links and not any(UNSIGNED in str(p.readlink()) for p in links)
