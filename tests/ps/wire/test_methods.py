"""The method table matches the generated variable-service stub."""

import re

from kdist.ps.wire.methods import METHODS, SERVICE_NAME
from kdist.rpc import regenerate


def test_method_table_matches_the_generated_stub():
    from kdist.ps.wire._generated import variable_service_pb2_grpc as stubs

    service = regenerate.SERVICES[0]
    assert service.proto.name == "variable_service.proto"
    text = (service.generated_directory / "variable_service_pb2_grpc.py").read_text()
    paths = set(re.findall(rf"'(/{re.escape(SERVICE_NAME)}/\w+)'", text))
    assert paths == {method.path for method in METHODS.values()}
    assert hasattr(stubs, "VariableServiceStub")
    assert set(METHODS) == {name for name in dir(stubs.VariableServiceServicer)
                            if not name.startswith("_")}
