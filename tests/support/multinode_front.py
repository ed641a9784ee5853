"""A serving node's front without Triton, for the multi-node test: it takes KServe-v2 HTTP
inference requests for multilora_router, and for each one stages the adapter through its
sidecar and releases it with the router's own code (triton_repo/.../routing.py), answering
with Triton's HTTP statuses (UNAVAILABLE 503, NOT_FOUND 404, INVALID_ARG 400, INTERNAL 500).
"Generation" checks that the adapter's files are on disk while the lease holds them.

    python tests/support/multinode_front.py --listen 127.0.0.2:8000 \\
        --sidecar http://127.0.0.1:8500 \\
        --cache-root /path/to/cache --name node-2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "triton_repo" / "multilora_router"
                       / "1"))
import routing

HTTP_STATUS = {"UNAVAILABLE": 503, "NOT_FOUND": 404, "INVALID_ARG": 400, "INTERNAL": 500}
INFER_PATH = "/v2/models/multilora_router/infer"


class _Front(ThreadingHTTPServer):
    daemon_threads = True
    sidecar: routing.SidecarClient
    adapters_dir: Path
    name: str
    generate_s: float


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Front

    def do_GET(self) -> None:
        if self.path in ("/v2/health/ready", "/v2/health/live"):
            self._answer(200, {})
        else:
            self._answer(404, {"error": f"no such path {self.path}"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != INFER_PATH:
            self._answer(404, {"error": f"no such path {self.path}"})
            return
        inputs = {i["name"]: i["data"][0] for i in body.get("inputs", [])}
        header = self.headers.get("x-adapter-id")
        parameters = json.dumps({"x-adapter-id": header}) if header is not None else None
        try:
            adapter_id = routing.requested_adapter_id(inputs.get("adapter_id"), parameters)
            text = routing.route(str(inputs.get("prompt", "")), adapter_id,
                                 inputs.get("sampling_parameters"), self.server.sidecar,
                                 self._generate)
        except routing.RouteError as exc:
            self._answer(HTTP_STATUS[exc.status], {"error": exc.message})
            return
        self._answer(200, {"model_name": "multilora_router", "outputs": [
            {"name": "generated_text", "datatype": "BYTES", "shape": [1], "data": [text]}]})

    def _generate(self, prompt: str, sampling_json: str) -> Iterator[str]:
        lora_name = json.loads(sampling_json)["lora_name"]
        # As the engine does: the name's path in the catalog the sidecar rendered.
        catalog = json.loads((self.server.adapters_dir.parent / "multi_lora.json").read_text())
        if lora_name not in catalog:
            raise routing.VllmError(f"LoRA {lora_name} is not supported, we currently support "
                                    f"{list(catalog)[:5]}")
        folder = Path(catalog[lora_name])
        if not (folder / "adapter_config.json").is_file():
            raise routing.VllmError(f"Loading lora {lora_name} failed: No adapter found for "
                                    f"{folder}")
        time.sleep(self.server.generate_s)  # as an engine takes time to generate
        # The adapter whose folder the name led to (a spare name leads to its adapter's).
        yield f"adapter={folder.resolve().name} node={self.server.name}"

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True, help="host:port")
    parser.add_argument("--sidecar", required=True, help="the sidecar's API URL")
    parser.add_argument("--cache-root", required=True, type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--generate-s", type=float, default=0.0,
                        help="seconds each request's generation takes")
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    server = _Front((host, int(port)), _Handler)
    server.sidecar = routing.SidecarClient(routing.RouterSettings(sidecar_url=args.sidecar,
                                                                hold_s=0.0))
    server.adapters_dir = args.cache_root / "adapters"
    server.name = args.name
    server.generate_s = args.generate_s
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
