"""The checked-in stubs of every service match their .proto; the stubs import package-relative."""

import re

import pytest

from kdist.rpc import regenerate


@pytest.mark.parametrize("service", regenerate.SERVICES, ids=lambda service: service.proto.stem)
def test_checked_in_stubs_are_up_to_date(service, tmp_path):
    generated = regenerate.regenerate(service, tmp_path)
    assert len(generated) == 2
    for path in generated:
        checked_in = service.generated_directory / path.name
        assert checked_in.read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), (
            f"{checked_in} is stale: run `python -m kdist.rpc.regenerate`."
        )


@pytest.mark.parametrize("service", regenerate.SERVICES, ids=lambda service: service.proto.stem)
def test_generated_service_stub_imports_package_relative(service):
    stem = service.proto.stem
    text = (service.generated_directory / f"{stem}_pb2_grpc.py").read_text()
    assert f"from . import {stem}_pb2" in text
    assert not re.search(rf"^import {stem}_pb2", text, re.MULTILINE)


def test_an_edited_proto_makes_the_checked_in_stubs_stale(tmp_path):
    # Negative control: the comparison above sees a .proto edited without regenerating.
    service = regenerate.SERVICES[1]
    proto = tmp_path / service.proto.name
    proto.write_text(service.proto.read_text(encoding="utf-8") + "\nmessage Planted { int64 field = 1; }\n",
                     encoding="utf-8")
    edited = regenerate.Service(proto, service.generated_directory)
    [message_stub, _] = regenerate.regenerate(edited, tmp_path / "out")
    checked_in = service.generated_directory / message_stub.name
    assert checked_in.read_text(encoding="utf-8") != message_stub.read_text(encoding="utf-8")
