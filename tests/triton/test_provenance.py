"""Which bytes answered: the router reads the content digest and the signer from the sidecar's
/stage answer, puts them on its response as parameters and in its log with the request id. The
router's logic against the real sidecar, then the whole path in a real Triton."""

from __future__ import annotations

import asyncio
import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import tritonclient.grpc.aio as grpcclient

from sidecar.process.examples import write_adapter
from tests.support.api import StartSidecar
from tests.support.s3 import S3Registry
from tests.support.settings import make_settings
from tests.support.signing_keys import key_policy, make_key, sign_with_key
from tests.support.waiting import eventually
from tests.triton.harness import ROUTER, import_router
from tests.triton.node import StartNodeSidecar, TritonNode
from tests.triton.standin_vllm.answer import expected_text

routing = import_router()
WEIGHTS = "adapter_model.safetensors"


def sums_digest(folder: Path) -> str:
    """The content digest from the files on disk, as an operator computes it with sha256sum."""
    lines = "".join(f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}\n"
                    for n in sorted(p.name for p in folder.iterdir())
                    if n not in ("model.sig", ".sidecar.json"))
    return f"sha256:{hashlib.sha256(lines.encode()).hexdigest()}"


async def test_the_router_hears_the_digest_and_signer_of_the_lease_it_generates_with(
    tmp_path: Path, start_sidecar: StartSidecar, http: aiohttp.ClientSession,
) -> None:
    key = make_key(tmp_path / "keys", "acme-2026")
    write_adapter(tmp_path / "registry" / "acme-signed-v1")
    sign_with_key(tmp_path / "registry" / "acme-signed-v1", key)
    write_adapter(tmp_path / "registry" / "plain-v1", seed=1)
    sidecar = await start_sidecar(make_settings(tmp_path, signing_policy=key_policy(
        tmp_path, key, mode="verify-if-present", name="acme-2026")))
    client = routing.SidecarClient(routing.RouterSettings(sidecar_url=sidecar.url))
    heard: list[Any] = []

    def generate(prompt: str, sampling_json: str) -> list[str]:
        return ["text"]

    try:
        text = await asyncio.to_thread(routing.route, "hi", "acme-signed-v1", None, client,
                                       generate, on_lease=heard.append)
        plain = await asyncio.to_thread(client.stage, "plain-v1")
    finally:
        client.close()

    assert text == "text"
    (lease,) = heard
    published = sidecar.store.path_of("acme-signed-v1")
    identity = sidecar.rules.signing.rules[0].signers[0].identity
    assert routing.provenance(lease) == {"content_digest": sums_digest(published),
                                         "signer": "acme-2026", "signer_identity": identity}
    assert routing.provenance(plain) == {
        "content_digest": sums_digest(sidecar.store.path_of("plain-v1")), "signer": "",
        "signer_identity": ""}
    line = routing.provenance_line("req-7", plain)
    # The name vllm_model knows it by: its own, or a spare bound to it when the catalog's
    # generation was rendered before it was staged (which comes first is the machine's timing).
    async with http.get(f"{sidecar.url}/catalog") as response:
        bound = (await response.json())["spares"]["bound"]
    assert plain.lora_name == "plain-v1" or bound[plain.lora_name].split("@")[0] == "plain-v1"
    assert line.startswith("multilora_router answered request_id=req-7 adapter_id=plain-v1 "
                           f"lora_name={plain.lora_name} content_digest=sha256:")
    assert line.endswith(" signer=- signer_identity=-")


async def test_a_signed_adapters_answer_in_triton_carries_its_digest_and_signer(
    triton_node: TritonNode, tmp_path: Path, s3: S3Registry, node_sidecar: StartNodeSidecar,
    grpc: grpcclient.InferenceServerClient,
) -> None:
    key = make_key(tmp_path / "keys", "acme-2026")
    folder = tmp_path / "publisher" / "acme-signed-v1"
    write_adapter(folder, seed=21)
    sign_with_key(folder, key)
    files = s3.put_folder("acme-signed-v1", folder)
    sidecar = await node_sidecar(signing_policy=key_policy(tmp_path, key, name="acme-2026"))
    prompt = np.array([b"which bytes?"], dtype=object)
    inputs = []
    for name, value in (("prompt", prompt), ("adapter_id", np.array([b"acme-signed-v1"],
                                                                     dtype=object))):
        tensor = grpcclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)

    result = await grpc.infer(ROUTER, inputs, request_id="audit-42", client_timeout=120)

    answer = result.as_numpy("generated_text").reshape(-1)[0].decode()
    assert answer == expected_text(files[WEIGHTS], "which bytes?")
    on_disk = sidecar.store.path_of("acme-signed-v1")
    identity = sidecar.rules.signing.rules[0].signers[0].identity
    facts = {"content_digest": sums_digest(on_disk), "signer": "acme-2026",
             "signer_identity": identity}
    outputs = {name: result.as_numpy(name).reshape(-1)[0].decode() for name in facts}
    assert outputs == facts
    parameters = {k: v.string_param for k, v in result.get_response().parameters.items()}
    log = triton_node.server.log_path.read_text(errors="replace")
    if "this Python backend has no response parameters" in log:  # Triton 2.51 (pytriton)
        assert parameters == {}
    else:
        assert parameters == facts
    # lora_name: a spare catalog name bound to the adapter (no engine reload).
    expected_line = re.compile(
        r"multilora_router answered request_id=audit-42 adapter_id=acme-signed-v1 "
        rf"lora_name=\S+ content_digest={facts['content_digest']} "
        rf"signer=acme-2026 signer_identity={identity}")

    def logged() -> bool:
        return expected_line.search(
            triton_node.server.log_path.read_text(errors="replace")) is not None

    await eventually(logged, timeout_s=5, poll_s=0.1,
                     what=lambda: f"the router's line logged\n{triton_node.server.log_tail()}")
    shutil.rmtree(folder)
