"""compose/client.py without a server: what a person sees when Triton is not there, or when
the command line is wrong. (Its calls through a real Triton are in test_triton.py.)"""

from __future__ import annotations

import pytest

from compose import client
from tests.triton.harness import free_port


def test_unreachable_triton_is_named_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"127.0.0.1:{free_port()}"

    code = client.main(["--url", url, "--adapter-id", "a1", "--prompt", "hi", "--timeout", "10"])

    assert code == client.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert f"cannot reach Triton's gRPC endpoint at {url}" in err
    assert "gRPC port (8001 by default)" in err


@pytest.mark.parametrize(("sampling", "expected"), [
    ("{max_tokens: 3}", "not JSON"),
    ("[1]", "must be a JSON object"),
])
def test_bad_sampling_parameters_are_a_usage_error(
    capsys: pytest.CaptureFixture[str], sampling: str, expected: str
) -> None:
    code = client.main(["--adapter-id", "a1", "--prompt", "hi", "--sampling-parameters", sampling])

    assert code == client.EXIT_USAGE
    assert expected in capsys.readouterr().err
