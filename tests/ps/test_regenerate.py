"""The checked-in stubs match the .proto, and the method table matches the stubs."""

import re

from kdist.ps import regenerate
from kdist.ps.methods import METHODS, SERVICE_NAME


def test_checked_in_stubs_are_up_to_date(tmp_path):
    generated = regenerate.regenerate(tmp_path)
    for path in generated:
        checked_in = regenerate.GENERATED_DIRECTORY / path.name
        assert checked_in.read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), (
            f"kdist/ps/_generated/{path.name} is stale: run `python -m kdist.ps.regenerate`."
        )


def test_generated_service_stub_imports_package_relative():
    text = (regenerate.GENERATED_DIRECTORY / "variable_service_pb2_grpc.py").read_text()
    assert "from . import variable_service_pb2" in text
    assert not re.search(r"^import variable_service_pb2", text, re.MULTILINE)


def test_method_table_matches_the_generated_stub():
    from kdist.ps._generated import variable_service_pb2_grpc as stubs

    text = (regenerate.GENERATED_DIRECTORY / "variable_service_pb2_grpc.py").read_text()
    paths = set(re.findall(rf"'(/{re.escape(SERVICE_NAME)}/\w+)'", text))
    assert paths == {method.path for method in METHODS.values()}
    assert hasattr(stubs, "VariableServiceStub")
    assert set(METHODS) == {name for name in dir(stubs.VariableServiceServicer)
                            if not name.startswith("_")}


def test_checked_in_worker_service_stubs_are_up_to_date(tmp_path):
    for path in regenerate.regenerate_worker_service(tmp_path):
        checked_in = regenerate.WORKER_GENERATED_DIRECTORY / path.name
        assert checked_in.read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), (
            f"kdist/coordinator/_generated/{path.name} is stale: run `python -m kdist.ps.regenerate`."
        )
    text = (regenerate.WORKER_GENERATED_DIRECTORY / "worker_service_pb2_grpc.py").read_text()
    assert "from . import worker_service_pb2" in text
