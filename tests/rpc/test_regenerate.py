"""The checked-in stubs of every service match their .proto, import on kdist's declared floors,
and import package-relative."""

import re
from importlib.metadata import requires

import pytest

from kdist.rpc import regenerate


def _declared_floor(distribution):
    """The `>=` floor kdist's metadata declares for `distribution`, as a tuple of ints."""
    [requirement] = [r for r in requires("kdist") if re.match(rf"{distribution}\s*[>=<!~;\[]", r)]
    return regenerate.parse_version(re.search(r">=\s*([0-9.]+)", requirement).group(1))


@pytest.mark.parametrize("service", regenerate.SERVICES, ids=lambda service: service.proto.stem)
def test_checked_in_stubs_are_up_to_date(service, tmp_path):
    # Whatever grpcio-tools the test environment has: what the stubs mean must be equal,
    # their version stamps and cosmetics may differ (the next test checks the stamps).
    generated = regenerate.regenerate(service, tmp_path)
    assert len(generated) == 2
    for path in generated:
        checked_in = service.generated_directory / path.name
        assert regenerate.stub_contents(checked_in) == regenerate.stub_contents(path), (
            f"{checked_in} is stale: regenerate it (kdist/rpc/regenerate.py's docstring says how)."
        )


@pytest.mark.parametrize("service", regenerate.SERVICES, ids=lambda service: service.proto.stem)
def test_checked_in_stubs_import_on_the_declared_floors(service):
    stamped = regenerate.stamped_versions(service)
    assert stamped.grpcio <= _declared_floor("grpcio")
    assert stamped.protobuf <= _declared_floor("protobuf")
    assert stamped.grpcio == regenerate.parse_version(regenerate.GENERATOR_VERSION)


def test_stubs_from_a_newer_generator_are_caught_by_the_floor_check(tmp_path):
    # Negative control: stubs as grpcio-tools 1.85.4 stamps them (the ones that broke a
    # fresh install) are above the declared floors, which the check above refuses.
    service = regenerate.SERVICES[0]
    for name in regenerate.stub_names(service):
        text = (service.generated_directory / name).read_text(encoding="utf-8")
        text = re.sub(r"GRPC_GENERATED_VERSION = '[0-9.]+'", "GRPC_GENERATED_VERSION = '1.85.4'", text)
        text = re.sub(r"# Protobuf Python Version: [0-9.]+", "# Protobuf Python Version: 7.35.1", text)
        (tmp_path / name).write_text(text, encoding="utf-8")
    stamped = regenerate.stamped_versions(service, tmp_path)
    assert stamped.grpcio > _declared_floor("grpcio")
    assert stamped.protobuf > _declared_floor("protobuf")


def test_cosmetic_differences_are_ignored_and_meaning_is_not(tmp_path):
    service = regenerate.SERVICES[1]
    _, service_stub = regenerate.stub_names(service)
    text = (service.generated_directory / service_stub).read_text(encoding="utf-8")
    cosmetic = re.sub(r"^class (\w+)\(object\):", r"class \1:", text, flags=re.MULTILINE)
    cosmetic = re.sub(r"GRPC_GENERATED_VERSION = '[0-9.]+'", "GRPC_GENERATED_VERSION = '9.9.9'", cosmetic)
    renamed = text.replace("/kdist.", "/kdistx.", 1)
    assert renamed != text
    for name, variant in (("cosmetic.py", cosmetic), ("renamed.py", renamed)):
        (tmp_path / name.replace(".py", "_pb2_grpc.py")).write_text(variant, encoding="utf-8")
    original = regenerate.stub_contents(service.generated_directory / service_stub)
    assert regenerate.stub_contents(tmp_path / "cosmetic_pb2_grpc.py") == original
    assert regenerate.stub_contents(tmp_path / "renamed_pb2_grpc.py") != original


def test_writing_the_checked_in_stubs_needs_the_floor_generator(monkeypatch, capsys):
    monkeypatch.setattr(regenerate, "_installed_generator_version", lambda: "1.85.4")
    monkeypatch.setattr(regenerate, "regenerate", lambda *a, **k: pytest.fail("wrote stubs"))
    assert regenerate.main([]) == 2
    assert "grpcio-tools==1.74.0" in capsys.readouterr().err


@pytest.mark.parametrize("service", regenerate.SERVICES, ids=lambda service: service.proto.stem)
def test_generated_service_stub_imports_package_relative(service):
    stem = service.proto.stem
    text = (service.generated_directory / f"{stem}_pb2_grpc.py").read_text()
    assert f"from . import {stem}_pb2" in text
    assert not re.search(rf"^import {stem}_pb2", text, re.MULTILINE)


@pytest.mark.parametrize("service", regenerate.SERVICES, ids=lambda service: service.proto.stem)
def test_an_edited_proto_makes_the_checked_in_stubs_stale(service, tmp_path):
    # Negative control: the comparison above sees a .proto edited without regenerating,
    # in the messages stub (a new message) and in the service stub (a new method).
    proto_text = service.proto.read_text(encoding="utf-8")
    service_name = re.search(r"^service (\w+) \{", proto_text, re.MULTILINE).group(1)
    planted = (proto_text.replace(f"service {service_name} {{",
                                  f"service {service_name} {{\n  rpc Planted(PlantedMessage) returns (PlantedMessage);", 1)
               + "\nmessage PlantedMessage { int64 field = 1; }\n")
    proto = tmp_path / service.proto.name
    proto.write_text(planted, encoding="utf-8")
    edited = regenerate.Service(proto, service.generated_directory)
    for stub in regenerate.regenerate(edited, tmp_path / "out"):
        checked_in = service.generated_directory / stub.name
        assert regenerate.stub_contents(checked_in) != regenerate.stub_contents(stub)
